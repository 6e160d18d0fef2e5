"""Decode attention over a quantized cache (:mod:`kvtvm.quant`): the contract of
:mod:`kvtvm.kernels.decode` (same signature, inputs, splits and blocks), with K and/or V
stored as 8-bit rows with an inline float32 scale (``spec.k_storage`` / ``v_storage``; ``""``
is a full-precision side) and dequantized while loading: a score is
``scale_k * sum(q * k_q)``, a V row enters the output as ``p * scale_v * v_q``; everything
accumulates in float32. No dequantized copy of the cache is ever made.

Knobs and variants: those of :mod:`kvtvm.kernels.decode` (schedule
``schedules/decode/cpu_quant.py``).
"""

from __future__ import annotations

from ._tvm import ATTR_NOALIAS, T, alloc_buffer, block, prim_func
from .accessor import cache_index, match_tensor
from .decode import LN2, LOG2E, NEG, VARIANTS, signature, split_range  # noqa: F401
from .quant_access import load_value, match_quant_cache_pair, row_scale


def knob_space(spec) -> dict:
    """The knob values ``kvtvm.tune`` searches for ``spec`` (llvm)."""
    return {"tile_tokens": [8, 16, 32, 64], "vector_bytes": [16, 32, 64],
            "head_block": [h for h in (1, 2, 4, 8, 16, 32) if spec.n_kv_heads % h == 0]}


def match_params(spec, var_q, var_k_cache, var_v_cache, var_cache_lengths, var_lookup, var_out,
                 var_lse, var_o_part, var_lse_part):
    """:func:`kvtvm.kernels.decode.match_params` with the caches bound by their storage."""
    H, _, Hq, D, dtype, layout, _ = signature(spec)
    batch, max_pages, splits = T.int64(), T.int64(), T.int64()
    q = match_tensor(var_q, (batch, Hq, D), dtype)
    num_pages, page_size, k_cache, v_cache = match_quant_cache_pair(
        var_k_cache, var_v_cache, layout, H, D, dtype, spec.k_storage, spec.v_storage)
    cache_lengths = match_tensor(var_cache_lengths, (batch,), "int32")
    lookup = match_tensor(var_lookup, (batch, max_pages), "int32")
    out = match_tensor(var_out, (batch, Hq, D), dtype)
    lse = match_tensor(var_lse, (batch, Hq), "float32")
    o_part = match_tensor(var_o_part, (splits, batch, Hq, D), "float32")
    lse_part = match_tensor(var_lse_part, (splits, batch, Hq), "float32")
    return (batch, num_pages, page_size, max_pages, splits, q, k_cache, v_cache, cache_lengths,
            lookup, out, lse, o_part, lse_part)


def define(spec):
    """The unscheduled quantized decode PrimFunc of ``spec`` (serial)."""
    H, G, Hq, D, dtype, layout, sliding = signature(spec)
    ks, vs = spec.k_storage, spec.v_storage

    # fmt: off
    @prim_func
    def decode(var_q: T.handle, var_k_cache: T.handle, var_v_cache: T.handle,
               var_cache_lengths: T.handle, var_lookup: T.handle, var_out: T.handle,
               var_lse: T.handle, var_o_part: T.handle, var_lse_part: T.handle,
               sm_scale: T.float32, window: T.int32):
        T.func_attr({ATTR_NOALIAS: True})
        (batch, num_pages, page_size, max_pages, splits, q, k_cache, v_cache, cache_lengths,
         lookup, out, lse, o_part, lse_part) = match_params(
            spec, var_q, var_k_cache, var_v_cache, var_cache_lengths, var_lookup, var_out,
            var_lse, var_o_part, var_lse_part)
        for b, h, s in T.grid(batch, H, splits):
            with block("attend"):
                T.reads()
                T.writes()
                acc = alloc_buffer((D,), "float32")
                m = alloc_buffer((1,), "float32")
                den = alloc_buffer((1,), "float32")
                score = alloc_buffer((1,), "float32")
                m_new = alloc_buffer((1,), "float32")
                lo, hi = split_range(cache_lengths[b], window, s, splits, sliding)
                for g in range(G):
                    m[0] = T.float32(NEG)
                    den[0] = T.float32(0)
                    for d in range(D):
                        acc[d] = T.float32(0)
                    for t in range(T.max(hi - lo, T.int64(0))):
                        page: T.int64 = T.Cast("int64", lookup[b, T.floordiv(lo + t, page_size)])
                        slot: T.int64 = T.floormod(lo + t, page_size)
                        score[0] = T.float32(0)
                        for d in range(D):
                            score[0] = score[0] + T.Cast("float32", q[b, h * G + g, d]) \
                                * load_value(k_cache, cache_index(layout, page, slot, h, d), ks)
                        score[0] = score[0] * row_scale(k_cache, cache_index(
                            layout, page, slot, h, 0), D, ks) * sm_scale * T.float32(LOG2E)
                        m_new[0] = T.max(m[0], score[0])
                        den[0] = den[0] * T.exp2(m[0] - m_new[0]) + T.exp2(score[0] - m_new[0])
                        for d in range(D):
                            acc[d] = acc[d] * T.exp2(m[0] - m_new[0]) + T.exp2(
                                score[0] - m_new[0]) * row_scale(v_cache, cache_index(
                                    layout, page, slot, h, 0), D, vs) * load_value(
                                    v_cache, cache_index(layout, page, slot, h, d), vs)
                        m[0] = m_new[0]
                    if splits == T.int64(1):
                        for d in range(D):
                            out[b, h * G + g, d] = T.Cast(dtype, acc[d] / den[0])
                        lse[b, h * G + g] = (m[0] + T.log2(den[0])) * T.float32(LN2)
                    elif den[0] > T.float32(0):
                        for d in range(D):
                            o_part[s, b, h * G + g, d] = acc[d] / den[0]
                        lse_part[s, b, h * G + g] = m[0] + T.log2(den[0])
                    else:
                        for d in range(D):
                            o_part[s, b, h * G + g, d] = T.float32(0)
                        lse_part[s, b, h * G + g] = T.float32(NEG)
        for b, hq in T.grid(batch, Hq):
            with block("merge"):
                T.reads()
                T.writes()
                acc = alloc_buffer((D,), "float32")
                m = alloc_buffer((1,), "float32")
                den = alloc_buffer((1,), "float32")
                if splits > T.int64(1):
                    m[0] = T.float32(NEG)
                    den[0] = T.float32(0)
                    for s in range(splits):
                        m[0] = T.max(m[0], lse_part[s, b, hq])
                    for d in range(D):
                        acc[d] = T.float32(0)
                    for s in range(splits):
                        den[0] = den[0] + T.exp2(lse_part[s, b, hq] - m[0])
                        for d in range(D):
                            acc[d] = acc[d] + T.exp2(lse_part[s, b, hq] - m[0]) * o_part[s, b, hq, d]
                    for d in range(D):
                        out[b, hq, d] = T.Cast(dtype, acc[d] / den[0])
                    lse[b, hq] = (m[0] + T.log2(den[0])) * T.float32(LN2)
    # fmt: on
    return decode
