"""CPU (llvm) schedule of decode attention -- a HAND-WRITTEN TIR kernel, not transformations of
the definition (tests/kernels/ check it against ``kvtvm.kernels.decode.define`` compiled
unscheduled): parallel over (sequence, KV head, split), a tile of
``tile_tokens`` KV rows at a time, explicit SIMD over head_dim.

The schedule rebuilds the definition's PrimFunc from the knobs (same parameters, same block
names ``attend`` and ``merge``, same split arithmetic from :mod:`kvtvm.kernels.decode`). Each
task loads a K row once for all ``group_size`` query heads (GQA), keeps per-head dot products in
``lanes``-wide vector accumulators, rescales the output once per tile (online softmax in log2
units) and streams V rows once; with ``head_block = n_kv_heads`` a task reads each token's K and
V rows of all heads as one contiguous run (nhd).
"""

from __future__ import annotations

from kvtvm.errors import InvalidArgumentError
from kvtvm.kernels._tvm import ATTR_NOALIAS, T, alloc_buffer, block, prim_func, tir
from kvtvm.kernels.accessor import cache_index
from kvtvm.kernels.decode import (LN2, LOG2E, NAN, NEG, NEG_INFINITY, length_ok, match_params,
                                  signature, split_range)
from kvtvm.kernels.errflag import ERR_PAGE, ERR_POSITION
from kvtvm.kernels.quant_access import load_value, row_scale
from kvtvm.quant import quant_row_bytes

from ..common import prefetch, replace_function


def exp2_poly(x):
    """2**x for x <= 0 in plain arithmetic (vectorizes; libm's exp2 does not): 2**round(x)
    from the exponent bits times a degree-6 series of 2**f, |f| <= 1/2 (rel. error ~1e-7);
    exactly 0 below -126."""
    n = T.round(x)
    y = (x - n) * T.float32(LN2)
    p = T.float32(1.0 / 720)
    for c in (1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0):
        p = p * y + T.float32(c)
    scale = T.reinterpret("float32", T.shift_left(T.Cast("int32", T.max(n, T.float32(-126))) + 127, 23))
    return T.if_then_else(x < T.float32(-126), T.float32(0), p * scale)


def default_knobs(spec) -> dict:
    # 64-byte vectors (one AVX-512 register of float32; LLVM splits them on narrower SIMD);
    # 32-token tiles keep the scores and a K/V tile in L1.
    # all KV heads of a token in one task: a token's K (V) row of every head is one contiguous
    # run of n_kv_heads * head_dim elements in the nhd layout, which the prefetchers follow.
    # software prefetch (below) of 8-bit and 16-bit rows into L2, not L1: a task's 32 query
    # heads' accumulators fill L1 already (docs/PERF.md, seventeenth session)
    return {"tile_tokens": 32, "vector_bytes": 64, "head_block": spec.n_kv_heads,
            "parallel": True, "prefetch": True, "prefetch_locality": 2}


def _lanes(spec, vector_bytes: int) -> int:
    lanes = max(1, vector_bytes // 4)  # computed in float32
    while spec.head_dim % lanes:
        lanes //= 2
    return lanes


def _check_knobs(spec, knobs) -> None:
    """ValueError naming a knob this schedule cannot build right: the tile reductions need a
    power-of-two tile (24 tokens summed the wrong scores), the lanes a power-of-two vector,
    and ``head_block`` must divide the KV heads."""
    def power_of_two(name):
        v = knobs.get(name)
        if type(v) is not int or v < 1 or v & (v - 1):
            raise InvalidArgumentError(f"decode knob {name}={v!r}: a power of two is needed")

    power_of_two("tile_tokens")
    power_of_two("vector_bytes")
    hb = knobs.get("head_block", 1)
    if type(hb) is not int or hb < 1 or spec.n_kv_heads % hb:
        raise InvalidArgumentError(f"decode knob head_block={hb!r} must divide n_kv_heads "
                                   f"{spec.n_kv_heads}")


def _prefetch_row(spec, storage: str, enabled: bool) -> tuple[int, int]:
    """(row elements, elements per 64-byte line) a side prefetches -- 8-bit rows (values,
    scale and padding) and float16/bfloat16 rows -- or ``(0, 1)``: none (float32 rows)."""
    if not enabled or (not storage and spec.dtype == "float32"):
        return 0, 1
    return (quant_row_bytes(spec.head_dim), 64) if storage else (spec.head_dim, 32)


def schedule(mod, spec, knobs):
    H, G, Hq, D, dtype, layout, sliding = signature(spec)
    _check_knobs(spec, knobs)
    TILE = int(knobs["tile_tokens"])
    L = _lanes(spec, int(knobs["vector_bytes"]))
    DV = D // L
    HB = int(knobs.get("head_block", 1))
    NHB = H // HB
    W = min(TILE, 16)  # lanes of the tile reductions (TILE is a power of two)
    # a serial variant serves small calls: waking TVM's thread pool costs more than it saves
    tasks = T.parallel if knobs.get("parallel", True) else T.serial

    def tile_tree(combine):
        """A macro folding row ``r`` of ``sc`` (``TILE`` scores) into ``red[0]`` with
        ``combine``: ``W`` lanes across the tile, then halving -- a vector tree instead of a
        serial chain of scalar operations."""

        @T.macro
        def fold(red, sc, r):
            for l in T.vectorized(W):
                red[l] = sc[r, l]
            for c in range(1, TILE // W):
                for l in T.vectorized(W):
                    red[l] = combine(red[l], sc[r, c * W + l])
            if W >= 16:
                for l in T.vectorized(8):
                    red[l] = combine(red[l], red[l + 8])
            if W >= 8:
                for l in T.vectorized(4):
                    red[l] = combine(red[l], red[l + 4])
            if W >= 4:
                for l in T.vectorized(2):
                    red[l] = combine(red[l], red[l + 2])
            if W >= 2:
                red[0] = combine(red[0], red[1])

        return fold

    # a quantized cache (either side 8-bit): the loads convert 8-bit values
    # (kvtvm.kernels.quant_access.load_value) and the row scales fold into scalars -- score =
    # scale_k * (q . k_q), acc += (p * scale_v) * v_q -- with the query heads of a KV head
    # unrolled so their partial sums stay in registers (measured ~10% less CPU time per int8
    # decode on the 2-core AMD box); full precision: plain converting loads, no scales
    Q = spec.quantized
    gloop = T.unroll if Q else T.serial

    # software prefetch of the rows a task reads next (the K rows of the next tile, the V rows
    # of this one; every 64 bytes of a row and its last element), per side, for 8-bit and
    # 16-bit rows. The kernel was bound by the latency of each row's first load, not by its
    # arithmetic: int8 23.7 -> 14.7 ms CPU at 16 x 4K with prefetcht0, float16 36 -> 26 ms
    # and int8 27 -> 22 ms more with prefetcht1 (docs/PERF.md). float32 rows are left to the
    # hardware prefetchers: prefetching them measured 23-46% slower.
    PF = bool(knobs.get("prefetch", True))
    LOC = knobs.get("prefetch_locality", 2)
    if LOC not in (0, 1, 2, 3) or isinstance(LOC, bool):
        raise InvalidArgumentError(f"decode knob prefetch_locality={LOC!r}: choose 0, 1, 2 or 3 "
                                   "(LLVM's prefetch locality; 3 is prefetcht0, 2 prefetcht1)")
    K_PF, V_PF = _prefetch_row(spec, spec.k_storage, PF), _prefetch_row(spec, spec.v_storage, PF)
    PF_K, PF_V = K_PF[0] > 0, V_PF[0] > 0  # (TVMScript's if takes a bool)

    def scale_buffer():
        return alloc_buffer((1,), "float32") if Q else T.meta_var(None)

    def scaled(value, rs):
        return value * rs[0] if Q else value

    def weight(part, sc, r, g, t):
        return part[g, 0] if Q else sc[r, t]

    @T.macro
    def prefetch_row(cache, page, slot, head, elems, per_line):
        """Prefetch one cache row: every line's first element and the row's last one."""
        for o in T.unroll(-(-elems // per_line) + 1):
            T.evaluate(prefetch(cache, cache_index(layout, page, slot, head,
                                                   T.min(o * per_line, elems - 1)), LOC))

    row_max = tile_tree(T.max)
    row_sum = tile_tree(lambda a, b: a + b)

    # fmt: off
    @prim_func
    def decode(var_q: T.handle, var_k_cache: T.handle, var_v_cache: T.handle,
               var_cache_lengths: T.handle, var_lookup: T.handle, var_out: T.handle,
               var_lse: T.handle, var_o_part: T.handle, var_lse_part: T.handle,
               sm_scale: T.float32, window: T.int32, var_err: T.handle):
        T.func_attr({ATTR_NOALIAS: True})
        (batch, num_pages, page_size, max_pages, splits, q, k_cache, v_cache, cache_lengths,
         lookup, out, lse, o_part, lse_part, err) = match_params(
            spec, var_q, var_k_cache, var_v_cache, var_cache_lengths, var_lookup, var_out,
            var_lse, var_o_part, var_lse_part, var_err)
        for task in tasks(batch * NHB * splits):
            with block("attend"):
                T.reads()
                T.writes()
                qf = alloc_buffer((HB * G, D), "float32")
                acc = alloc_buffer((HB * G, D), "float32")
                sc = alloc_buffer((HB * G, TILE), "float32")
                part = alloc_buffer((G, L), "float32")
                row = alloc_buffer((L,), "float32")
                m = alloc_buffer((HB * G,), "float32")
                den = alloc_buffer((HB * G,), "float32")
                mt = alloc_buffer((1,), "float32")
                red = alloc_buffer((W,), "float32")
                scl = alloc_buffer((1,), "float32")
                rs = scale_buffer()  # the row scale of a quantized cache (None: full precision)
                b: T.int64 = task // (NHB * splits)
                h0: T.int64 = T.floormod(task // splits, NHB) * HB
                s: T.int64 = T.floormod(task, splits)
                lo, hi = split_range(cache_lengths[b], window, s, splits, sliding,
                                     max_pages * page_size)
                if not length_ok(cache_lengths[b], max_pages * page_size):
                    err[ERR_POSITION] = 1
                for r in range(HB * G):  # r = hh * G + g: query head h0 * G + r
                    for dv in range(DV):
                        for l in T.vectorized(L):
                            qf[r, dv * L + l] = T.Cast("float32", q[b, h0 * G + r, dv * L + l]) \
                                * sm_scale * T.float32(LOG2E)
                            acc[r, dv * L + l] = T.float32(0)
                    m[r] = T.float32(NEG)
                    den[r] = T.float32(0)
                for it in range(T.floordiv(T.max(hi - lo, T.int64(0)) + TILE - 1, TILE)):
                    for t in range(TILE):
                        if PF_K:  # the K rows of the next tile's token t, into the caches
                            if lo + (it + 1) * TILE + t < hi:
                                pn: T.int64 = T.Cast("int64", lookup[b, T.floordiv(lo + (it + 1) * TILE + t, page_size)])
                                if pn >= 0 and pn < num_pages:
                                    for hh in range(HB):
                                        prefetch_row(k_cache, pn, T.floormod(lo + (it + 1) * TILE + t, page_size), h0 + hh, K_PF[0], K_PF[1])
                        if lo + it * TILE + t < hi:
                            page: T.int64 = T.Cast("int64", lookup[b, T.floordiv(lo + it * TILE + t, page_size)])
                            slot: T.int64 = T.floormod(lo + it * TILE + t, page_size)
                            if page >= 0 and page < num_pages:
                                if PF_V:  # this token's V rows, read after the tile's softmax
                                    for hh in range(HB):
                                        prefetch_row(v_cache, page, slot, h0 + hh, V_PF[0], V_PF[1])
                                for hh in range(HB):
                                    if Q:
                                        rs[0] = row_scale(k_cache, cache_index(layout, page, slot, h0 + hh, 0), D, spec.k_storage)
                                    for g in gloop(G):
                                        for l in T.vectorized(L):
                                            part[g, l] = T.float32(0)
                                    for dv in range(DV):
                                        for l in T.vectorized(L):
                                            row[l] = load_value(k_cache, cache_index(layout, page, slot, h0 + hh, dv * L + l), spec.k_storage)
                                        for g in gloop(G):
                                            for l in T.vectorized(L):
                                                part[g, l] = part[g, l] + qf[hh * G + g, dv * L + l] * row[l]
                                    for g in gloop(G):  # horizontal sums as a vector tree
                                        if L >= 16:
                                            for l in T.vectorized(8):
                                                part[g, l] = part[g, l] + part[g, l + 8]
                                        if L >= 8:
                                            for l in T.vectorized(4):
                                                part[g, l] = part[g, l] + part[g, l + 4]
                                        if L >= 4:
                                            for l in T.vectorized(2):
                                                part[g, l] = part[g, l] + part[g, l + 2]
                                        if L >= 2:
                                            part[g, 0] = part[g, 0] + part[g, 1]
                                        sc[hh * G + g, t] = scaled(part[g, 0], rs)
                            else:
                                err[ERR_PAGE] = 1
                                for r in range(HB * G):
                                    sc[r, t] = T.float32(NEG)
                        else:  # past the split: weight 0 even when no score beats NEG
                            for r in range(HB * G):
                                sc[r, t] = T.float32(NEG_INFINITY)
                    for r in range(HB * G):
                        row_max(red, sc, r)  # (and row_sum below): vector trees
                        mt[0] = T.max(m[r], red[0])
                        if mt[0] > m[r]:
                            scl[0] = T.exp2(m[r] - mt[0])
                            den[r] = den[r] * scl[0]
                            for dv in range(DV):
                                for l in T.vectorized(L):
                                    acc[r, dv * L + l] = acc[r, dv * L + l] * scl[0]
                            m[r] = mt[0]
                        for t in T.vectorized(TILE):
                            sc[r, t] = exp2_poly(sc[r, t] - mt[0])
                        row_sum(red, sc, r)
                        den[r] = den[r] + red[0]
                    for t in range(TILE):
                        if lo + it * TILE + t < hi:
                            page: T.int64 = T.Cast("int64", lookup[b, T.floordiv(lo + it * TILE + t, page_size)])
                            slot: T.int64 = T.floormod(lo + it * TILE + t, page_size)
                            if page >= 0 and page < num_pages:
                                for hh in range(HB):
                                    if Q:  # p * scale_v once per (token, query head)
                                        rs[0] = row_scale(v_cache, cache_index(layout, page, slot, h0 + hh, 0), D, spec.v_storage)
                                        for g in gloop(G):
                                            part[g, 0] = sc[hh * G + g, t] * rs[0]
                                    for dv in range(DV):
                                        for l in T.vectorized(L):
                                            row[l] = load_value(v_cache, cache_index(layout, page, slot, h0 + hh, dv * L + l), spec.v_storage)
                                        for g in gloop(G):
                                            for l in T.vectorized(L):
                                                acc[hh * G + g, dv * L + l] = acc[hh * G + g, dv * L + l] + weight(part, sc, hh * G + g, g, t) * row[l]
                for r in range(HB * G):
                    if splits == T.int64(1):  # den 0: every score -inf, out 0/0 and lse NaN
                        for dv in range(DV):
                            for l in T.vectorized(L):
                                out[b, h0 * G + r, dv * L + l] = T.Cast(dtype, acc[r, dv * L + l] / den[r])
                        lse[b, h0 * G + r] = T.Select(den[r] == T.float32(0), T.float32(NAN), (m[r] + T.log2(den[r])) * T.float32(LN2))
                    elif tir.any(den[r] > T.float32(0), T.isnan(den[r])):  # a NaN key or
                        # value seen by this split poisons the merged result (never dropped)
                        for dv in range(DV):
                            for l in T.vectorized(L):
                                o_part[s, b, h0 * G + r, dv * L + l] = acc[r, dv * L + l] / den[r]
                        lse_part[s, b, h0 * G + r] = m[r] + T.log2(den[r])
                    elif hi > lo:  # positions whose scores were all -inf: weight 0 beside a
                        # finite score elsewhere, NaN when no split has one (the merge)
                        for dv in range(DV):
                            for l in T.vectorized(L):
                                o_part[s, b, h0 * G + r, dv * L + l] = T.float32(0)
                        lse_part[s, b, h0 * G + r] = T.float32(NEG_INFINITY)
                    else:
                        for dv in range(DV):
                            for l in T.vectorized(L):
                                o_part[s, b, h0 * G + r, dv * L + l] = T.float32(0)
                        lse_part[s, b, h0 * G + r] = T.float32(NEG)
        if splits > T.int64(1):
            for task in tasks(batch * Hq):
                with block("merge"):
                    T.reads()
                    T.writes()
                    acc = alloc_buffer((D,), "float32")
                    m = alloc_buffer((1,), "float32")
                    den = alloc_buffer((1,), "float32")
                    w = alloc_buffer((1,), "float32")
                    b: T.int64 = task // Hq
                    hq: T.int64 = T.floormod(task, Hq)
                    m[0] = T.float32(NEG)
                    den[0] = T.float32(0)
                    w[0] = T.float32(0)  # the smallest lse of a split, first
                    for s in range(splits):
                        m[0] = T.max(m[0], lse_part[s, b, hq])
                        w[0] = T.min(w[0], lse_part[s, b, hq])
                    if m[0] == T.float32(NEG) and w[0] < T.float32(NEG):
                        den[0] = T.float32(NAN)  # every score -inf: 0/0, as with 1 split
                    for dv in range(DV):
                        for l in T.vectorized(L):
                            acc[dv * L + l] = T.float32(0)
                    for s in range(splits):
                        w[0] = T.exp2(lse_part[s, b, hq] - m[0])
                        den[0] = den[0] + w[0]
                        for dv in range(DV):
                            for l in T.vectorized(L):
                                acc[dv * L + l] = acc[dv * L + l] + w[0] * o_part[s, b, hq, dv * L + l]
                    for dv in range(DV):
                        for l in T.vectorized(L):
                            out[b, hq, dv * L + l] = T.Cast(dtype, acc[dv * L + l] / den[0])
                    lse[b, hq] = (m[0] + T.log2(den[0])) * T.float32(LN2)
    # fmt: on
    return replace_function(mod, decode, "decode")
