"""CPU (llvm) schedule of prefill attention: a flash-attention style tiled kernel -- a
HAND-WRITTEN TIR kernel, not transformations of the definition (tests/kernels/ check it
against ``kvtvm.kernels.prefill.define`` compiled unscheduled).

Built directly from the knobs (same signature and block names as the definition in
``kvtvm/kernels/prefill.py``; ``tile_q = 0`` schedules the definition itself instead, one
(token, head) row per iteration, parallel over tokens).

Work item = (tile of ``tile_q`` consecutive query rows, KV head); items run in parallel, tiles
ordered small/large/small/... (tile ``i`` next to tile ``n-1-i``) so the contiguous chunks TVM
hands each thread carry about the same causal work. A tile that spans several sequences is
processed one sequence segment at a time. Per segment: Q^T (all ``group_size`` heads of the KV
head: ``R = tile_q * group_size`` rows, pre-scaled by ``sm_scale * log2 e``) in float32; for
each KV tile of ``tile_kv`` positions: gather K and V through the page table into float32 tiles
(vector copies), S^T = K Q^T with ``key_block`` keys x up to 64 query rows of accumulators held
in vector registers, then the masked online softmax (base 2) vectorized over the query rows --
row max and row sum are element-wise vector operations down the keys, no horizontal reduction
-- and O += P V with ``row_block`` rows x 64 columns of O in registers.
"""

from __future__ import annotations

import math

from kvtvm.kernels._tvm import ATTR_NOALIAS, T, alloc_buffer, block, get_block, prim_func, tir
from kvtvm.kernels.accessor import find_sequence
from kvtvm.kernels.errflag import ERR_INDPTR, ERR_PAGE, ERR_POSITION
from kvtvm.kernels.decode import NAN
from kvtvm.kernels.prefill import LOG2E, NEG_INF, match_params, sequence_ok
from kvtvm.kernels.quant_access import dequant

from ..common import new_schedule, replace_function, under_locate


#: score of a masked (query, key) pair: below every real score and the initial running max
MASKED = -3.0e38
#: largest finite float32 (a V value above it in magnitude, or NaN, is not finite)
FLT_MAX = 3.4028234663852886e38

# 2**f on [-0.5, 0.5]: 1 + f * P(f) (Cephes exp2f coefficients, ~2e-7 relative error)
_EXP2_P = (1.535336188319500e-4, 1.339887440266574e-3, 9.618437357674640e-3,
           5.550332471162809e-2, 2.402264791363012e-1, 6.931472028550421e-1)


def fast_exp2(x):
    """Vectorizable 2**x for x <= 0 (LLVM scalarizes ``llvm.exp2`` on vectors): round to
    the nearest integer n, polynomial for the fraction, exponent bits for 2**n; exactly 0
    below -126.5, where n = -127 makes the exponent bits 0 (a clamp at -125 gave such a key
    the weight 2**-125, which a V of 1e34 or more made visible). A NaN ``x`` (``inf - inf``:
    a score of +inf, from an infinite key or an overflowing q.k) gives NaN, as ``exp2``
    does."""
    xc = T.max(x, T.float32(-127.0))
    n = T.round(xc)
    f = xc - n
    p = T.float32(_EXP2_P[0])
    for c in _EXP2_P[1:]:
        p = p * f + T.float32(c)
    p = p * f + T.float32(1.0)
    return T.Select(T.isnan(x), x,
                    p * T.reinterpret("float32", T.shift_left(T.Cast("int32", n) + 127, 23)))


def default_knobs(spec) -> dict:
    return {"tile_q": 16 if spec.group_size <= 4 else 8, "tile_kv": 32, "row_block": 4,
            "key_block": 4}


def schedule(mod, spec, knobs):
    if knobs["tile_q"] == 0:
        sch = new_schedule(mod, spec)
        attn = get_block(sch, "attn")
        token = under_locate(sch, attn)
        sch.parallel(token)
        return sch.mod
    func = tiled_prefill(spec, knobs["tile_q"], knobs["tile_kv"], knobs["row_block"],
                         knobs.get("key_block", 4))
    return replace_function(mod, func, "prefill")


def tiled_prefill(spec, TQ: int, N: int, RB: int, JB: int):
    """The tiled CPU prefill PrimFunc (see the module docstring)."""
    H, G, D, dtype, layout = (spec.n_kv_heads, spec.group_size, spec.head_dim, spec.dtype,
                              spec.layout)
    R = TQ * G
    RB = math.gcd(RB, R)
    JB = math.gcd(JB, N)
    RC = math.gcd(R, 64)  # query rows per vector chunk of the score tile
    SLIDE = 1 if "sliding_window" in spec.features else 0
    DCH = math.gcd(D, 64)  # O columns per register block

    def visible(r, pos, p0, kv_hi, causal, window):
        cond = tir.all(pos < kv_hi,
                            tir.any(causal == 0, pos <= p0 + T.Cast("int64", r // G)))
        if SLIDE:
            cond = tir.all(cond, pos > p0 + T.Cast("int64", r // G)
                                - T.Cast("int64", window))
        return cond

    # fmt: off
    @prim_func
    def prefill(var_q: T.handle, var_k_cache: T.handle, var_v_cache: T.handle,
                var_qo_indptr: T.handle, var_cache_lengths: T.handle, var_lookup: T.handle,
                var_out: T.handle, var_lse: T.handle, causal: T.int32, sm_scale: T.float32,
                window: T.int32, var_err: T.handle):
        T.func_attr({ATTR_NOALIAS: True})
        (ntok, batch, num_pages, page_size, max_pages, q, k_cache, v_cache, qo_indptr,
         cache_lengths, lookup, out, lse, err) = match_params(
            spec, var_q, var_k_cache, var_v_cache, var_qo_indptr, var_cache_lengths,
            var_lookup, var_out, var_lse, var_err)
        for w in T.parallel((ntok + TQ - 1) // TQ * H):
            with block("attn"):
                vw = T.axis.spatial((ntok + TQ - 1) // TQ * H, w)
                T.reads()
                T.writes()
                Qt = alloc_buffer((D, R), "float32", scope="local")
                Ks = alloc_buffer((N, D), "float32", scope="local")
                Vs = alloc_buffer((N, D), "float32", scope="local")
                St = alloc_buffer((N, R), "float32", scope="local")
                O = alloc_buffer((R, D), "float32", scope="local")
                M = alloc_buffer((R,), "float32", scope="local")
                Mn = alloc_buffer((R,), "float32", scope="local")
                L = alloc_buffer((R,), "float32", scope="local")
                Ls = alloc_buffer((R,), "float32", scope="local")
                Vf = alloc_buffer((D,), "float32", scope="local")  # sum |V| of the tile, by d
                Vb = alloc_buffer((1,), "float32", scope="local")
                ib = alloc_buffer((2,), "int32", scope="local")
                ir = alloc_buffer((1,), "int64", scope="local")
                ntiles: T.int64 = (ntok + TQ - 1) // TQ
                u: T.int64 = vw // H
                h: T.int64 = vw % H
                t: T.int64 = T.if_then_else(u % 2 == 0, u // 2, ntiles - 1 - u // 2)
                row1: T.int64 = T.min(t * TQ + TQ, ntok)
                # locate: largest b with qo_indptr[b] <= first row of the tile
                find_sequence(qo_indptr, ib, batch, t * TQ)
                ir[0] = t * TQ
                while ir[0] < row1 and T.Cast("int64", ib[0]) < batch:
                    b: T.int32 = ib[0]
                    r0: T.int64 = ir[0]
                    r1: T.int64 = T.min(T.Cast("int64", qo_indptr[b + 1]), row1)
                    if r1 > r0 and T.Cast("int64", qo_indptr[b]) > r0:
                        err[ERR_INDPTR] = 1
                    elif r1 > r0 and not sequence_ok(qo_indptr, cache_lengths, b,
                                                     max_pages * page_size):
                        err[ERR_POSITION] = 1
                    elif r1 > r0:
                        mg: T.int64 = (r1 - r0) * G
                        nrc: T.int64 = (mg + RC - 1) // RC
                        p0: T.int64 = T.Cast("int64", cache_lengths[b]) + r0 \
                            - T.Cast("int64", qo_indptr[b])
                        kv_hi: T.int64 = T.if_then_else(
                            causal != 0, p0 + (r1 - r0),
                            T.Cast("int64", cache_lengths[b]) + T.Cast("int64", qo_indptr[b + 1])
                            - T.Cast("int64", qo_indptr[b]))
                        kv_lo: T.int64 = T.max(p0 - T.Cast("int64", window) + 1,
                                               T.int64(0)) * SLIDE
                        # Q^T of the segment's rows (r = token * G + head in group), pre-scaled
                        for i, g in T.grid(TQ, G):
                            if r0 + i < r1:
                                for d in range(D):
                                    Qt[d, i * G + g] = T.Cast(
                                        "float32", q[r0 + i, h * G + g, d]) \
                                        * (sm_scale * T.float32(LOG2E))
                            else:
                                for d in range(D):
                                    Qt[d, i * G + g] = T.float32(0)
                        for r in T.vectorized(R):
                            M[r] = T.float32(NEG_INF)
                            L[r] = T.float32(0)
                        for r in range(R):
                            for d in T.vectorized(D):
                                O[r, d] = T.float32(0)
                        for kt in range((kv_hi - kv_lo + N - 1) // N):
                            j0: T.int64 = kv_lo + kt * N
                            for d in T.vectorized(D):
                                Vf[d] = T.float32(0)
                            for jj in range(N):
                                if j0 + jj < kv_hi:
                                    page: T.int64 = T.Cast(
                                        "int64", lookup[b, T.truncdiv(j0 + jj, page_size)])
                                    slot: T.int64 = T.truncmod(j0 + jj, page_size)
                                    if page >= 0 and page < num_pages:
                                        for d in T.vectorized(D):
                                            Ks[jj, d] = dequant(k_cache, layout, page, slot, h,
                                                                d, D, spec.k_storage)
                                        for d in T.vectorized(D):
                                            Vs[jj, d] = dequant(v_cache, layout, page, slot, h,
                                                                d, D, spec.v_storage)
                                        for d in T.vectorized(D):  # inf/NaN if any is
                                            Vf[d] = Vf[d] + T.abs(Vs[jj, d])
                                    else:  # skipped: a zero key and value
                                        err[ERR_PAGE] = 1
                                        for d in T.vectorized(D):
                                            Ks[jj, d] = T.float32(0)
                                        for d in T.vectorized(D):
                                            Vs[jj, d] = T.float32(0)
                                else:
                                    for d in T.vectorized(D):
                                        Ks[jj, d] = T.float32(0)
                                    for d in T.vectorized(D):
                                        Vs[jj, d] = T.float32(0)
                            # S^T = K Q^T: JB keys x RC rows of accumulators, vectors over rows
                            for rc in range(nrc):
                                for jb in range(N // JB):
                                    for jj in T.unroll(JB):
                                        for r in T.vectorized(RC):
                                            St[jb * JB + jj, rc * RC + r] = T.float32(0)
                                    for d in range(D):
                                        for jj in T.unroll(JB):
                                            for r in T.vectorized(RC):
                                                St[jb * JB + jj, rc * RC + r] = \
                                                    St[jb * JB + jj, rc * RC + r] \
                                                    + Ks[jb * JB + jj, d] * Qt[d, rc * RC + r]
                                # masked online softmax, base 2, vectorized over the rows
                                for jj in range(N):
                                    for r in T.vectorized(RC):
                                        St[jj, rc * RC + r] = T.Select(
                                            visible(rc * RC + r, j0 + jj, p0, kv_hi, causal,
                                                    window),
                                            St[jj, rc * RC + r], T.float32(MASKED))
                                for r in T.vectorized(RC):
                                    Mn[rc * RC + r] = M[rc * RC + r]
                                    Ls[rc * RC + r] = T.float32(0)
                                for jj in range(N):
                                    for r in T.vectorized(RC):
                                        Mn[rc * RC + r] = T.max(Mn[rc * RC + r],
                                                                St[jj, rc * RC + r])
                                for jj in range(N):
                                    for r in T.vectorized(RC):
                                        St[jj, rc * RC + r] = T.Select(
                                            St[jj, rc * RC + r] > T.float32(MASKED / 2),
                                            fast_exp2(St[jj, rc * RC + r] - Mn[rc * RC + r]),
                                            T.Select(T.isnan(St[jj, rc * RC + r]),
                                                     St[jj, rc * RC + r], T.float32(0)))
                                        Ls[rc * RC + r] = Ls[rc * RC + r] + St[jj, rc * RC + r]
                                for r in T.vectorized(RC):
                                    # M becomes the rescale factor of the old O and L
                                    M[rc * RC + r] = fast_exp2(M[rc * RC + r] - Mn[rc * RC + r])
                                    L[rc * RC + r] = L[rc * RC + r] * M[rc * RC + r] \
                                        + Ls[rc * RC + r]
                                for r in range(RC):
                                    for d in T.vectorized(D):
                                        O[rc * RC + r, d] = O[rc * RC + r, d] * M[rc * RC + r]
                                for r in T.vectorized(RC):
                                    M[rc * RC + r] = Mn[rc * RC + r]
                            # O += P V, RB rows x DCH columns of O in registers
                            Vb[0] = T.float32(0)
                            for d in range(D):
                                Vb[0] = Vb[0] + Vf[d]
                            if T.abs(Vb[0]) <= T.float32(FLT_MAX):  # every V finite (a sum
                                # overflowing takes the exact path below: slower, same result)
                                for rb in range((mg + RB - 1) // RB):
                                    for dc in range(D // DCH):
                                        for jj in range(N):
                                            for rr in T.unroll(RB):
                                                for d in T.vectorized(DCH):
                                                    O[rb * RB + rr, dc * DCH + d] = \
                                                        O[rb * RB + rr, dc * DCH + d] \
                                                        + St[jj, rb * RB + rr] \
                                                        * Vs[jj, dc * DCH + d]
                            else:  # a NaN/inf value in the tile: masked pairs add nothing
                                # (their weight 0 times NaN would poison rows that cannot see
                                # the value); visible ones poison as in the definition
                                for rb in range((mg + RB - 1) // RB):
                                    for jj in range(N):
                                        for rr in range(RB):
                                            for d in range(D):
                                                O[rb * RB + rr, d] = O[rb * RB + rr, d] \
                                                    + T.Select(visible(
                                                        rb * RB + rr, j0 + jj, p0, kv_hi,
                                                        causal, window),
                                                        St[jj, rb * RB + rr] * Vs[jj, d],
                                                        T.float32(0))
                        for i, g in T.grid(TQ, G):
                            if r0 + i < r1:
                                for d in T.vectorized(D):
                                    out[r0 + i, h * G + g, d] = T.Cast(
                                        dtype, O[i * G + g, d] / L[i * G + g])
                                lse[r0 + i, h * G + g] = T.Select(  # L 0: every score -inf
                                    L[i * G + g] == T.float32(0), T.float32(NAN),
                                    (M[i * G + g] + T.log2(L[i * G + g])) * T.float32(1.0 / LOG2E))
                    ir[0] = T.max(r1, r0)
                    ib[0] = ib[0] + 1
                if ir[0] < row1:  # rows past qo_indptr[batch]: no sequence holds them
                    err[ERR_INDPTR] = 1
    # fmt: on
    return prefill
