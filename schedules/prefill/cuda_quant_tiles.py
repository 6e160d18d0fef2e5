"""The 8-bit side of the CUDA tensor-core prefill (:mod:`.cuda_tensor_core`): staging quantized
K/V rows (:mod:`kvtvm.quant`) and turning them into the float16 / bfloat16 tiles the MMAs read.
HAND-WRITTEN TIR pieces (macros and CUDA helpers), used only when ``spec.k_storage`` or
``spec.v_storage`` is set; a full-precision spec never reaches this module.

- A K (or V) tile's rows are copied into shared memory **as stored** -- ``quant_row_bytes(D)``
  bytes each (``D`` codes, the float32 scale, padding), 16-byte ``cp.async`` chunks, zero-filled
  past the segment -- into a raw stage buffer of int32 words (``STAGES`` stages).
- Once a tile has landed, every thread converts 16-code chunks of it, **unscaled**, into the
  same float16 / bfloat16 tile (same stage, same element layout: padded rows, or wgmma core
  matrices) the full-precision kernel copies into, so the MMAs are unchanged. The conversions
  are exact: int8 codes (-127..127) and every float8_e4m3fn value are float16 and bfloat16
  values. int8 -> float16 through the float16 magic number (``0x6400 | (code + 128)`` is
  ``1024 + code + 128``), int8 -> bfloat16 through the float32 one, e4m3 through
  ``cvt.rn.f16x2.e4m3x2`` on sm_89+ (bit placement and an exact float16 rescale before).
- The row scales stay in the raw stage (the word after the codes) and are applied in float32
  outside the MMAs: ``S[i, j] *= scale_k[j]`` on the score fragment before masking and the
  softmax, and ``P'[i, j] = P[i, j] * scale_v[j]`` before P is rounded for the P V product (the
  running sum takes the unscaled P). float16 P' is pre-multiplied by a power of two
  (:func:`v_prescale`) so that small-scale rows stay clear of float16 subnormals, and O divided
  by it before the epilogue (exact).
"""

from __future__ import annotations

from kvtvm.kernels._tvm import T
from kvtvm.quant import QMAX, quant_row_bytes

#: 4 codes (one int32 word) -> two b32 registers of float16 / bfloat16 pairs, per (storage,
#: dtype); PTX only (no cuda_fp16.h / cuda_bf16.h needed).
_CONV4 = {
    ("int8", "float16"): r"""
__device__ __forceinline__ void kvtvm_i8x4_to_f16x4(unsigned* o, unsigned w) {
  // 0x6400 | (code + 128) is the float16 1024 + code + 128; minus 1152 (0x6480), exactly
  unsigned u = w ^ 0x80808080u;
  unsigned a = __byte_perm(u, 0x64646464u, 0x4140), b = __byte_perm(u, 0x64646464u, 0x4342);
  asm("sub.f16x2 %0, %1, %2;" : "=r"(o[0]) : "r"(a), "r"(0x64806480u));
  asm("sub.f16x2 %0, %1, %2;" : "=r"(o[1]) : "r"(b), "r"(0x64806480u));
}
""",
    ("int8", "bfloat16"): r"""
__device__ __forceinline__ void kvtvm_i8x4_to_bf16x4(unsigned* o, unsigned w) {
  // 0x4B0000 | (code + 128) is the float32 2**23 + code + 128; the difference is exact
  unsigned u = w ^ 0x80808080u;
  float f0 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7540)) - 8388736.0f;
  float f1 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7541)) - 8388736.0f;
  float f2 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7542)) - 8388736.0f;
  float f3 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7543)) - 8388736.0f;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(o[0]) : "f"(f1), "f"(f0));
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(o[1]) : "f"(f3), "f"(f2));
}
""",
}
#: e4m3 pair -> float16 pair, exact (shared with the tensor-core decode, which renames it).
E4M3X2_TO_F16X2 = r"""
__device__ __forceinline__ unsigned kvtvm_e4m3x2_to_f16x2(unsigned v) {
  unsigned r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((unsigned short)(v & 0xFFFFu)));
#else
  // the e4m3 bits placed in float16 bits are the value / 256 (exponent bias 15, not 7);
  // times 256 in float16 is exact (float16 arithmetic keeps subnormals)
  unsigned p = __byte_perm(v, 0u, 0x1404);
  unsigned h = (p & 0x80008000u) | ((p >> 1) & 0x3F803F80u);
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(h), "r"(0x5C005C00u));
#endif
  return r;
}
"""
_CONV4[("float8_e4m3fn", "float16")] = E4M3X2_TO_F16X2 + r"""
__device__ __forceinline__ void kvtvm_e4m3x4_to_f16x4(unsigned* o, unsigned w) {
  o[0] = kvtvm_e4m3x2_to_f16x2(w & 0xFFFFu);
  o[1] = kvtvm_e4m3x2_to_f16x2(w >> 16);
}
"""
#: float16 pair -> bfloat16 pair through float32 (exact for every e4m3 value).
F16X2_TO_BF16X2 = r"""
__device__ __forceinline__ unsigned kvtvm_f16x2_to_bf16x2(unsigned h) {
  float lo, hi;
  unsigned r;
  asm("{.reg .b16 l, u;\n mov.b32 {l, u}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, u;}"
      : "=f"(lo), "=f"(hi) : "r"(h));
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
"""
_CONV4[("float8_e4m3fn", "bfloat16")] = E4M3X2_TO_F16X2 + F16X2_TO_BF16X2 + r"""
__device__ __forceinline__ void kvtvm_e4m3x4_to_bf16x4(unsigned* o, unsigned w) {
  o[0] = kvtvm_f16x2_to_bf16x2(kvtvm_e4m3x2_to_f16x2(w & 0xFFFFu));
  o[1] = kvtvm_f16x2_to_bf16x2(kvtvm_e4m3x2_to_f16x2(w >> 16));
}
"""
_TAG = {"int8": "i8", "float8_e4m3fn": "e4m3", "float16": "f16", "bfloat16": "bf16"}


def _convert16_source(storage: str, dtype: str) -> tuple[str, str]:
    """(name, source) of the helper converting 16 staged codes at ``src`` (16-byte aligned)
    into 16 ``dtype`` values, the first 8 at ``d0`` and the last 8 at ``d1`` (each 16 bytes,
    16-byte aligned)."""
    conv4 = f"kvtvm_{_TAG[storage]}x4_to_{_TAG[dtype]}x4"
    name = f"kvtvm_{_TAG[storage]}x16_to_{_TAG[dtype]}"
    return name, _CONV4[(storage, dtype)] + f"""
__device__ __forceinline__ void {name}(void* d0, void* d1, const void* src) {{
  uint4 w = *reinterpret_cast<const uint4*>(src);
  unsigned o[8];
  {conv4}(o, w.x);
  {conv4}(o + 2, w.y);
  {conv4}(o + 4, w.z);
  {conv4}(o + 6, w.w);
  *reinterpret_cast<uint4*>(d0) = make_uint4(o[0], o[1], o[2], o[3]);
  *reinterpret_cast<uint4*>(d1) = make_uint4(o[4], o[5], o[6], o[7]);
}}
"""


def v_prescale(spec) -> float:
    """Power of two ``P * scale_v`` is multiplied by before it is rounded to float16 (1 for
    bfloat16, whose range is float32's): the largest keeping ``scale_v * 2**k`` below 2**15
    for any row of float16 values (``scale_v <= 65504 / QMAX``), so rows of small values keep
    float16's normal range."""
    if spec.dtype != "float16" or not spec.v_storage:
        return 1.0
    k = 0
    while 65504.0 / QMAX[spec.v_storage] * 2.0 ** (k + 1) < 32768.0:
        k += 1
    return 2.0 ** k


def raw_row_words(D: int) -> int:
    """int32 words of one staged quantized row (values, scale, padding)."""
    return quant_row_bytes(D) // 4


def quant_tiles(spec, BN: int, NT: int, DP: int, WG: bool):
    """The macros staging and converting the quantized side(s) of ``spec`` for a tensor-core
    prefill with ``BN``-position K/V tiles, ``NT`` threads, ``DP``-element tile rows and
    (``WG``) the wgmma core-matrix layout: ``(copy_raw, convert, scale)``.

    - ``copy_raw(raw, cache, lookup, b, h, page_size, stage, j0, kv_hi, tid)``: ``cp.async`` of
      the rows of positions ``j0 .. j0 + BN - 1`` into raw stage ``stage`` (zeros past
      ``kv_hi``); the segment's pages were checked by its pre-pass.
    - ``convert(tiles, stage, tid)``: raw stage ``stage`` of each 8-bit side -> its tile stage
      ``stage``, unscaled; ``tiles = (Ks, Vs, Kraw, Vraw)``; one helper call a thread.
    - ``scale(raw, stage, j)``: the float32 scale of row ``j`` of raw stage ``stage``.
    """
    D, layout, dtype = spec.head_dim, spec.layout, spec.dtype
    RW = raw_row_words(D)     # words of a staged row
    RC = RW // 4              # 16-byte chunks of a staged row
    C16 = D // 16             # 16-code chunks of a row's values
    DC = D // 8
    COPY_ITERS = (BN * RC + NT - 1) // NT
    CONV_ITERS = (BN * C16 + NT - 1) // NT
    from kvtvm.kernels.accessor import cache_index

    def tile_off(row, c8):
        """Element offset of the 8-element chunk ``c8`` of row ``row`` in a tile stage."""
        if WG:
            return ((row // 8) * DC + c8) * 64 + row % 8 * 8
        return row * DP + c8 * 8

    @T.macro
    def copy_raw(raw, cache, lookup, b, h, page_size, stage, j0, kv_hi, tid):
        for it in T.unroll(COPY_ITERS):
            if it * NT + tid < BN * RC:
                pc = T.min(j0 + (it * NT + tid) // RC, kv_hi - 1)
                T.evaluate(T.ptx["cp.async.cg.shared.global"](
                    raw.ptr_to([(stage * BN + (it * NT + tid) // RC) * RW
                                + (it * NT + tid) % RC * 4]),
                    cache.ptr_to(list(cache_index(
                        layout, T.Cast("int64", lookup[b, T.truncdiv(pc, page_size)]),
                        T.truncmod(pc, page_size), h, (it * NT + tid) % RC * 16))), 16,
                    T.Cast("uint32", T.if_then_else(j0 + (it * NT + tid) // RC < kv_hi,
                                                    16, 0))))

    # one helper call converts every chunk a thread owns, K's and V's: TVM's sync pass would
    # put a barrier between two calls (they write and read the one merged shared buffer)
    sides = [i for i, st in enumerate((spec.k_storage, spec.v_storage)) if st]
    helpers = [_convert16_source(st, dtype) for st in (spec.k_storage, spec.v_storage) if st]
    tags = "_".join(_TAG[st] for st in (spec.k_storage, spec.v_storage) if st)
    name = f"kvtvm_convert{CONV_ITERS}_{tags}_to_{_TAG[dtype]}"
    args = ", ".join(f"void* d{c}_{s}_0, void* d{c}_{s}_1, const void* s{c}_{s}"
                     for c in range(CONV_ITERS) for s in range(len(sides)))
    body = "".join(f"  if ({c} < n) {{ " + " ".join(
        f"{helpers[s][0]}(d{c}_{s}_0, d{c}_{s}_1, s{c}_{s});" for s in range(len(sides)))
        + " }\n" for c in range(CONV_ITERS))
    source = "".join(dict.fromkeys(src for _, src in helpers)) + (
        f"\n__device__ __forceinline__ void {name}(int n, {args}) {{\n{body}}}\n")

    def chunk_ptrs(tile, raw, stage, L):
        """Pointers of 16-code chunk ``L`` of a stage: its two tile halves and its codes."""
        return [tile.access_ptr("w", offset=stage * (BN * DP) + tile_off(L // C16, L % C16 * 2),
                                extent=8),
                tile.access_ptr("w", offset=stage * (BN * DP) + tile_off(L // C16,
                                                                         L % C16 * 2 + 1),
                                extent=8),
                raw.access_ptr("r", offset=(stage * BN + L // C16) * RW + L % C16 * 4,
                               extent=4)]

    def call(tiles, stage, tid):
        """Chunks ``tid``, ``tid + NT``, ... of every 8-bit side (the first ``n`` exist)."""
        ptrs = []
        for c in range(CONV_ITERS):
            for i in sides:
                ptrs += chunk_ptrs(tiles[i], tiles[2 + i], stage, c * NT + tid)
        n = T.truncdiv(BN * C16 - tid + NT - 1, NT)  # chunks c * NT + tid < BN * C16
        return T.cuda.func_call(name, n, *ptrs, source_code=source)

    @T.macro
    def convert(tiles, stage, tid):
        T.evaluate(call(tiles, stage, tid))

    def scale(raw, stage, j):
        return T.reinterpret("float32", raw[(stage * BN + j) * RW + D // 4])

    return copy_raw, convert, scale


def tile_shared_bytes(spec, knobs) -> int:
    """Dynamic shared memory of the tensor-core prefill of ``spec`` with ``knobs``: the Q tile,
    the K and V tile stages and, for each 8-bit side, its raw stages (0 for float32, whose simt
    kernel stages nothing)."""
    if spec.dtype == "float32":
        return 0
    D, NW, BN, STAGES = spec.head_dim, int(knobs["warps"]), int(knobs["tile_kv"]), \
        int(knobs["stages"])
    WG = bool(knobs.get("wgmma", 0))
    MT = 1 if WG else int(knobs["m_tiles"])
    DP = D if WG else D + 8
    raw = STAGES * BN * quant_row_bytes(D) * (bool(spec.k_storage) + bool(spec.v_storage))
    return 2 * (16 * NW * MT * DP + 2 * STAGES * BN * DP) + raw
