"""The TENSOR-CORE CUDA decode over an 8-bit cache (hand-written TIR; :mod:`.cuda_quant` runs it
where :func:`runs_by_default`, knob ``mma``, the default there): K and V both int8 /
float8_e4m3fn, float16 or bfloat16 queries, any GQA (past 8 in CTAs of at most 8 heads,
:func:`head_parts`), head_dim a multiple of 16 up to 128 (V in 32-column groups, the last one
zero-padded at 16, 48, 80, 112). bfloat16 queries take bfloat16 operands (``mma.sync ...
.bf16``), the codes converted through float32 (exact), and ``P'`` split into bfloat16 high and low parts. A K-only or V-only cache (the other
side 16-bit rows of the queries' dtype) runs here by default at head_dim 128
(:func:`one_sided_knobs`; an H100 checked its numerics and speed, 2026-11-27: 1.06-1.30x the
float16 cache), elsewhere when its knobs say so. A 16-bit K row's operand is its two
words as they are (the same permuted head_dim); a 16-bit V word holds two columns, so four
rows' words pair into two n8 tiles by byte permutes. Its staged rows are padded (K 8, V 4
banks mod 32) against bank conflicts.

Why: the CUDA-core kernel converts every staged code to float32 and spends ``2 * group`` FMAs
and a shuffle butterfly per code; on an H100 it ran at 1.0-1.26x the float16 cache's speed with
0.56x its bytes (instruction-bound). Here the group's query heads are the rows of
``mma.sync.m16n8k16`` (float16 operands, float32 accumulation; rows past the group are zero),
so a code costs about one conversion instruction (int8 through the float16 magic number, e4m3
through ``cvt.rn.f16x2.e4m3x2`` on sm_89+) and the products run on the tensor cores: 1.56-1.86x
the float16 cache at 16 x 4K, 64 x 4K, 256 x 1K and 1 x 32K on an H200 (docs/PERF.md,
2026-11-27; ``tools/gpu_decode_mma_probe.py``).

Layout (one CTA per (sequence, KV head, split); ``threads / 32`` warps, each owning 16 rows of
every K/V tile of ``16 * warps * chunks`` rows, staged as stored with zero-filled 16-byte
``cp.async`` into int32 words; lane ``l``: ``g = l // 4``, ``t = l % 4``):

- S = Q K^T: the 16 positions of a warp's rows are the two n8 halves; the reduction over
  head_dim is permuted (free, since Q is loaded once): k-step ``kb``'s logical columns
  ``2t, 2t + 1`` are dims ``kb + 4t, kb + 4t + 1`` and ``2t + 8, 2t + 9`` are ``kb + 4t + 2, +3``,
  so a lane's K operand is ONE int32 word of one row (4 codes).
- scores times ``scale_k[position] * sm_scale * log2(e)`` in float32, masked past the split, an
  online softmax over the 4 lanes of a query head (2 shuffles); ``P' = P * scale_v[position] *
  2**k`` (``v_prescale``: small-scale rows stay clear of subnormals) is the A operand of
  O += P' V with no shuffle (the S fragment's layout is the A fragment's), as a float16 high
  part plus the float16 rounding error of it (``p_split``, default 1: two MMAs over the same V
  operands, ~7% of the time; the result then differs from float64 attention by the float16
  output's own rounding alone, where one float16 P doubled that).
- V operand: a lane needs 4 positions (``2t, 2t+1, 2t+8, 2t+9``) of one head_dim column; it
  reads one word (4 columns) of each of the 4 rows and byte-permutes them into the operands of
  4 n8 tiles, whose columns are dims ``32 * grp + 4 * n + i`` (un-permuted when the output is
  written).
- The warps' (max, sum, O) meet in shared memory; the split-KV merge is the float16 kernel's.
"""

from __future__ import annotations

from kvtvm.cuda_limits import tensor_core_decode
from kvtvm.kernels._tvm import (ATTR_IS_SCHEDULED, ATTR_NOALIAS, T, alloc_buffer, block,
                               prim_func, tir)
from kvtvm.kernels.accessor import cache_index
from kvtvm.kernels.decode import (LN2, LOG2E, NAN, NEG, NEG_INFINITY, length_ok, match_params,
                                  signature, split_range)
from kvtvm.kernels.errflag import ERR_PAGE, ERR_POSITION
from kvtvm.quant import quant_row_bytes

from ..common import pages_bad_macro, replace_function
from ..prefill.cuda_quant_tiles import _CONV4, E4M3X2_TO_F16X2, F16X2_TO_BF16X2, v_prescale
from ..prefill.cuda_quant_tiles import _TAG as _PREFILL_TAG
from .cuda import _COMMIT, SMEM_STATIC_BYTES, _wait_source, merge_macro

#: e4m3 pair -> float16 pair, and float16 pair -> bfloat16 pair: the tensor-core prefill's
#: helpers, renamed per side (``{side}``) so that K's and V's copies never clash.
_E4M3X2 = E4M3X2_TO_F16X2.replace("kvtvm_e4m3x2_to_f16x2", "kvtvm_mma_e4m3x2_{side}")
_F16X2_TO_BF16X2 = F16X2_TO_BF16X2.replace("kvtvm_f16x2_to_bf16x2",
                                           "kvtvm_mma_f16x2_to_bf16x2_{side}")


def _k_frag_source(storage: str, dtype: str) -> str:
    """One int32 word (4 codes of one row) -> the two 16-bit pair registers of an m16n8k16 B
    operand (codes 0, 1 and codes 2, 3): the tensor-core prefill's 4-code converter behind
    this kernel's name."""
    conv = f"kvtvm_{_TAG[storage]}x4_to_{_PREFILL_TAG[dtype]}x4"
    return _CONV4[storage, dtype] + f"""
__device__ __forceinline__ void kvtvm_mma_k_{_TAG[storage]}{_SUFFIX[dtype]}(void* dst, int w) {{
  {conv}((unsigned*)dst, (unsigned)w);
}}
"""


#: byte ``i`` of two words -> one float16x2 register (the first word's code in the low half)
_V_PAIR = {
    ("int8", "float16"): r"""
__device__ __forceinline__ unsigned kvtvm_mma_pair_v(unsigned w0, unsigned w1, unsigned i) {
  unsigned p = (__byte_perm(w0 ^ 0x80808080u, w1 ^ 0x80808080u, i | ((4u + i) << 8))
                & 0x00FF00FFu) | 0x64006400u, r;
  asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(p), "r"(0x64806480u));
  return r;
}
""",
    ("float8_e4m3fn", "float16"): _E4M3X2.replace("{side}", "v") + r"""
__device__ __forceinline__ unsigned kvtvm_mma_pair_v(unsigned w0, unsigned w1, unsigned i) {
  return kvtvm_mma_e4m3x2_v(__byte_perm(w0, w1, i | ((4u + i) << 4)));
}
""",
    ("int8", "bfloat16"): r"""
__device__ __forceinline__ unsigned kvtvm_mma_pair_v(unsigned w0, unsigned w1, unsigned i) {
  float f0 = __uint_as_float(__byte_perm(w0 ^ 0x80808080u, 0x4B000000u, 0x7540u | i)) - 8388736.0f;
  float f1 = __uint_as_float(__byte_perm(w1 ^ 0x80808080u, 0x4B000000u, 0x7540u | i)) - 8388736.0f;
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(f1), "f"(f0));
  return r;
}
""",
    ("float8_e4m3fn", "bfloat16"): _E4M3X2.replace("{side}", "v")
    + _F16X2_TO_BF16X2.replace("{side}", "v") + r"""
__device__ __forceinline__ unsigned kvtvm_mma_pair_v(unsigned w0, unsigned w1, unsigned i) {
  return kvtvm_mma_f16x2_to_bf16x2_v(kvtvm_mma_e4m3x2_v(__byte_perm(w0, w1, i | ((4u + i) << 4))));
}
""",
}
#: Four words (one per position) -> the B operands of 4 n8 tiles, column ``i`` of each word
#: (``o[2i]``: positions 0, 1; ``o[2i + 1]``: positions 2, 3).
_V_FRAG = r"""
__device__ __forceinline__ void kvtvm_mma_v_{tag}(void* dst, int w0, int w1, int w2, int w3) {
  unsigned *o = (unsigned*)dst;
#pragma unroll
  for (unsigned i = 0; i < 4; ++i) {
    o[2 * i] = kvtvm_mma_pair_v((unsigned)w0, (unsigned)w1, i);
    o[2 * i + 1] = kvtvm_mma_pair_v((unsigned)w2, (unsigned)w3, i);
  }
}
"""


#: a 16-bit side: the K operand is the row's two words as they are (4 values, dims permuted as
#: an 8-bit word's codes); a V word holds 2 columns, so 4 rows' words give 2 n8 tiles (the low
#: halves, then the high halves: columns ``16 * grp + 2 * n + i``)
_RAW = {"k": r"""
__device__ __forceinline__ void kvtvm_mma_k_raw(void* dst, const void* src) {
  *(uint2*)dst = *(const uint2*)src;
}
""", "v": r"""
__device__ __forceinline__ void kvtvm_mma_v_raw(void* dst, int w0, int w1, int w2, int w3) {
  unsigned *o = (unsigned*)dst;
  o[0] = __byte_perm((unsigned)w0, (unsigned)w1, 0x5410u);
  o[1] = __byte_perm((unsigned)w2, (unsigned)w3, 0x5410u);
  o[2] = __byte_perm((unsigned)w0, (unsigned)w1, 0x7632u);
  o[3] = __byte_perm((unsigned)w2, (unsigned)w3, 0x7632u);
}
"""}


def _helpers(storage: str, side: str, dtype: str) -> str:
    """The CUDA source of side ``side`` ("k" or "v") over ``storage`` (None: 16-bit values)
    for ``dtype`` queries."""
    if not storage:
        return _RAW[side]
    if side == "k":
        return _k_frag_source(storage, dtype)
    return _V_PAIR[storage, dtype] + _V_FRAG.replace("{tag}", _TAG[storage] + _SUFFIX[dtype])


_TAG = {"int8": "i8", "float8_e4m3fn": "e4m3"}
_SUFFIX = {"float16": "", "bfloat16": "_bf16"}


#: Query heads one CTA takes as the rows of its m16 tiles (a lane holds one row's fragments).
MMA_ROWS = 8


def head_parts(group_size: int) -> tuple[int, int]:
    """``(parts, heads)``: a GQA group of more than :data:`MMA_ROWS` query heads is split into
    ``parts`` CTAs of at most ``heads`` query heads each over the same KV rows (16 -> 2 x 8,
    12 -> 2 x 6, 9 -> 2 x 5, 20 -> 3 x 7, 32 -> 4 x 8, the last part short). The parts of a KV head are neighbours in the
    grid, so the second read of its rows mostly hits L2."""
    parts = -(-group_size // MMA_ROWS)
    return parts, -(-group_size // parts)


def supported(spec) -> bool:
    """Whether this kernel can run ``spec``: one side 8-bit at least, float16 or bfloat16
    queries, any GQA (past 8 in head parts, :func:`head_parts`), head_dim a multiple of
    16 up to 128 (an 8-bit V of 48, 80 or 112 pads its last 32-column group with zeros). It
    runs by default where :func:`kvtvm.cuda_limits.tensor_core_decode` says (both sides 8-bit
    from head_dim 32; one side at head_dim 128); elsewhere with the knob ``mma``
    set."""
    return (bool(spec.k_storage or spec.v_storage) and spec.dtype in ("float16", "bfloat16")
            and spec.head_dim % 16 == 0 and spec.head_dim <= 128)


def runs_by_default(spec) -> bool:
    """Whether the schedule's default knobs hand ``spec`` to this kernel."""
    return tensor_core_decode(spec.dtype, spec.head_dim, spec.group_size, spec.k_storage,
                              spec.v_storage)


def one_sided_knobs(spec) -> dict:
    """Knobs that run a K-only or V-only ``spec`` on this kernel (the schedule's defaults where
    :func:`runs_by_default`): 2 warps of 32-row tiles, 3 stages at head_dim 128 (ptxas:
    177-199 registers, no spills on sm_80 and sm_90a), 2 stages below (some head_dim 64 and 32
    specs spill 4-8 bytes on sm_90a, where ptxas stops at 128 registers)."""
    return {"mma": 1, "threads": 64, "tile_tokens": 32, "stages": 3 if spec.head_dim >= 128 else 2}


def staged_words(spec, storage: str, side: str) -> int:
    """int32 words of one staged row of side ``side`` ("k" or "v") in shared memory: an 8-bit
    row as stored (values, scale, padding), or ``head_dim`` 16-bit values padded so that a
    warp's fragment loads meet no bank conflict (K: 8-byte loads, rows 8 banks apart; V:
    4-byte loads of rows 2t apart, 8t banks apart)."""
    if storage:
        return quant_row_bytes(spec.head_dim) // 4
    words = spec.head_dim // 2
    return words + ((8 if side == "k" else 4) - words) % 32


def geometry(spec, knobs) -> dict:
    """Warps, stages and tile rows within the static shared-memory limit: K and V stages of
    staged rows (:func:`staged_words`), the warps' output reduction and running (max, sum)."""
    if knobs.get("mma_short") and spec.k_storage and spec.v_storage:
        # the short_splits variant: 4 warps of 64 rows, 2 stages (a one-sided spec keeps its
        # knobs: 4 warps of 64 rows were never timed there and need more registers)
        knobs = dict(knobs, threads=128, tile_tokens=64, stages=2)
    W = max(1, int(knobs.get("threads", 128)) // 32)
    chunks = max(1, int(knobs.get("tile_tokens", 64)) // (16 * W))
    stages = max(2, int(knobs.get("stages", 2)))
    row = 4 * (staged_words(spec, spec.k_storage, "k") + staged_words(spec, spec.v_storage, "v"))

    heads = head_parts(spec.group_size)[1]

    def smem(w, c, s):
        return s * 16 * w * c * row + w * heads * (spec.head_dim + 2) * 4

    while smem(W, chunks, stages) > SMEM_STATIC_BYTES and chunks > 1:
        chunks -= 1
    while smem(W, chunks, stages) > SMEM_STATIC_BYTES and stages > 2:
        stages -= 1
    while smem(W, chunks, stages) > SMEM_STATIC_BYTES and W > 1:
        W //= 2
    return dict(warps=W, chunks=chunks, stages=stages, tile=16 * W * chunks, threads=32 * W,
                k_words=staged_words(spec, spec.k_storage, "k"),
                v_words=staged_words(spec, spec.v_storage, "v"),
                p_split=int(knobs.get("p_split", 1)))


def schedule(mod, spec, knobs):
    assert supported(spec), f"no tensor-core decode for {spec.uri}"
    H, G, Hq, D, dtype, layout, sliding = signature(spec)
    HP, GP = head_parts(G)                    # CTAs per KV head, query heads in each
    geo = geometry(spec, knobs)
    W, C, S, TILE, NT = geo["warps"], geo["chunks"], geo["stages"], geo["tile"], geo["threads"]
    RWK, RWV = geo["k_words"], geo["v_words"]   # staged row strides (int32 words)
    ks, vs = spec.k_storage, spec.v_storage
    # 16-byte chunks of a stored row, and the cache elements in one (8-bit: bytes)
    RCK, RCV = [quant_row_bytes(D) // 16 if st else D // 8 for st in (ks, vs)]
    EK, EV = [16 if st else 8 for st in (ks, vs)]
    KS = D // 16                              # k-steps of Q K^T
    CW = 4 if vs else 2                       # V columns per staged word
    # P V: groups of one word per row (8 * CW columns), CW n8 tiles each; an 8-bit V of a
    # head_dim that is not a multiple of 32 (48, 80, 112) pads its last group with zero words
    VG, VT = -(-D // (8 * CW)), CW
    V_WORDS = D // CW                         # staged words of V's codes (past them: the scale)
    PADDED = VG * 8 * CW != D
    COPIES_K, COPIES_V = -(-TILE * RCK // NT), -(-TILE * RCV // NT)
    PRE = v_prescale(spec)
    SPLIT = bool(geo["p_split"])
    merge_splits = merge_macro(spec, knobs)
    WAIT = _wait_source(S - 1)
    pages_bad = pages_bad_macro(NT)
    k_src, v_src = _helpers(ks, "k", dtype), _helpers(vs, "v", dtype)
    k_frag = f"kvtvm_mma_k_{_TAG[ks]}{_SUFFIX[dtype]}" if ks else "kvtvm_mma_k_raw"
    v_frag = f"kvtvm_mma_v_{_TAG[vs]}{_SUFFIX[dtype]}" if vs else "kvtvm_mma_v_raw"
    AB = "fp16" if dtype == "float16" else "bf16"

    def copy16(smem, words, elems, stage, row, chunk, cache, lookup, b, pos, hi, h, page_size):
        """Zero-filled ``cp.async`` of 16-byte chunk ``chunk`` (``elems`` cache elements) of
        position ``pos``'s row into a staged row of ``words`` (past ``hi``: zeros, from the
        split's last row's address)."""
        pc = T.Cast("int32", T.min(pos, hi - 1))
        ps = T.Cast("int32", page_size)
        page = T.Cast("int64", lookup[b, T.truncdiv(pc, ps)])
        src = cache_index(layout, page, T.Cast("int64", T.truncmod(pc, ps)), h, chunk * elems)
        return T.ptx["cp.async.cg.shared.global"](
            smem.ptr_to([(stage * TILE + row) * words + chunk * 4]), cache.ptr_to(list(src)), 16,
            T.Cast("uint32", T.if_then_else(pos < hi, 16, 0)))

    @T.macro
    def issue_tile(k_smem, v_smem, k_cache, v_cache, lookup, b, h, page_size, hi, tid, stage,
                   first):
        # K's and V's copies interleaved (each side may have its own count of chunks)
        for c in T.unroll(max(COPIES_K, COPIES_V)):
            if RCK == RCV:  # both 8-bit: one guard
                if c * NT + tid < TILE * RCK:
                    T.evaluate(copy16(k_smem, RWK, EK, stage, (c * NT + tid) // RCK, T.floormod(c * NT + tid, RCK), k_cache, lookup, b, first + (c * NT + tid) // RCK, hi, h, page_size))
                    T.evaluate(copy16(v_smem, RWV, EV, stage, (c * NT + tid) // RCV, T.floormod(c * NT + tid, RCV), v_cache, lookup, b, first + (c * NT + tid) // RCV, hi, h, page_size))
            else:
                if c * NT + tid < TILE * RCK:
                    T.evaluate(copy16(k_smem, RWK, EK, stage, (c * NT + tid) // RCK, T.floormod(c * NT + tid, RCK), k_cache, lookup, b, first + (c * NT + tid) // RCK, hi, h, page_size))
                if c * NT + tid < TILE * RCV:
                    T.evaluate(copy16(v_smem, RWV, EV, stage, (c * NT + tid) // RCV, T.floormod(c * NT + tid, RCV), v_cache, lookup, b, first + (c * NT + tid) // RCV, hi, h, page_size))

    def k_scale(stage, row, smem):
        """Row ``row``'s K scale times the softmax's (1 for a full-precision K)."""
        if not ks:
            return T.float32(1)
        return T.reinterpret("float32", smem[(stage * TILE + row) * RWK + D // 4])

    def v_scale(stage, row, smem):
        if not vs:
            return T.float32(1)
        return T.reinterpret("float32", smem[(stage * TILE + row) * RWV + D // 4])

    def v_word(smem, stage, row, word):
        """Staged word ``word`` of V row ``row``; past V's codes (the zero-padded last group of
        a head_dim that is not a multiple of 32), 0."""
        at = (stage * TILE + row) * RWV
        if not PADDED:
            return smem[at + word]
        return T.if_then_else(word < V_WORDS, smem[at + T.min(word, V_WORDS - 1)], 0)

    def k_operand(smem, stage, row, kk, tq):
        """The argument of the K converter: lane ``tq``'s word of the row in k-step ``kk``
        (8-bit: 4 codes) or the address of its two words (16-bit: 4 values)."""
        at = (stage * TILE + row) * RWK
        if ks:
            return smem[at + kk * 4 + tq]
        return smem.access_ptr("r", offset=at + kk * 8 + tq * 2, extent=2)

    def mma(a, a_off, b_, b_off, c, c_off):
        return T.ptx_legacy.mma("m16n8k16", "row", "col", AB, AB, "fp32", a.data, a_off,
                                b_.data, b_off, c.data, c_off, False, dtype="float32")

    # fmt: off
    @prim_func
    def decode(var_q: T.handle, var_k_cache: T.handle, var_v_cache: T.handle,
               var_cache_lengths: T.handle, var_lookup: T.handle, var_out: T.handle,
               var_lse: T.handle, var_o_part: T.handle, var_lse_part: T.handle,
               sm_scale: T.float32, window: T.int32, var_err: T.handle):
        T.func_attr({ATTR_NOALIAS: True, ATTR_IS_SCHEDULED: True})
        (batch, num_pages, page_size, max_pages, splits, q, k_cache, v_cache, cache_lengths,
         lookup, out, lse, o_part, lse_part, err) = match_params(
            spec, var_q, var_k_cache, var_v_cache, var_cache_lengths, var_lookup, var_out,
            var_lse, var_o_part, var_lse_part, var_err)
        for bx in T.thread_binding(T.Cast("int32", batch * H * HP * splits), thread="blockIdx.x"):
            for tid in T.thread_binding(NT, thread="threadIdx.x"):
                with block("attend"):
                    T.reads()
                    T.writes()
                    k_smem = alloc_buffer((S * TILE * RWK,), "int32", scope="shared")
                    v_smem = alloc_buffer((S * TILE * RWV,), "int32", scope="shared")
                    o_red = alloc_buffer((W, GP, D), "float32", scope="shared")
                    md_red = alloc_buffer((W, GP, 2), "float32", scope="shared")
                    qf = alloc_buffer((KS * 8,), dtype, scope="local")
                    kf = alloc_buffer((4,), dtype, scope="local")
                    vf = alloc_buffer((16,), dtype, scope="local")
                    sf = alloc_buffer((8,), "float32", scope="local")
                    pf = alloc_buffer((8,), dtype, scope="local")
                    pl = alloc_buffer((8,), dtype, scope="local")
                    of = alloc_buffer((VG * VT * 4,), "float32", scope="local")  # n8 tiles
                    vw = alloc_buffer((4,), "int32", scope="local")
                    st = alloc_buffer((4,), "float32", scope="local")  # m, d, m_new, alpha
                    bad = alloc_buffer((1,), "int32", scope="local")
                    ns: T.int32 = T.Cast("int32", splits)
                    # bx = ((b * H + h) * HP + part) * ns + s: a KV head's parts side by side
                    b: T.int32 = T.truncdiv(bx, H * HP * ns)
                    h: T.int32 = T.truncmod(T.truncdiv(bx, ns * HP), H)
                    part: T.int32 = T.truncmod(T.truncdiv(bx, ns), HP)
                    s: T.int32 = T.truncmod(bx, ns)
                    w: T.int32 = T.truncdiv(tid, 32)
                    lane: T.int32 = T.truncmod(tid, 32)
                    gq: T.int32 = T.truncdiv(lane, 4)
                    tq: T.int32 = T.truncmod(lane, 4)
                    lo64, hi64 = split_range(cache_lengths[b], window, s, splits, sliding,
                                             max_pages * page_size)
                    if tid == 0 and not length_ok(cache_lengths[b], max_pages * page_size):
                        err[ERR_POSITION] = 1
                    lo: T.int32 = T.Cast("int32", lo64)
                    hi: T.int32 = T.Cast("int32", hi64)
                    pages_bad(bad, lookup, b, T.truncdiv(lo, T.Cast("int32", page_size)),
                              T.if_then_else(hi > lo, T.truncdiv(hi - 1, T.Cast("int32", page_size)), -1),
                              num_pages, tid)
                    if tid == 0 and bad[0] != 0:
                        err[ERR_PAGE] = 1
                    ntiles: T.int32 = T.truncdiv(T.max(hi - lo, 0) + TILE - 1, TILE) * (1 - bad[0])
                    # Q as A operands (rows past the group are zero), dims permuted per k-step
                    for kk in T.unroll(KS):
                        for i in T.unroll(8):
                            qf[kk * 8 + i] = T.if_then_else(
                                tir.all(i % 4 < 2, gq < GP, part * GP + gq < G),
                                q[b, h * G + T.min(part * GP + gq, G - 1), kk * 16 + tq * 4 + i // 4 * 2 + i % 2],
                                T.Cast(dtype, T.float32(0)))
                    for i in T.unroll(VG * VT * 4):
                        of[i] = T.float32(0)
                    st[0] = T.float32(NEG)
                    st[1] = T.float32(0)
                    for pre in T.unroll(S - 1):
                        if pre < ntiles:
                            issue_tile(k_smem, v_smem, k_cache, v_cache, lookup, b, h, page_size, hi, tid, pre, lo + pre * TILE)
                        T.evaluate(T.cuda.func_call("kvtvm_cp_async_commit", source_code=_COMMIT))
                    for it in T.serial(ntiles):
                        if it + (S - 1) < ntiles:
                            issue_tile(k_smem, v_smem, k_cache, v_cache, lookup, b, h, page_size, hi, tid, T.floormod(it + S - 1, S), lo + (it + S - 1) * TILE)
                        T.evaluate(T.cuda.func_call("kvtvm_cp_async_commit", source_code=_COMMIT))
                        T.evaluate(T.cuda.func_call(f"kvtvm_cp_async_wait_{S - 1}", source_code=WAIT))
                        T.tvm_storage_sync("shared")
                        for c in T.unroll(C):
                            # this warp's 16 rows of the tile: S = Q K^T
                            for i in T.unroll(8):
                                sf[i] = T.float32(0)
                            for kk in T.unroll(KS):
                                for n in T.unroll(2):
                                    T.evaluate(T.cuda.func_call(
                                        k_frag, kf.access_ptr("w", offset=0, extent=4),
                                        k_operand(k_smem, T.floormod(it, S), (c * W + w) * 16 + n * 8 + gq, kk, tq),
                                        source_code=k_src))
                                    T.evaluate(mma(qf, kk * 8, kf, 0, sf, n * 4))
                            # scores (log2 units), masked past the split; the row max
                            st[2] = st[0]
                            for i in T.unroll(4):
                                sf[i // 2 * 4 + i % 2] = T.if_then_else(
                                    lo + it * TILE + (c * W + w) * 16 + i // 2 * 8 + tq * 2 + i % 2 < hi,
                                    sf[i // 2 * 4 + i % 2] * k_scale(T.floormod(it, S), (c * W + w) * 16 + i // 2 * 8 + tq * 2 + i % 2, k_smem) * sm_scale * T.float32(LOG2E),
                                    T.float32(NEG))
                                st[2] = T.max(st[2], sf[i // 2 * 4 + i % 2])
                            for x in T.unroll(2):
                                st[2] = T.max(st[2], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), st[2], 1 << x, 32, 32))
                            st[3] = T.exp2(st[0] - st[2])
                            st[0] = st[2]
                            st[1] = st[1] * st[3]
                            for i in T.unroll(VG * VT * 2):
                                of[i // 2 * 4 + i % 2] = of[i // 2 * 4 + i % 2] * st[3]
                            # P' = P * scale_v * 2**k as the A operand (rows g + 8: zero)
                            for i in T.unroll(8):
                                pf[i] = T.Cast(dtype, T.float32(0))
                                pl[i] = T.Cast(dtype, T.float32(0))
                            for i in T.unroll(4):
                                sf[i // 2 * 4 + i % 2] = T.if_then_else(
                                    lo + it * TILE + (c * W + w) * 16 + i // 2 * 8 + tq * 2 + i % 2 < hi,
                                    T.exp2(sf[i // 2 * 4 + i % 2] - st[0]), T.float32(0))
                                st[1] = st[1] + sf[i // 2 * 4 + i % 2]
                                sf[i // 2 * 4 + i % 2] = sf[i // 2 * 4 + i % 2] * v_scale(T.floormod(it, S), (c * W + w) * 16 + i // 2 * 8 + tq * 2 + i % 2, v_smem) * T.float32(PRE)
                                pf[i // 2 * 4 + i % 2] = T.Cast(dtype, sf[i // 2 * 4 + i % 2])
                                if SPLIT:  # the rounding error, as a second 16-bit operand
                                    pl[i // 2 * 4 + i % 2] = T.Cast(dtype, sf[i // 2 * 4 + i % 2] - T.Cast("float32", pf[i // 2 * 4 + i % 2]))
                            # O += P' V, one staged word of each of 4 rows at a time: 8 * CW
                            # columns, CW n8 tiles
                            for grp in T.unroll(VG):
                                for j in T.unroll(4):
                                    vw[j] = v_word(v_smem, T.floormod(it, S), (c * W + w) * 16 + j // 2 * 8 + tq * 2 + j % 2, grp * 8 + gq)
                                T.evaluate(T.cuda.func_call(
                                    v_frag, vf.access_ptr("w", offset=0, extent=16),
                                    vw[0], vw[1], vw[2], vw[3], source_code=v_src))
                                for i in T.unroll(VT):
                                    T.evaluate(mma(pf, 0, vf, i * 4, of, (grp * VT + i) * 4))
                                    if SPLIT:
                                        T.evaluate(mma(pl, 0, vf, i * 4, of, (grp * VT + i) * 4))
                        T.tvm_storage_sync("shared")
                    # the row's sum over its 4 lanes; the warps meet in shared memory
                    for x in T.unroll(2):
                        st[1] = st[1] + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), st[1], 1 << x, 32, 32)
                    if gq < GP:
                        for grp in T.unroll(VG):  # tile grp * VT + i, column 2 tq + e: dim
                            for i in T.unroll(VT):
                                for e in T.unroll(2):
                                    if PADDED:  # the padded columns are dropped
                                        if grp * 8 * VT + tq * 2 * VT + e * VT + i < D:
                                            o_red[w, gq, grp * 8 * VT + tq * 2 * VT + e * VT + i] = of[(grp * VT + i) * 4 + e]
                                    else:
                                        o_red[w, gq, grp * 8 * VT + tq * 2 * VT + e * VT + i] = of[(grp * VT + i) * 4 + e]
                        if tq == 0:
                            md_red[w, gq, 0] = st[0]
                            md_red[w, gq, 1] = st[1]
                    T.tvm_storage_sync("shared")
                    for r in T.serial(T.truncdiv(GP * D + NT - 1, NT)):
                        if tir.all(r * NT + tid < GP * D, part * GP + T.truncdiv(r * NT + tid, D) < G):
                            st[2] = T.float32(NEG)
                            for z in T.unroll(W):
                                st[2] = T.max(st[2], md_red[z, T.truncdiv(r * NT + tid, D), 0])
                            st[1] = T.float32(0)
                            st[0] = T.float32(0)
                            for z in T.unroll(W):
                                st[3] = T.exp2(md_red[z, T.truncdiv(r * NT + tid, D), 0] - st[2])
                                st[1] = st[1] + md_red[z, T.truncdiv(r * NT + tid, D), 1] * st[3]
                                st[0] = st[0] + o_red[z, T.truncdiv(r * NT + tid, D), T.truncmod(r * NT + tid, D)] * st[3]
                            st[0] = st[0] * T.float32(1.0 / PRE)
                            if splits == T.int64(1):
                                out[b, h * G + part * GP + T.truncdiv(r * NT + tid, D), T.truncmod(r * NT + tid, D)] = T.Cast(dtype, st[0] / st[1])
                                if T.truncmod(r * NT + tid, D) == 0:  # st[1] 0: every score -inf, lse NaN
                                    lse[b, h * G + part * GP + T.truncdiv(r * NT + tid, D)] = T.Select(st[1] == T.float32(0), T.float32(NAN), (st[2] + T.log2(st[1])) * T.float32(LN2))
                            elif tir.any(st[1] > T.float32(0), T.isnan(st[1])):  # NaN: kept (a NaN key)
                                o_part[s, b, h * G + part * GP + T.truncdiv(r * NT + tid, D), T.truncmod(r * NT + tid, D)] = st[0] / st[1]
                                if T.truncmod(r * NT + tid, D) == 0:
                                    lse_part[s, b, h * G + part * GP + T.truncdiv(r * NT + tid, D)] = st[2] + T.log2(st[1])
                            else:  # an empty split (NEG), or one whose scores were all -inf
                                o_part[s, b, h * G + part * GP + T.truncdiv(r * NT + tid, D), T.truncmod(r * NT + tid, D)] = T.float32(0)
                                if T.truncmod(r * NT + tid, D) == 0:
                                    lse_part[s, b, h * G + part * GP + T.truncdiv(r * NT + tid, D)] = T.Select(hi > lo, T.float32(NEG_INFINITY), T.float32(NEG))
        if splits > T.int64(1):
            merge_splits(batch, splits, out, lse, o_part, lse_part)
    # fmt: on
    return replace_function(mod, decode, "decode")

