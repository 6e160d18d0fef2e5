"""CUDA schedule of decode attention (sm_90a and sm_80 alike): split-KV with a merge kernel --
a HAND-WRITTEN TIR kernel, not transformations of the definition (tests/kernels/ compile it and
check it against ``kvtvm.kernels.decode.define`` where a GPU is present).

The schedule builds the thread-bound TIR from the knobs (as TVM's own decode kernels do) with
the definition's parameters and block names (``attend``, ``merge``) and the split arithmetic of
:mod:`kvtvm.kernels.decode`; tests check it against the same numpy reference.

``attend``: one CTA per (sequence, KV head, split). Threads are ``(tx, ty, tz)``: ``tx`` covers
head_dim with ``vec`` elements each, as 16-byte pieces ``tx, tx + bdx, ...`` (interleaved, so
the lanes reading a row from shared memory read consecutive bytes whatever ``vec`` is; a larger
``vec`` means fewer shuffle steps per score), ``ty`` is the query head of the GQA group
(a K/V row staged once serves the whole group), ``tz`` splits the rows of a tile. K and V tiles
of ``tile_tokens`` rows are copied global -> shared with 16-byte ``cp.async`` (every thread of
the CTA copies), ``stages`` deep (2 = double buffering: the copy of tile i+1 is in flight while
tile i is computed). Scores are reduced across ``tx`` with warp shuffles (xor butterfly inside a
``bdx``-lane segment), the online softmax is kept in log2 units in registers, and the ``tz``
partial states are merged through shared memory at the end. With one split the CTA writes
``out``/``lse``; otherwise float32 partials go to the workspace.

``merge``: launched only when ``num_splits > 1``; one CTA per (sequence, query head), threads
``(tx, tz)``: ``tx`` owns 4 float32 of the head's output, ``tz`` (``merge_threads / (head_dim /
4)`` groups) strides over the splits with an online log-sum-exp merge, and the groups' states
meet in shared memory (a single sequence's 64 splits no longer run as one serial loop on 8 CTAs).
"""

from __future__ import annotations

from kvtvm.errors import InvalidArgumentError
from kvtvm.kernels._tvm import (ATTR_IS_SCHEDULED, ATTR_NOALIAS, T, alloc_buffer, block,
                               prim_func, tir)
from kvtvm.kernels.accessor import cache_index
from kvtvm.kernels.decode import (LN2, LOG2E, NAN, NEG, NEG_INFINITY, length_ok, match_params,
                                  signature, split_range, vec_choices)
from kvtvm.kernels.errflag import ERR_PAGE, ERR_POSITION

from ..common import DTYPE_BYTES, pages_bad_macro, replace_function
#: Static shared memory kept for the K/V stages (of the 48 KiB a kernel may declare statically).
SMEM_KV_BYTES = 40 * 1024
#: What a kernel may declare statically, and the most threads a CTA may have.
SMEM_STATIC_BYTES = 48 * 1024
MAX_CTA_THREADS = 1024


def attend_smem_bytes(bdz: int, G: int, D: int, stage_bytes: int,
                      v_stage_bytes: int | None = None) -> int:
    """Static shared bytes of an attend kernel: K and V stages (``stage_bytes`` each, or
    ``stage_bytes`` of K and ``v_stage_bytes`` of V when the two sides are stored differently),
    the per-(row group, query head) running max/sum, and the output reduction, which reuses a
    K/V stage buffer when it fits in one (as ptxas reports: d160 GQA 2 fp16 41088 bytes, d112
    GQA 3 50560, 8-bit d256 GQA 4 67840)."""
    v_stage_bytes = stage_bytes if v_stage_bytes is None else v_stage_bytes
    red = bdz * G * D * 4
    return (stage_bytes + v_stage_bytes + bdz * G * 2 * 4
            + (0 if red <= max(stage_bytes, v_stage_bytes) else red))


def fit_row_groups(spec, lanes: int, bdz: int, tile: int, smem) -> tuple[int, int]:
    """``(bdz, tile)`` within a CTA's limits: ``lanes`` threads per row group (a multiple of
    32 times ``bdz``, the shuffles use full warps), ``smem(bdz, tile)`` static shared bytes at
    most :data:`SMEM_STATIC_BYTES`, at most :data:`MAX_CTA_THREADS` threads. Row groups are
    dropped (whole-warp steps) until it fits -- only shapes that would not build otherwise
    change (the shared bytes counted are those ptxas reports for the attend kernel) (e.g. head_dim 48 with GQA 16 over an 8-bit cache: the per-group reduction buffers
    outgrew 48 KiB), then K/V tile rows; raises :class:`~kvtvm.errors.InvalidArgumentError` naming head_dim and
    the group size when no whole-warp layout fits (an odd factor of ``lanes`` over 32, e.g.
    head_dim 80 with GQA 7)."""
    from math import gcd

    from kvtvm.errors import describe

    step = 32 // gcd(lanes, 32)               # fewest row groups making whole warps
    while bdz > step and (smem(bdz, tile) > SMEM_STATIC_BYTES
                          or lanes * bdz > MAX_CTA_THREADS):
        bdz -= step
        tile = max(tile, bdz) - max(tile, bdz) % bdz
    while tile > bdz and smem(bdz, tile) > SMEM_STATIC_BYTES:  # then shorter K/V tiles
        tile = max(bdz, tile // 2 - tile // 2 % bdz)
    if lanes * bdz > MAX_CTA_THREADS or smem(bdz, tile) > SMEM_STATIC_BYTES:
        raise InvalidArgumentError(describe(
            "head_dim / group_size",
            f"a CUDA decode layout in whole warps within {MAX_CTA_THREADS} threads and "
            f"{SMEM_STATIC_BYTES // 1024} KiB of shared memory (another head_dim or GQA "
            "group size; the CPU kernels take any)",
            f"head_dim {spec.head_dim}, group_size {spec.group_size}, {spec.dtype}"
            f"{' 8-bit' if spec.quantized else ''}: {lanes} threads per row group need "
            f"{step} groups ({lanes * step} threads, {smem(step, max(tile, step))} bytes)"))
    return bdz, tile

_CP_ASYNC = r"""
__device__ __forceinline__ void kvtvm_cp_async16(void* smem, const void* gmem) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(s), "l"(gmem) : "memory");
}
"""
_COMMIT = r"""
__device__ __forceinline__ void kvtvm_cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
"""


def _wait_source(n: int) -> str:
    return (f"\n__device__ __forceinline__ void kvtvm_cp_async_wait_{n}() {{\n"
            f"  asm volatile(\"cp.async.wait_group {n};\\n\" ::: \"memory\");\n}}\n")


def _copy16(smem, stage, row, col, cache, layout, lookup, b, pos, h, page_size):
    """``cp.async`` of the 16-byte chunk ``col`` of token ``pos``'s row into ``smem[stage, row]``
    (its page was checked by the block's page pre-pass)."""
    # positions and page sizes fit in int32: 32-bit division (64-bit is emulated on the GPU)
    pos32, ps32 = T.Cast("int32", pos), T.Cast("int32", page_size)
    page = T.Cast("int64", lookup[b, T.truncdiv(pos32, ps32)])
    slot = T.Cast("int64", T.truncmod(pos32, ps32))
    src = cache[cache_index(layout, page, slot, h, col)]
    return T.cuda.func_call("kvtvm_cp_async16", T.address_of(smem[stage, row, col]),
                            T.address_of(src), source_code=_CP_ASYNC)


def default_knobs(spec) -> dict:
    # 128 threads and 32-row tiles, double buffered: ~32 KiB of K/V in flight per CTA (fp16,
    # D=128), several CTAs per SM.
    # ``vec``: head_dim elements per thread, two 16-byte vectors where a head allows it (on an
    # H100, fp16 d128 GQA 4: 2.6-2.7 TB/s against 2.3-2.5 with one vector, which needs one more
    # shuffle step per score; tools/gpu_decode_probe.py), unless that shrinks the CTA (the
    # row groups are capped at 8) or whole warps would need more than 8 row groups (tiny heads
    # with odd groups, e.g. d16 GQA 3: spills)
    # A choice without a layout inside the CTA's limits (fit_row_groups) is skipped; when none
    # has one, the first is returned and scheduling it raises the typed error.
    knobs = {"threads": 128, "tile_tokens": 32, "stages": 2, "merge_threads": 256}
    choices = vec_choices(spec)
    one = dict(knobs, vec=choices[0])
    if len(choices) == 1:
        return one
    two = dict(knobs, vec=choices[1])
    g1, g2 = _geometry_or_none(spec, one), _geometry_or_none(spec, two)
    if g1 is None or g2 is None:
        for k in (one, two, *(dict(knobs, vec=v) for v in choices[2:])):
            if _geometry_or_none(spec, k) is not None:
                return k
        return one
    return two if g2["bdz"] <= 8 and g2["threads"] >= g1["threads"] else one


def _geometry_or_none(spec, knobs) -> dict | None:
    from kvtvm.errors import InvalidArgumentError

    try:
        return geometry(spec, knobs)
    except InvalidArgumentError:
        return None


def geometry(spec, knobs) -> dict:
    """Thread and tile shape of the attend kernel for ``spec`` and ``knobs``."""
    H, G, Hq, D, dtype, layout, sliding = signature(spec)
    esize = DTYPE_BYTES[dtype]
    vec = int(knobs.get("vec") or vec_choices(spec)[0])  # elements per thread along head_dim
    if vec not in vec_choices(spec):
        raise InvalidArgumentError(f"decode knob vec={vec} for head_dim {D} {dtype}: choose from "
                                   f"{vec_choices(spec)}")
    bdx = D // vec                           # <= 32: one warp segment reduces a score
    # row groups; more than 8 leaves 1-2 rows per group per tile (no ILP) and made ptxas
    # spill on sm_80 (head_dim 64, group 1)
    bdz = min(8, max(1, int(knobs["threads"]) // (bdx * G)))
    while (bdx * G * bdz) % 32:              # whole warps: the shuffles use a full lane mask
        bdz += 1
    stages = max(1, int(knobs["stages"]))
    tile = int(knobs["tile_tokens"])
    while tile > bdz and 2 * stages * tile * D * esize > SMEM_KV_BYTES:
        tile //= 2
    tile = max(tile, bdz)
    tile -= tile % bdz                       # rows per tz are equal
    bdz, tile = fit_row_groups(spec, bdx * G, bdz, tile,
                               lambda z, t: attend_smem_bytes(z, G, D, stages * t * D * esize))
    chunk = 16 // esize                      # elements per 16-byte copy
    return dict(esize=esize, vec=vec, bdx=bdx, bdy=G, bdz=bdz, threads=bdx * G * bdz,
                stages=stages, tile=tile, rows_per_z=tile // bdz, chunk=chunk,
                chunks_per_row=D // chunk, sub=vec // chunk if vec >= chunk else 1)



def check_layout(spec, knobs) -> None:
    """The typed error :func:`geometry` raises for a layout that does not fit (for
    ``kvtvm.compiler.check_layout``: refused before a build)."""
    geometry(spec, knobs)


def merge_macro(spec, knobs):
    """The split-KV merge of the CUDA decode kernels (float16/bfloat16/float32 and 8-bit caches
    alike): a macro writing ``out``/``lse`` from the splits' ``o_part``/``lse_part``. One CTA
    per (sequence, query head); ``MZ`` thread groups stride over the splits (online LSE merge in
    registers), then meet in shared memory; ``MX`` threads along head_dim, 4 values each."""
    H, G, Hq, D, dtype, layout, sliding = signature(spec)
    MX = D // 4
    MZ = max(1, min(1024 // MX, int(knobs["merge_threads"]) // MX))

    # fmt: off
    @T.macro
    def merge_splits(batch, splits, out, lse, o_part, lse_part):
        # one CTA per (sequence, query head); tz strides over the splits (online LSE merge
        # in registers), then the MZ partial states meet in shared memory
        for bx in T.thread_binding(T.Cast("int32", batch * Hq), thread="blockIdx.x"):
            for tz in T.thread_binding(MZ, thread="threadIdx.z"):
                for tx in T.thread_binding(MX, thread="threadIdx.x"):
                    with block("merge"):
                        T.reads()
                        T.writes()
                        acc = alloc_buffer((4,), "float32", scope="local")
                        part = alloc_buffer((4,), "float32", scope="local")
                        mm = alloc_buffer((4,), "float32", scope="local")  # max, sum, lse, scale
                        acc_red = alloc_buffer((MZ, D), "float32", scope="shared")
                        mm_red = alloc_buffer((MZ, 3), "float32", scope="shared")
                        low = alloc_buffer((1,), "float32", scope="local")  # the smallest lse
                        b: T.int32 = T.truncdiv(bx, Hq)
                        hq: T.int32 = T.truncmod(bx, Hq)
                        ns: T.int32 = T.Cast("int32", splits)
                        mm[0] = T.float32(NEG)
                        mm[1] = T.float32(0)
                        low[0] = T.float32(0)
                        for v in T.vectorized(4):
                            acc[v] = T.float32(0)
                        for i in T.serial(T.truncdiv(ns - tz + MZ - 1, MZ)):
                            mm[2] = lse_part[tz + i * MZ, b, hq]
                            low[0] = T.min(low[0], mm[2])
                            for v in T.vectorized(4):
                                part[v] = o_part[tz + i * MZ, b, hq, tx * 4 + v]
                            mm[3] = T.max(mm[0], mm[2])
                            mm[1] = mm[1] * T.exp2(mm[0] - mm[3]) + T.exp2(mm[2] - mm[3])
                            for v in T.unroll(4):
                                acc[v] = acc[v] * T.exp2(mm[0] - mm[3]) + T.exp2(mm[2] - mm[3]) * part[v]
                            mm[0] = mm[3]
                        for v in T.vectorized(4):
                            acc_red[tz, tx * 4 + v] = acc[v]
                        if tx == 0:
                            mm_red[tz, 0] = mm[0]
                            mm_red[tz, 1] = mm[1]
                            mm_red[tz, 2] = low[0]
                        T.tvm_storage_sync("shared")
                        if tz == 0:
                            mm[3] = T.float32(NEG)
                            for z in T.unroll(MZ):
                                mm[3] = T.max(mm[3], mm_red[z, 0])
                                low[0] = T.min(low[0], mm_red[z, 2])
                            mm[1] = T.float32(0)
                            for v in T.vectorized(4):
                                acc[v] = T.float32(0)
                            for z in T.unroll(MZ):
                                mm[2] = T.exp2(mm_red[z, 0] - mm[3])
                                mm[1] = mm[1] + mm_red[z, 1] * mm[2]
                                for v in T.unroll(4):
                                    acc[v] = acc[v] + acc_red[z, tx * 4 + v] * mm[2]
                            if mm[3] == T.float32(NEG) and low[0] < T.float32(NEG):
                                mm[1] = T.float32(NAN)  # every score -inf: 0/0, as with 1 split
                            for v in T.unroll(4):
                                out[b, hq, tx * 4 + v] = T.Cast(dtype, acc[v] / mm[1])
                            if tx == 0:
                                lse[b, hq] = (mm[3] + T.log2(mm[1])) * T.float32(LN2)
    # fmt: on
    return merge_splits

def schedule(mod, spec, knobs):
    H, G, Hq, D, dtype, layout, sliding = signature(spec)
    g = geometry(spec, knobs)
    VEC, BDX, BDY, BDZ, NT = g["vec"], g["bdx"], g["bdy"], g["bdz"], g["threads"]
    S, TILE, RPZ, CH, CPR = g["stages"], g["tile"], g["rows_per_z"], g["chunk"], g["chunks_per_row"]
    SUB = VEC // CH                          # 16-byte pieces per thread vector
    COPIES = -(-TILE * CPR // NT)            # 16-byte chunks per thread per tile (K and V each)
    merge_splits = merge_macro(spec, knobs)
    WAIT = _wait_source(S - 1)
    pages_bad = pages_bad_macro(NT)

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
            for tz in T.thread_binding(BDZ, thread="threadIdx.z"):
                for ty in T.thread_binding(BDY, thread="threadIdx.y"):
                    for tx in T.thread_binding(BDX, thread="threadIdx.x"):
                        with block("attend"):
                            T.reads()
                            T.writes()
                            k_smem = alloc_buffer((S, TILE, D), dtype, scope="shared")
                            v_smem = alloc_buffer((S, TILE, D), dtype, scope="shared")
                            o_red = alloc_buffer((BDZ, BDY, D), "float32", scope="shared")
                            md_red = alloc_buffer((BDZ, BDY, 2), "float32", scope="shared")
                            q_reg = alloc_buffer((VEC,), "float32", scope="local")
                            o_reg = alloc_buffer((VEC,), "float32", scope="local")
                            kv_reg = alloc_buffer((VEC,), dtype, scope="local")
                            s_reg = alloc_buffer((RPZ,), "float32", scope="local")
                            st = alloc_buffer((4,), "float32", scope="local")  # m, d, m_new, dot
                            bad = alloc_buffer((1,), "int32", scope="local")
                            ns: T.int32 = T.Cast("int32", splits)
                            b: T.int32 = T.truncdiv(bx, H * ns)
                            h: T.int32 = T.truncmod(T.truncdiv(bx, ns), H)
                            s: T.int32 = T.truncmod(bx, ns)
                            tid: T.int32 = (tz * BDY + ty) * BDX + tx
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
                            for c in T.unroll(SUB):
                                for v in T.unroll(CH):
                                    q_reg[c * CH + v] = T.Cast("float32", q[b, h * G + ty, (c * BDX + tx) * CH + v]) * sm_scale * T.float32(LOG2E)
                            for v in T.unroll(VEC):
                                o_reg[v] = T.float32(0)
                            st[0] = T.float32(NEG)
                            st[1] = T.float32(0)
                            # prologue: tiles 0 .. S-2 in flight
                            for pre in T.unroll(S - 1):
                                if pre < ntiles:
                                    for c in T.unroll(COPIES):
                                        if c * NT + tid < TILE * CPR:
                                            if lo + pre * TILE + (c * NT + tid) // CPR < hi:
                                                T.evaluate(_copy16(k_smem, pre, (c * NT + tid) // CPR, T.floormod(c * NT + tid, CPR) * CH, k_cache, layout, lookup, b, lo + pre * TILE + (c * NT + tid) // CPR, h, page_size))
                                                T.evaluate(_copy16(v_smem, pre, (c * NT + tid) // CPR, T.floormod(c * NT + tid, CPR) * CH, v_cache, layout, lookup, b, lo + pre * TILE + (c * NT + tid) // CPR, h, page_size))
                                T.evaluate(T.cuda.func_call("kvtvm_cp_async_commit", source_code=_COMMIT))
                            for it in T.serial(ntiles):
                                # issue tile it + S - 1 into the stage freed at the end of it - 1
                                if it + (S - 1) < ntiles:
                                    for c in T.unroll(COPIES):
                                        if c * NT + tid < TILE * CPR:
                                            if lo + (it + S - 1) * TILE + (c * NT + tid) // CPR < hi:
                                                T.evaluate(_copy16(k_smem, T.floormod(it + S - 1, S), (c * NT + tid) // CPR, T.floormod(c * NT + tid, CPR) * CH, k_cache, layout, lookup, b, lo + (it + S - 1) * TILE + (c * NT + tid) // CPR, h, page_size))
                                                T.evaluate(_copy16(v_smem, T.floormod(it + S - 1, S), (c * NT + tid) // CPR, T.floormod(c * NT + tid, CPR) * CH, v_cache, layout, lookup, b, lo + (it + S - 1) * TILE + (c * NT + tid) // CPR, h, page_size))
                                T.evaluate(T.cuda.func_call("kvtvm_cp_async_commit", source_code=_COMMIT))
                                T.evaluate(T.cuda.func_call(f"kvtvm_cp_async_wait_{S - 1}", source_code=WAIT))
                                T.tvm_storage_sync("shared")
                                # scores of this thread's rows: dot over tx's slice, butterfly over tx
                                st[2] = st[0]
                                for j in T.unroll(RPZ):
                                    for c in T.unroll(SUB):
                                        for v in T.vectorized(CH):
                                            kv_reg[c * CH + v] = k_smem[T.floormod(it, S), tz * RPZ + j, (c * BDX + tx) * CH + v]
                                    st[3] = T.float32(0)
                                    for v in T.unroll(VEC):
                                        st[3] = st[3] + q_reg[v] * T.Cast("float32", kv_reg[v])
                                    for x in T.unroll(BDX.bit_length() - 1):
                                        st[3] = st[3] + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), st[3], BDX >> (x + 1), BDX, 32)
                                    s_reg[j] = T.if_then_else(lo + it * TILE + tz * RPZ + j < hi, st[3], T.float32(NEG))
                                    st[2] = T.max(st[2], s_reg[j])
                                # online softmax (log2 units): rescale once per tile
                                st[1] = st[1] * T.exp2(st[0] - st[2])
                                for v in T.unroll(VEC):
                                    o_reg[v] = o_reg[v] * T.exp2(st[0] - st[2])
                                st[0] = st[2]
                                for j in T.unroll(RPZ):
                                    s_reg[j] = T.if_then_else(lo + it * TILE + tz * RPZ + j < hi, T.exp2(s_reg[j] - st[0]), T.float32(0))
                                    st[1] = st[1] + s_reg[j]
                                    # rows past the split were not copied: stale shared memory
                                    # may hold NaN bit patterns, and 0 * NaN is NaN
                                    if lo + it * TILE + tz * RPZ + j < hi:
                                        for c in T.unroll(SUB):
                                            for v in T.vectorized(CH):
                                                kv_reg[c * CH + v] = v_smem[T.floormod(it, S), tz * RPZ + j, (c * BDX + tx) * CH + v]
                                        for v in T.unroll(VEC):
                                            o_reg[v] = o_reg[v] + s_reg[j] * T.Cast("float32", kv_reg[v])
                                T.tvm_storage_sync("shared")
                            # merge the BDZ row groups through shared memory
                            for c in T.unroll(VEC // 4):
                                for v in T.vectorized(4):
                                    o_red[tz, ty, tx * VEC + c * 4 + v] = o_reg[c * 4 + v]
                            md_red[tz, ty, 0] = st[0]
                            md_red[tz, ty, 1] = st[1]
                            T.tvm_storage_sync("shared")
                            if tz == 0:
                                st[2] = T.float32(NEG)
                                for z in T.unroll(BDZ):
                                    st[2] = T.max(st[2], md_red[z, ty, 0])
                                st[1] = T.float32(0)
                                for v in T.unroll(VEC):
                                    o_reg[v] = T.float32(0)
                                for z in T.unroll(BDZ):
                                    st[3] = T.exp2(md_red[z, ty, 0] - st[2])
                                    st[1] = st[1] + md_red[z, ty, 1] * st[3]
                                    for v in T.unroll(VEC):
                                        o_reg[v] = o_reg[v] + o_red[z, ty, tx * VEC + v] * st[3]
                                if splits == T.int64(1):
                                    for c in T.unroll(SUB):
                                        for u in T.unroll(CH // 4):
                                            for v in T.vectorized(4):
                                                out[b, h * G + ty, (c * BDX + tx) * CH + u * 4 + v] = T.Cast(dtype, o_reg[c * CH + u * 4 + v] / st[1])
                                    if tx == 0:  # st[1] 0: every score -inf, out 0/0 and lse NaN
                                        lse[b, h * G + ty] = T.Select(st[1] == T.float32(0), T.float32(NAN), (st[2] + T.log2(st[1])) * T.float32(LN2))
                                elif tir.any(st[1] > T.float32(0), T.isnan(st[1])):  # NaN: kept (a NaN key)
                                    for c in T.unroll(SUB):
                                        for u in T.unroll(CH // 4):
                                            for v in T.vectorized(4):
                                                o_part[s, b, h * G + ty, (c * BDX + tx) * CH + u * 4 + v] = o_reg[c * CH + u * 4 + v] / st[1]
                                    if tx == 0:
                                        lse_part[s, b, h * G + ty] = st[2] + T.log2(st[1])
                                else:  # an empty split (NEG), or one whose scores were all -inf
                                    for c in T.unroll(SUB):
                                        for u in T.unroll(CH // 4):
                                            for v in T.vectorized(4):
                                                o_part[s, b, h * G + ty, (c * BDX + tx) * CH + u * 4 + v] = T.float32(0)
                                    if tx == 0:
                                        lse_part[s, b, h * G + ty] = T.Select(hi > lo, T.float32(NEG_INFINITY), T.float32(NEG))
        if splits > T.int64(1):
            merge_splits(batch, splits, out, lse, o_part, lse_part)
    # fmt: on
    return replace_function(mod, decode, "decode")
