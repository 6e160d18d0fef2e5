"""CPU (llvm) schedule of prefill attention over a QUANTIZED cache
(``kvtvm.kernels.prefill_quant``): the tiled kernel of ``schedules/prefill/cpu.py`` whose K/V
tile gather dequantizes (8-bit value -> float32 times the row's scale, vectorized) straight
into the float32 tiles; everything after the gather is unchanged. tests/quant check it
against the numpy reference over the reference-dequantized cache.
"""

from __future__ import annotations

import math

from kvtvm.kernels._tvm import ATTR_NOALIAS, T, alloc_buffer, block, get_block, prim_func, tir
from kvtvm.kernels.accessor import cache_index, find_sequence
from kvtvm.kernels.prefill import LOG2E, NEG_INF
from kvtvm.kernels.prefill_quant import match_params
from kvtvm.kernels.quant_access import load_value, row_scale

from ..common import new_schedule, replace_function, under_locate
from .cpu import MASKED, default_knobs, fast_exp2  # noqa: F401  (same knobs as the full kernel)


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
    ks, vs = spec.k_storage, spec.v_storage
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
                window: T.int32):
        T.func_attr({ATTR_NOALIAS: True})
        (ntok, batch, num_pages, page_size, max_pages, q, k_cache, v_cache, qo_indptr,
         cache_lengths, lookup, out, lse) = match_params(
            spec, var_q, var_k_cache, var_v_cache, var_qo_indptr, var_cache_lengths,
            var_lookup, var_out, var_lse)
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
                ib = alloc_buffer((2,), "int32", scope="local")
                ir = alloc_buffer((1,), "int64", scope="local")
                sk = alloc_buffer((2,), "float32", scope="local")
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
                    if r1 > r0:
                        mg: T.int64 = (r1 - r0) * G
                        nrc: T.int64 = (mg + RC - 1) // RC
                        p0: T.int64 = T.Cast("int64", cache_lengths[b]) + r0 \
                            - T.Cast("int64", qo_indptr[b])
                        kv_hi: T.int64 = T.if_then_else(
                            causal != 0, p0 + (r1 - r0),
                            T.Cast("int64", cache_lengths[b] + qo_indptr[b + 1] - qo_indptr[b]))
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
                            for jj in range(N):
                                if j0 + jj < kv_hi:
                                    page: T.int64 = T.Cast(
                                        "int64", lookup[b, T.truncdiv(j0 + jj, page_size)])
                                    slot: T.int64 = T.truncmod(j0 + jj, page_size)
                                    sk[0] = row_scale(k_cache, cache_index(
                                        layout, page, slot, h, 0), D, ks)
                                    sk[1] = row_scale(v_cache, cache_index(
                                        layout, page, slot, h, 0), D, vs)
                                    for d in T.vectorized(D):
                                        Ks[jj, d] = load_value(k_cache, cache_index(
                                            layout, page, slot, h, d), ks) * sk[0]
                                    for d in T.vectorized(D):
                                        Vs[jj, d] = load_value(v_cache, cache_index(
                                            layout, page, slot, h, d), vs) * sk[1]
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
                                            T.float32(0))
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
                            for rb in range((mg + RB - 1) // RB):
                                for dc in range(D // DCH):
                                    for jj in range(N):
                                        for rr in T.unroll(RB):
                                            for d in T.vectorized(DCH):
                                                O[rb * RB + rr, dc * DCH + d] = \
                                                    O[rb * RB + rr, dc * DCH + d] \
                                                    + St[jj, rb * RB + rr] * Vs[jj, dc * DCH + d]
                        for i, g in T.grid(TQ, G):
                            if r0 + i < r1:
                                for d in T.vectorized(D):
                                    out[r0 + i, h * G + g, d] = T.Cast(
                                        dtype, O[i * G + g, d] / L[i * G + g])
                                lse[r0 + i, h * G + g] = (M[i * G + g] + T.log2(L[i * G + g])) \
                                    * T.float32(1.0 / LOG2E)
                    ir[0] = T.max(r1, r0)
                    ib[0] = ib[0] + 1
    # fmt: on
    return prefill
