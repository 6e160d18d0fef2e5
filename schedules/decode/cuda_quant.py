"""CUDA schedule of decode attention over a QUANTIZED cache (``kvtvm.kernels.decode``;
sm_90a and sm_80 alike), hand-written TIR. Where K and V are both 8-bit under float16 or
bfloat16 queries (any GQA, head_dim up to 128) the knob ``mma`` (default 1 there) hands
the spec to the tensor-core kernel of :mod:`.cuda_quant_mma`; this module's CUDA-core kernel
runs the rest. The 8-bit rows are staged in shared memory as they
are stored (values, scale, padding: ``quant_row_bytes(head_dim)`` bytes, 16-byte ``cp.async``
chunks, as int32 words; the cp.async helpers and the split-KV merge are the float16 kernel's,
``schedules/decode/cuda.py``). A thread owns a slice of head_dim for **every query head of its
part of the GQA group** (q and the output in registers; one part unless that would hold more
than :data:`HEAD_VALUES_PER_THREAD` values, knob ``head_split``), so each staged value is read
and converted once per part, not once per query head: int8 through the float32 magic number (``0x4B0000 | (code + 128)``
minus ``2**23 + 128``: a byte permute and an add, not the conversion unit, which runs at an
eighth of the float rate), e4m3 through the hardware pair conversion on sm_89+ (bit placement
and an exact float16 rescale elsewhere) -- both exact. The row scales are folded into scalars
(``score = scale_k * q.k``; ``acc += (p * scale_v) * v``). Either side may be full precision
instead (a K-only or V-only cache, a float16 / bfloat16 / float32 row of ``head_dim`` values):
its rows are staged as the float16 kernel stages them (``cuda._copy16``, the tile in the cache's
dtype), a thread's slice is loaded in 16-byte (or narrower) vectors and converted to float32,
and no scale is applied. K int8 with V float8_e4m3fn (or the reverse) is the 8-bit path with a
converter per side.
"""

from __future__ import annotations

from math import gcd

from kvtvm.errors import InvalidArgumentError
from kvtvm.kernels._tvm import (ATTR_IS_SCHEDULED, ATTR_NOALIAS, T, alloc_buffer, block,
                               prim_func, tir)
from kvtvm.kernels.accessor import cache_index
from kvtvm.kernels.decode import (LN2, LOG2E, NAN, NEG, NEG_INFINITY, length_ok, match_params,
                                  signature, split_range)
from kvtvm.kernels.errflag import ERR_PAGE, ERR_POSITION
from kvtvm.kernels.quant_access import head_split_choices, quant_vec_choices, word_row_scale
from kvtvm.quant import quant_row_bytes

from ..common import DTYPE_BYTES, pages_bad_macro, replace_function
from . import cuda_quant_mma
from .cuda import (_COMMIT, _CP_ASYNC, SMEM_KV_BYTES, _copy16, _wait_source, attend_smem_bytes,
                   fit_row_groups, merge_macro)


def staged_row_bytes(spec, storage: str) -> int:
    """Bytes of one staged row of a side stored as ``storage``: the 8-bit row
    (``quant_row_bytes(head_dim)``: values, scale, padding) or ``head_dim`` values of the
    cache's dtype (``""``, full precision)."""
    return quant_row_bytes(spec.head_dim) if storage else spec.head_dim * DTYPE_BYTES[spec.dtype]


def _copy16_words(smem, stage, row, col, cache, layout, lookup, b, pos, h, page_size):
    """``cp.async`` of the 16-byte chunk ``col`` (in bytes) of token ``pos``'s row into shared
    memory held as int32 words (``cuda._copy16`` for 8-bit rows; its page was checked by the
    block's page pre-pass). Positions and page sizes fit in int32: 32-bit division."""
    pos32, ps32 = T.Cast("int32", pos), T.Cast("int32", page_size)
    page = T.Cast("int64", lookup[b, T.truncdiv(pos32, ps32)])
    slot = T.Cast("int64", T.truncmod(pos32, ps32))
    src = cache[cache_index(layout, page, slot, h, col)]
    # access_ptr, not address_of(smem[...]): a point access lets TVM's
    # CompactBufferAllocation shrink the row to the words the kernel indexes
    # (D / 4 + 1: values and scale, not the padding), so rows would start
    # 4-aligned only (misaligned cp.async / int4) and the last 16-byte chunk
    # would spill into the next row; the pointer keeps the buffer whole
    words = smem.shape[2]
    dst = smem.access_ptr("w", offset=(stage * smem.shape[1] + row) * words + col // 4,
                          extent=4)
    return T.cuda.func_call("kvtvm_cp_async16", dst, T.address_of(src),
                            source_code=_CP_ASYNC)


#: e4m3 codes -> float16 (every e4m3 value is one, exactly): a helper of the float32 conversion.
_E4M3_TO_HALF4 = r"""
__device__ __forceinline__ void kvtvm_e4m3x4_to_half4(void* dst, int w) {
  unsigned u = (unsigned)w, lo, hi;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(lo) : "h"((unsigned short)(u & 0xFFFFu)));
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(hi) : "h"((unsigned short)(u >> 16)));
#else
  // the e4m3 bits placed in float16 bits are the value / 256 (exponent bias 15, not 7);
  // times 256 is exact (float16 arithmetic keeps subnormals)
  unsigned p0 = __byte_perm(u, 0u, 0x1404), p1 = __byte_perm(u, 0u, 0x3424);
  unsigned h0 = (p0 & 0x80008000u) | ((p0 >> 1) & 0x3F803F80u);
  unsigned h1 = (p1 & 0x80008000u) | ((p1 >> 1) & 0x3F803F80u);
  __half2 s = __float2half2_rn(256.0f);
  __half2 a = __hmul2(*reinterpret_cast<__half2*>(&h0), s);
  __half2 b = __hmul2(*reinterpret_cast<__half2*>(&h1), s);
  lo = *reinterpret_cast<unsigned*>(&a);
  hi = *reinterpret_cast<unsigned*>(&b);
#endif
  *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
}
"""
#: 4 stored 8-bit codes -> 4 float32 values at ``dst`` (16-byte aligned), exact.
_TO_FLOAT = {
    "int8": r"""
__device__ __forceinline__ void kvtvm_i8x4_to_float4(void* dst, int w) {
  // 0x4B0000 | (code + 128) is the float32 2**23 + code + 128: a byte permute and a subtraction
  unsigned u = (unsigned)w ^ 0x80808080u;
  float4 f;
  f.x = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7540)) - 8388736.0f;
  f.y = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7541)) - 8388736.0f;
  f.z = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7542)) - 8388736.0f;
  f.w = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7543)) - 8388736.0f;
  *reinterpret_cast<float4*>(dst) = f;
}
""",
    "float8_e4m3fn": _E4M3_TO_HALF4 + r"""
__device__ __forceinline__ void kvtvm_e4m3x4_to_float4(void* dst, int w) {
  uint2 h;
  kvtvm_e4m3x4_to_half4(&h, w);
  float2 a = __half22float2(*reinterpret_cast<__half2*>(&h.x));
  float2 b = __half22float2(*reinterpret_cast<__half2*>(&h.y));
  *reinterpret_cast<float4*>(dst) = make_float4(a.x, a.y, b.x, b.y);
}
""",
}
_CONVERT = {"int8": "kvtvm_i8x4_to_float4", "float8_e4m3fn": "kvtvm_e4m3x4_to_float4"}


def _convert4(storage, dst, word, dtype):
    """Convert the 4 codes of ``word`` into 4 float32 values at pointer ``dst``. The e4m3
    helpers use ``__half2``: TVM includes ``cuda_fp16.h`` for float16 kernels (and
    ``cuda_bf16.h``, which includes it, for bfloat16 ones), so a float32 kernel includes it
    with them (without it, float32 decode over a float8 side did not compile)."""
    source = _TO_FLOAT[storage]
    if storage == "float8_e4m3fn" and dtype == "float32":
        source = "\n#include <cuda_fp16.h>\n" + source
    return T.cuda.func_call(_CONVERT[storage], dst, word, source_code=source)


def default_knobs(spec) -> dict:
    # ``vec`` values of head_dim per thread for every query head of its part of the GQA group
    # (registers: 2 * heads per part * vec floats; ``head_split`` parts, see
    # :func:`default_head_split`), and enough row groups that a thread keeps at most 16 scores
    # (group x rows per tile); double-buffered 32-row tiles (16 for groups over 4). On an H100
    # (fp16 d128 GQA 4, 2026-11-25, docs/PERF.md) 64 or 128 threads, 32- or 64-row tiles, 2 or
    # 3 stages were within 3% of each other; vec 4 (32 threads per row) was 20% slower.
    # ``mma``: the tensor-core kernel (schedules/decode/cuda_quant_mma.py) where it runs the
    # spec: 1.56-1.86x the float16 cache's speed at 16 x 4K, 64 x 4K, 256 x 1K and 1 x 32K
    # on an H200, where this kernel ran at 1.0-1.26x (docs/PERF.md, 2026-11-27); it reads
    # threads, tile_tokens and stages as its warps, tile rows and stages
    # (its fastest at 16 x 4K and 1 x 32K on an H100 and an H200, GQA 4: 2 warps, 32-row
    # tiles, 3 stages; over GQA 4, 4 warps of 64 rows and 2 stages, where that spilled 4-12
    # bytes on sm_80; the short_splits variant's ``mma_short`` makes it 4 warps of 64 rows)
    vec = default_vec(spec)
    head_split = 0   # 0: default_head_split of the final vec (a tuning log's or the spec's)
    if cuda_quant_mma.runs_by_default(spec):
        if not (spec.k_storage and spec.v_storage):   # K-only or V-only
            return dict(cuda_quant_mma.one_sided_knobs(spec), merge_threads=256, vec=vec,
                        head_split=head_split)
        small = spec.group_size <= 4
        return {"threads": 64 if small else 128, "tile_tokens": 32, "stages": 3 if small else 2,
                "merge_threads": 256, "vec": vec, "head_split": head_split, "mma": 1}
    tile = 32 if spec.group_size <= 4 and not _wide_one_sided(spec, vec) else 16
    threads = min(256, max(128, spec.head_dim // vec * tile * spec.group_size // 16))
    return {"threads": threads, "tile_tokens": tile, "stages": 2, "merge_threads": 256,
            "vec": vec, "head_split": head_split, "mma": 0}


def _wide_one_sided(spec, vec: int) -> bool:
    """A K-only or V-only spec whose thread slice is 28 values or more (head_dim 112): the
    raw 16/32-bit slice of its full-precision side lives beside the converted one, and at
    32-row tiles ptxas spilled 24-36 bytes at GQA 4 over float32 queries whatever its register
    cap; 16-row tiles built without spills (sm_80 and sm_90a, 2026-11-28)."""
    return bool(spec.k_storage) != bool(spec.v_storage) and vec >= 28


def _widest_piece(n: int, cap: int) -> int:
    """The largest power of two up to ``cap`` that divides ``n``: the vector width of a
    slice's loads (a slice of ``n`` starts at a multiple of ``n``, so such loads are aligned)."""
    width = cap
    while n % width:
        width //= 2
    return width


def default_vec(spec) -> int:
    """The largest slice that keeps ``group * vec <= 32`` (q and the output of every head of
    the group in registers), at least one int32 word; at most 16 values when a side is full
    precision (its slice is held raw and converted: 32 values made ptxas spill at head_dim 64,
    GQA 1, on sm_80 and sm_90a; 16 use 90-96 registers) -- where a slice within those bounds
    exists: head_dim 48, 80, 96 and 112 often have none (their slices are 12, 20 or 28 values
    and up), so they take the smallest, and :func:`default_head_split` splits the group."""
    choices = quant_vec_choices(spec)
    cap = 32 if spec.k_storage and spec.v_storage else 16
    fits = [v for v in choices if spec.group_size * v <= 32 and v <= cap]
    return max(fits) if fits else choices[0]


#: Most query-head values (heads of a part x ``vec``) a thread holds in registers, as q and
#: as the output. With one part, 112 (d112 GQA 4) spilled 52-168 bytes and 160-224 (GQA 8 at
#: d80 and d112) 1-2 KiB (ptxas, sm_90a and sm_80); at 64, d112 GQA 8 (2 heads a part) still
#: spilled 24 bytes on sm_80; at 48, 82 of 92 specs (d48-d112, GQA 2-8) build without spills
#: and 10 (d96 / d112 at GQA 6, K-only / V-only d112 over float32 queries) spilled 4-32 bytes,
#: mostly on sm_80, where ptxas settled on 96-154 registers; since the build retries a spilling
#: kernel with -maxrregcount=255 (kvtvm.compiler.nvcc) and K-only / V-only d112 take 16-row
#: tiles (:func:`_wide_one_sided`), none of a grid of 80 float32-query specs spills.
HEAD_VALUES_PER_THREAD = 48


def default_head_split(spec, vec: int) -> int:
    """Parts the GQA group's query heads are split into (``head_split``): each part has its own
    threads (``ty``) over the same staged rows, so a staged value is converted once per part
    (once, with one part). The fewest parts that leave a thread at most
    :data:`HEAD_VALUES_PER_THREAD` values of q (and as many of the output): 1 wherever
    :func:`default_vec` found a slice with ``group * vec <= 32``."""
    G = spec.group_size
    return next(hs for hs in head_split_choices(spec) if G // hs * vec <= HEAD_VALUES_PER_THREAD)


#: CUDA's largest ``blockDim.z``; the row groups times the head parts run along it.
MAX_BLOCK_Z = 64


def _wavefronts(lane_words, width: int) -> int:
    """Shared-memory wavefronts of one warp's load of ``width`` int32 words a lane starting at
    ``lane_words[lane]``: 32-bit loads are served in one phase of 32 lanes, 64-bit ones in
    two of 16, 128-bit ones in four of 8; a phase takes as many wavefronts as the most distinct
    words asked of one bank (a word asked by several lanes is broadcast)."""
    per_phase = 32 // width
    total = 0
    for first in range(0, len(lane_words), per_phase):
        banks: dict[int, set] = {}
        for w0 in lane_words[first:first + per_phase]:
            for w in range(w0, w0 + width):
                banks.setdefault(w % 32, set()).add(w)
        total += max(len(words) for words in banks.values())
    return total


def row_wavefronts(head_dim: int, vec: int, bdx: int, head_split: int, rows_per_z: int,
                   stride: int) -> int:
    """Shared-memory wavefronts of one warp's pass over its staged 8-bit rows ``stride`` int32
    words apart: its slice loads and scale reads (:func:`_wavefronts`). A warp's lanes are
    ``bdx`` slices of ``32 / bdx / head_split`` rows ``rows_per_z`` apart (a row's head parts
    read the same words)."""
    nw = vec // 4
    wv = _widest_piece(nw, 4)
    total = 0
    for j in range(rows_per_z):
        rows = [(lane // bdx // head_split * rows_per_z + j) * stride for lane in range(32)]
        for c in range(nw // wv):
            total += _wavefronts([r + lane % bdx * nw + c * wv for lane, r in enumerate(rows)],
                                 wv)
        total += _wavefronts([r + head_dim // 4 for r in rows], 1)
    return total


def staged_pad_words(head_dim: int, vec: int, bdx: int, head_split: int,
                     rows_per_z: int) -> int:
    """Words of padding after each staged 8-bit row: 4 (one 16-byte chunk, so rows stay
    aligned for ``cp.async``) where that gives fewer wavefronts (:func:`row_wavefronts`: bank
    conflicts) than none, else 0. Unpadded rows of 16 words (d48) or 32 (d112) put a warp's
    rows on the same banks: 4- and 8-way conflicts, 1-way with the pad (wider pads won at most
    1 wavefront in 9 more, at d64, for up to 2.4x the staged bytes)."""
    words = quant_row_bytes(head_dim) // 4
    geo = (head_dim, vec, bdx, head_split, rows_per_z)
    return 4 if row_wavefronts(*geo, words + 4) < row_wavefronts(*geo, words) else 0


def check_layout(spec, knobs) -> None:
    """The typed error the kernel's geometry raises for a layout that does not fit, for the
    kernel ``knobs`` pick (tensor cores or CUDA cores; ``kvtvm.compiler.check_layout``)."""
    if _on_tensor_cores(spec, knobs):
        cuda_quant_mma.geometry(spec, knobs)
    else:
        geometry(spec, knobs)


def _on_tensor_cores(spec, knobs) -> bool:
    """Whether ``knobs`` hand ``spec`` to the tensor-core kernel (:mod:`.cuda_quant_mma`)."""
    return bool(knobs.get("mma")) and cuda_quant_mma.supported(spec)


def geometry(spec, knobs) -> dict:
    """Thread and tile shape of the attend kernel for ``spec`` and ``knobs``: ``bdx`` lanes
    along head_dim, ``head_split`` parts of the group, ``bdz`` row groups (``threadIdx.z``
    runs over row groups x head parts), and the staged rows' bytes (``k_stage`` /
    ``v_stage``: an 8-bit row with its bank padding)."""
    H, G, Hq, D, dtype, layout, sliding = signature(spec)
    vec = int(knobs.get("vec") or default_vec(spec))  # elements per thread along head_dim
    if vec not in quant_vec_choices(spec):
        raise InvalidArgumentError(f"decode knob vec={vec} for head_dim {D} {dtype}: choose from "
                                   f"{quant_vec_choices(spec)}")
    hs = int(knobs.get("head_split") or default_head_split(spec, vec))
    if hs not in head_split_choices(spec):
        raise InvalidArgumentError(f"decode knob head_split={hs} for group size {G}: choose "
                                   f"from {head_split_choices(spec)}")
    bdx = D // vec                           # <= 32: one warp segment reduces a score
    lanes = bdx * hs                         # threads of one row group
    step = 32 // gcd(lanes, 32)              # whole warps: the shuffles use a full lane mask
    if step * hs > MAX_BLOCK_Z:
        raise InvalidArgumentError(f"decode knob head_split={hs} for head_dim {D} (vec {vec}): "
                                   f"whole warps need {step * hs} > {MAX_BLOCK_Z} threads along z")
    bdz = max(1, int(knobs["threads"]) // lanes)
    bdz = min(-(-bdz // step) * step, MAX_BLOCK_Z // hs // step * step)
    stages = max(1, int(knobs["stages"]))
    tile = int(knobs["tile_tokens"])
    k_row, v_row = staged_row_bytes(spec, spec.k_storage), staged_row_bytes(spec, spec.v_storage)
    while tile > bdz and stages * tile * (k_row + v_row) > SMEM_KV_BYTES:
        tile //= 2
    tile = max(tile, bdz)
    tile -= tile % bdz                       # rows per tz are equal
    pad = 4 * staged_pad_words(D, vec, bdx, hs, tile // bdz)
    k_stage = k_row + (pad if spec.k_storage else 0)
    v_stage = v_row + (pad if spec.v_storage else 0)
    bdz, tile = fit_row_groups(
        spec, lanes, bdz, tile,
        lambda z, t: attend_smem_bytes(z, G, D, stages * t * k_stage, stages * t * v_stage))
    chunk = 16                               # bytes per 16-byte copy
    return dict(vec=vec, bdx=bdx, head_split=hs, bdz=bdz, threads=lanes * bdz, stages=stages,
                tile=tile, rows_per_z=tile // bdz, chunk=chunk, k_row=k_row, v_row=v_row,
                k_stage=k_stage, v_stage=v_stage, k_chunks=k_row // chunk,
                v_chunks=v_row // chunk)


def schedule(mod, spec, knobs):
    assert spec.k_storage or spec.v_storage, "CUDA quantized decode: K or V 8-bit"
    if _on_tensor_cores(spec, knobs):  # the tensor-core kernel
        return cuda_quant_mma.schedule(mod, spec, knobs)
    H, G, Hq, D, dtype, layout, sliding = signature(spec)
    g = geometry(spec, knobs)
    VEC, BDX, BDZ, NT, HS = g["vec"], g["bdx"], g["bdz"], g["threads"], g["head_split"]
    GP = G // HS                             # query heads of a part
    S, TILE, RPZ, CH = g["stages"], g["tile"], g["rows_per_z"], g["chunk"]
    # words of a slice per shared-memory load, and full-precision values per load: the widest
    # vectors (up to 16 bytes) that divide the slice (3, 5 or 7 words at head_dim 48, 80, 112)
    WV = _widest_piece(VEC // 4, 4)
    FV = _widest_piece(VEC, 16 // DTYPE_BYTES[dtype])
    merge_splits = merge_macro(spec, knobs)
    WAIT = _wait_source(S - 1)
    pages_bad = pages_bad_macro(NT)

    def smem_row(storage, stage_bytes):
        """(last extent, dtype) of a side's staged tile: int32 words of the 8-bit row and its
        bank padding, or head_dim values of the cache's dtype."""
        return (stage_bytes // 4, "int32") if storage else (D, dtype)

    (K_W, K_DT) = smem_row(spec.k_storage, g["k_stage"])
    (V_W, V_DT) = smem_row(spec.v_storage, g["v_stage"])

    # threadIdx.z runs over row groups x head parts: the row group and the query head (of the
    # group) of part-local head ``g`` (Python helpers: with one part, the plain index)
    def row_group(tzy):
        return tzy if HS == 1 else T.truncdiv(tzy, HS)

    def group_head(tzy, g):
        return g if HS == 1 else T.truncmod(tzy, HS) * GP + g

    def copier(storage):
        """``cp.async`` of 16-byte chunk ``chunk`` of a row into a staged tile."""
        if storage:
            return lambda smem, stage, row, chunk, *rest: _copy16_words(
                smem, stage, row, chunk * CH, *rest)
        return lambda smem, stage, row, chunk, *rest: _copy16(
            smem, stage, row, chunk * (CH // DTYPE_BYTES[dtype]), *rest)

    if spec.k_storage and spec.v_storage:    # both 8-bit: one loop copies K and V rows
        CPR = g["k_chunks"]
        COPIES = -(-TILE * CPR // NT)        # 16-byte chunks per thread per tile (K and V each)

        @T.macro
        def issue_tile(k_smem, v_smem, k_cache, v_cache, lookup, b, h, page_size, hi, tid,
                       stage, first):
            """``cp.async`` of the K and V rows of the tile starting at position ``first``
            into ``stage`` (rows at or past ``hi`` are not copied)."""
            for c in T.unroll(COPIES):
                if c * NT + tid < TILE * CPR:
                    if first + (c * NT + tid) // CPR < hi:
                        T.evaluate(_copy16_words(k_smem, stage, (c * NT + tid) // CPR, T.floormod(c * NT + tid, CPR) * CH, k_cache, layout, lookup, b, first + (c * NT + tid) // CPR, h, page_size))
                        T.evaluate(_copy16_words(v_smem, stage, (c * NT + tid) // CPR, T.floormod(c * NT + tid, CPR) * CH, v_cache, layout, lookup, b, first + (c * NT + tid) // CPR, h, page_size))
    else:                                    # rows of different sizes: a loop per side
        KC, VC = g["k_chunks"], g["v_chunks"]
        K_COPIES, V_COPIES = -(-TILE * KC // NT), -(-TILE * VC // NT)
        copy_k, copy_v = copier(spec.k_storage), copier(spec.v_storage)

        @T.macro
        def issue_tile(k_smem, v_smem, k_cache, v_cache, lookup, b, h, page_size, hi, tid,
                       stage, first):
            """``cp.async`` of the K rows, then the V rows, of the tile starting at position
            ``first`` into ``stage`` (rows at or past ``hi`` are not copied)."""
            for c in T.unroll(K_COPIES):
                if c * NT + tid < TILE * KC:
                    if first + (c * NT + tid) // KC < hi:
                        T.evaluate(copy_k(k_smem, stage, (c * NT + tid) // KC, T.floormod(c * NT + tid, KC), k_cache, layout, lookup, b, first + (c * NT + tid) // KC, h, page_size))
            for c in T.unroll(V_COPIES):
                if c * NT + tid < TILE * VC:
                    if first + (c * NT + tid) // VC < hi:
                        T.evaluate(copy_v(v_smem, stage, (c * NT + tid) // VC, T.floormod(c * NT + tid, VC), v_cache, layout, lookup, b, first + (c * NT + tid) // VC, h, page_size))

    def slice_loader(storage: str):
        """A macro converting thread ``tx``'s slice of a staged row into ``kv`` (float32):
        8-bit words through ``words``, full-precision values through ``raw``."""

        @T.macro
        def load_8bit(smem, words, raw, kv, stage, row, tx):
            for c in T.unroll(VEC // 4 // WV):  # 16-byte (or narrower) loads
                for w in T.vectorized(WV):
                    words[c * WV + w] = smem[stage, row, tx * (VEC // 4) + c * WV + w]
            for w in T.unroll(VEC // 4):
                T.evaluate(_convert4(storage, kv.access_ptr("w", offset=w * 4, extent=4), words[w], dtype))

        @T.macro
        def load_full(smem, words, raw, kv, stage, row, tx):
            for c in T.unroll(VEC // FV):     # 16-byte (or narrower) loads
                for v in T.vectorized(FV):
                    raw[c * FV + v] = smem[stage, row, tx * VEC + c * FV + v]
            for v in T.unroll(VEC):
                kv[v] = T.Cast("float32", raw[v])

        return load_8bit if storage else load_full

    def scaled(storage):
        """``x`` times the staged row's scale (an 8-bit side), or ``x`` (full precision)."""
        if storage:
            return lambda x, smem, stage, row: x * word_row_scale(smem, (stage, row), D, storage,
                                                                  fast=True)
        return lambda x, smem, stage, row: x

    k_scaled, v_scaled = scaled(spec.k_storage), scaled(spec.v_storage)
    load_k, load_v = slice_loader(spec.k_storage), slice_loader(spec.v_storage)

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
        for bx in T.thread_binding(T.Cast("int32", batch * H * splits), thread="blockIdx.x"):
            for tzy in T.thread_binding(BDZ * HS, thread="threadIdx.z"):
                for tx in T.thread_binding(BDX, thread="threadIdx.x"):
                    with block("attend"):
                        T.reads()
                        T.writes()
                        k_smem = alloc_buffer((S, TILE, K_W), K_DT, scope="shared")
                        v_smem = alloc_buffer((S, TILE, V_W), V_DT, scope="shared")
                        o_red = alloc_buffer((BDZ, G, D), "float32", scope="shared")
                        md_red = alloc_buffer((BDZ, G, 2), "float32", scope="shared")
                        q_reg = alloc_buffer((GP * VEC,), "float32", scope="local")
                        o_reg = alloc_buffer((GP * VEC,), "float32", scope="local")
                        kv = alloc_buffer((VEC,), "float32", scope="local")
                        words = alloc_buffer((VEC // 4,), "int32", scope="local")
                        raw = alloc_buffer((VEC,), dtype, scope="local")
                        s_reg = alloc_buffer((GP * RPZ,), "float32", scope="local")
                        st = alloc_buffer((GP * 4,), "float32", scope="local")  # per head: m, d, m_new, dot
                        bad = alloc_buffer((1,), "int32", scope="local")
                        ns: T.int32 = T.Cast("int32", splits)
                        b: T.int32 = T.truncdiv(bx, H * ns)
                        h: T.int32 = T.truncmod(T.truncdiv(bx, ns), H)
                        s: T.int32 = T.truncmod(bx, ns)
                        tid: T.int32 = tzy * BDX + tx
                        lo64, hi64 = split_range(cache_lengths[b], window, s, splits, sliding,
                                                 max_pages * page_size)
                        if tid == 0 and not length_ok(cache_lengths[b], max_pages * page_size):
                            err[ERR_POSITION] = 1
                        lo: T.int32 = T.Cast("int32", lo64)  # positions fit in int32
                        hi: T.int32 = T.Cast("int32", hi64)
                        # every page of the split is checked before any is staged: a page
                        # outside the pool empties the split and sets the flag
                        pages_bad(bad, lookup, b, T.truncdiv(lo, T.Cast("int32", page_size)),
                                  T.if_then_else(hi > lo, T.truncdiv(hi - 1, T.Cast("int32", page_size)), -1),
                                  num_pages, tid)
                        if tid == 0 and bad[0] != 0:
                            err[ERR_PAGE] = 1
                        ntiles: T.int32 = T.truncdiv(T.max(hi - lo, 0) + TILE - 1, TILE) * (1 - bad[0])
                        for g in T.unroll(GP):
                            for v in T.unroll(VEC):
                                q_reg[g * VEC + v] = T.Cast("float32", q[b, h * G + group_head(tzy, g), tx * VEC + v]) * sm_scale * T.float32(LOG2E)
                                o_reg[g * VEC + v] = T.float32(0)
                            st[g * 4] = T.float32(NEG)
                            st[g * 4 + 1] = T.float32(0)
                        # prologue: tiles 0 .. S-2 in flight
                        for pre in T.unroll(S - 1):
                            if pre < ntiles:
                                issue_tile(k_smem, v_smem, k_cache, v_cache, lookup, b, h, page_size, hi, tid, pre, lo + pre * TILE)
                            T.evaluate(T.cuda.func_call("kvtvm_cp_async_commit", source_code=_COMMIT))
                        for it in T.serial(ntiles):
                            # issue tile it + S - 1 into the stage freed at the end of it - 1
                            if it + (S - 1) < ntiles:
                                issue_tile(k_smem, v_smem, k_cache, v_cache, lookup, b, h, page_size, hi, tid, T.floormod(it + S - 1, S), lo + (it + S - 1) * TILE)
                            T.evaluate(T.cuda.func_call("kvtvm_cp_async_commit", source_code=_COMMIT))
                            T.evaluate(T.cuda.func_call(f"kvtvm_cp_async_wait_{S - 1}", source_code=WAIT))
                            T.tvm_storage_sync("shared")
                            # scores: the thread's slice of each row converted once, dotted with
                            # every query head of the group, each dot reduced over tx
                            for g in T.unroll(GP):
                                st[g * 4 + 2] = st[g * 4]
                            for j in T.unroll(RPZ):
                                load_k(k_smem, words, raw, kv, T.floormod(it, S), row_group(tzy) * RPZ + j, tx)
                                for g in T.unroll(GP):
                                    st[g * 4 + 3] = T.float32(0)
                                    for v in T.unroll(VEC):
                                        st[g * 4 + 3] = st[g * 4 + 3] + q_reg[g * VEC + v] * kv[v]
                                    for x in T.unroll(BDX.bit_length() - 1):
                                        st[g * 4 + 3] = st[g * 4 + 3] + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), st[g * 4 + 3], BDX >> (x + 1), BDX, 32)
                                    s_reg[g * RPZ + j] = T.if_then_else(lo + it * TILE + row_group(tzy) * RPZ + j < hi, k_scaled(st[g * 4 + 3], k_smem, T.floormod(it, S), row_group(tzy) * RPZ + j), T.float32(NEG))
                                    st[g * 4 + 2] = T.max(st[g * 4 + 2], s_reg[g * RPZ + j])
                            # online softmax (log2 units): rescale once per tile
                            for g in T.unroll(GP):
                                st[g * 4 + 1] = st[g * 4 + 1] * T.exp2(st[g * 4] - st[g * 4 + 2])
                                for v in T.unroll(VEC):
                                    o_reg[g * VEC + v] = o_reg[g * VEC + v] * T.exp2(st[g * 4] - st[g * 4 + 2])
                                st[g * 4] = st[g * 4 + 2]
                                for j in T.unroll(RPZ):
                                    s_reg[g * RPZ + j] = T.if_then_else(lo + it * TILE + row_group(tzy) * RPZ + j < hi, T.exp2(s_reg[g * RPZ + j] - st[g * 4]), T.float32(0))
                                    st[g * 4 + 1] = st[g * 4 + 1] + s_reg[g * RPZ + j]
                            for j in T.unroll(RPZ):
                                # rows past the split were not copied: stale shared memory may
                                # hold NaN bit patterns, and 0 * NaN is NaN
                                if lo + it * TILE + row_group(tzy) * RPZ + j < hi:
                                    load_v(v_smem, words, raw, kv, T.floormod(it, S), row_group(tzy) * RPZ + j, tx)
                                    for g in T.unroll(GP):
                                        st[g * 4 + 3] = v_scaled(s_reg[g * RPZ + j], v_smem, T.floormod(it, S), row_group(tzy) * RPZ + j)
                                        for v in T.unroll(VEC):
                                            o_reg[g * VEC + v] = o_reg[g * VEC + v] + st[g * 4 + 3] * kv[v]
                            T.tvm_storage_sync("shared")
                        # merge the BDZ row groups through shared memory
                        for g in T.unroll(GP):
                            for c in T.unroll(VEC // 4):
                                for v in T.vectorized(4):
                                    o_red[row_group(tzy), group_head(tzy, g), tx * VEC + c * 4 + v] = o_reg[g * VEC + c * 4 + v]
                            md_red[row_group(tzy), group_head(tzy, g), 0] = st[g * 4]
                            md_red[row_group(tzy), group_head(tzy, g), 1] = st[g * 4 + 1]
                        T.tvm_storage_sync("shared")
                        if row_group(tzy) == 0:
                            for g in T.unroll(GP):
                                st[2] = T.float32(NEG)
                                for z in T.unroll(BDZ):
                                    st[2] = T.max(st[2], md_red[z, group_head(tzy, g), 0])
                                st[1] = T.float32(0)
                                for v in T.unroll(VEC):
                                    kv[v] = T.float32(0)
                                for z in T.unroll(BDZ):
                                    st[3] = T.exp2(md_red[z, group_head(tzy, g), 0] - st[2])
                                    st[1] = st[1] + md_red[z, group_head(tzy, g), 1] * st[3]
                                    for v in T.unroll(VEC):
                                        kv[v] = kv[v] + o_red[z, group_head(tzy, g), tx * VEC + v] * st[3]
                                if splits == T.int64(1):
                                    for c in T.unroll(VEC // 4):
                                        for v in T.vectorized(4):
                                            out[b, h * G + group_head(tzy, g), tx * VEC + c * 4 + v] = T.Cast(dtype, kv[c * 4 + v] / st[1])
                                    if tx == 0:  # st[1] 0: every score -inf, out 0/0 and lse NaN
                                        lse[b, h * G + group_head(tzy, g)] = T.Select(st[1] == T.float32(0), T.float32(NAN), (st[2] + T.log2(st[1])) * T.float32(LN2))
                                elif tir.any(st[1] > T.float32(0), T.isnan(st[1])):  # NaN: kept (a NaN key)
                                    for c in T.unroll(VEC // 4):
                                        for v in T.vectorized(4):
                                            o_part[s, b, h * G + group_head(tzy, g), tx * VEC + c * 4 + v] = kv[c * 4 + v] / st[1]
                                    if tx == 0:
                                        lse_part[s, b, h * G + group_head(tzy, g)] = st[2] + T.log2(st[1])
                                else:  # an empty split (NEG), or one whose scores were all -inf
                                    for c in T.unroll(VEC // 4):
                                        for v in T.vectorized(4):
                                            o_part[s, b, h * G + group_head(tzy, g), tx * VEC + c * 4 + v] = T.float32(0)
                                    if tx == 0:
                                        lse_part[s, b, h * G + group_head(tzy, g)] = T.Select(hi > lo, T.float32(NEG_INFINITY), T.float32(NEG))
        if splits > T.int64(1):
            merge_splits(batch, splits, out, lse, o_part, lse_part)
    # fmt: on
    return replace_function(mod, decode, "decode")
