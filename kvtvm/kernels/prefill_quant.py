"""Prefill attention over a quantized cache (:mod:`kvtvm.quant`): the contract of
:mod:`kvtvm.kernels.prefill` (same signature, inputs and blocks), with K and/or V stored as
8-bit rows with an inline float32 scale (``spec.k_storage`` / ``v_storage``; ``""`` is a
full-precision side), dequantized while loading, accumulated in float32.

Knobs: those of the llvm prefill (schedule ``schedules/prefill/cpu_quant.py``).
"""

from __future__ import annotations

from ._tvm import ATTR_NOALIAS, T, alloc_buffer, block, prim_func
from .accessor import cache_index, find_sequence, match_tensor
from .prefill import LOG2E, NEG_INF, VARIANTS  # noqa: F401
from .quant_access import load_value, match_quant_cache_pair, row_scale


def knob_space(spec) -> dict:
    """The knob values ``kvtvm.tune`` searches for ``spec`` (llvm)."""
    return {"tile_q": [8, 16, 32], "tile_kv": [16, 32, 64], "row_block": [2, 4],
            "key_block": [2, 4]}


def match_params(spec, var_q, var_k_cache, var_v_cache, var_qo_indptr, var_cache_lengths,
                 var_lookup, var_out, var_lse):
    """:func:`kvtvm.kernels.prefill.match_params` with the caches bound by their storage."""
    H, D, dtype = spec.n_kv_heads, spec.head_dim, spec.dtype
    HQ = H * spec.group_size
    ntok, batch, max_pages = T.int64(), T.int64(), T.int64()
    q = match_tensor(var_q, (ntok, HQ, D), dtype)
    num_pages, page_size, k_cache, v_cache = match_quant_cache_pair(
        var_k_cache, var_v_cache, spec.layout, H, D, dtype, spec.k_storage, spec.v_storage)
    qo_indptr = match_tensor(var_qo_indptr, (batch + 1,), "int32")
    cache_lengths = match_tensor(var_cache_lengths, (batch,), "int32")
    lookup = match_tensor(var_lookup, (batch, max_pages), "int32")
    out = match_tensor(var_out, (ntok, HQ, D), dtype)
    lse = match_tensor(var_lse, (ntok, HQ), "float32")
    return (ntok, batch, num_pages, page_size, max_pages, q, k_cache, v_cache, qo_indptr,
            cache_lengths, lookup, out, lse)


def define(spec):
    """The unscheduled quantized prefill PrimFunc of ``spec`` (one row per (token, query
    head))."""
    H, G, D, dtype, layout = (spec.n_kv_heads, spec.group_size, spec.head_dim, spec.dtype,
                              spec.layout)
    ks, vs = spec.k_storage, spec.v_storage
    HQ = H * G
    SLIDE = 1 if "sliding_window" in spec.features else 0  # noqa: N806

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
        seq_of = alloc_buffer((ntok,), "int32")
        for n in range(ntok):
            with block("locate"):
                vn = T.axis.spatial(ntok, n)
                T.reads(qo_indptr[0:batch + 1])
                T.writes(seq_of[vn])
                bounds = alloc_buffer((2,), "int32", scope="local")
                find_sequence(qo_indptr, bounds, batch, vn)
                seq_of[vn] = bounds[0]
        for n, h in T.grid(ntok, HQ):
            with block("attn"):
                vn, vh = T.axis.remap("SS", [n, h])
                T.reads(seq_of[vn], qo_indptr[0:batch + 1], cache_lengths[0:batch],
                        lookup[0:batch, 0:max_pages], q[vn, vh, 0:D],
                        k_cache[0:num_pages, 0:k_cache.shape[1], 0:k_cache.shape[2], 0:D],
                        v_cache[0:num_pages, 0:v_cache.shape[1], 0:v_cache.shape[2], 0:D])
                T.writes(out[vn, vh, 0:D], lse[vn, vh])
                acc = alloc_buffer((D,), "float32", scope="local")
                qs = alloc_buffer((D,), "float32", scope="local")
                st = alloc_buffer((4,), "float32", scope="local")  # m, l, s, alpha
                b: T.int32 = seq_of[vn]
                pos: T.int64 = T.Cast("int64", cache_lengths[b]) + vn \
                    - T.Cast("int64", qo_indptr[b])
                kv_len: T.int64 = T.Cast("int64", cache_lengths[b] + qo_indptr[b + 1]
                                         - qo_indptr[b])
                hi: T.int64 = T.if_then_else(causal != 0, pos + 1, kv_len)
                lo: T.int64 = T.max(pos - T.Cast("int64", window) + 1, T.int64(0)) * SLIDE
                for d in range(D):
                    qs[d] = T.Cast("float32", q[vn, vh, d]) * sm_scale * T.float32(LOG2E)
                    acc[d] = T.float32(0)
                st[0] = T.float32(NEG_INF)
                st[1] = T.float32(0)
                for j in range(hi - lo):
                    page: T.int64 = T.Cast("int64", lookup[b, T.truncdiv(lo + j, page_size)])
                    slot: T.int64 = T.truncmod(lo + j, page_size)
                    st[2] = T.float32(0)
                    for d in range(D):
                        st[2] = st[2] + qs[d] * load_value(
                            k_cache, cache_index(layout, page, slot, vh // G, d), ks)
                    st[2] = st[2] * row_scale(k_cache, cache_index(layout, page, slot, vh // G,
                                                                   0), D, ks)
                    st[3] = T.exp2(st[0] - T.max(st[0], st[2]))
                    st[0] = T.max(st[0], st[2])
                    st[2] = T.exp2(st[2] - st[0])
                    st[1] = st[1] * st[3] + st[2]
                    for d in range(D):
                        acc[d] = acc[d] * st[3] + st[2] * row_scale(
                            v_cache, cache_index(layout, page, slot, vh // G, 0), D, vs) \
                            * load_value(v_cache, cache_index(layout, page, slot, vh // G, d), vs)
                for d in range(D):
                    out[vn, vh, d] = T.Cast(dtype, acc[d] / st[1])
                lse[vn, vh] = (st[0] + T.log2(st[1])) * T.float32(1.0 / LOG2E)
    # fmt: on
    return prefill
