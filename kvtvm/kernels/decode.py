"""Decode attention: one query token per sequence over its paged KV, split over the KV length.

Compile-time: dtype, n_kv_heads, group_size (query heads per KV head, GQA), head_dim, token
layout (nhd/hnd), feature ``"sliding_window"``, and how K and V are stored (``spec.k_storage``
/ ``v_storage``: ``""`` full precision, or 8-bit rows with an inline float32 scale,
:mod:`kvtvm.quant`): one definition and one CPU schedule serve every storage type (CUDA
decode: its own ``schedules/decode/cuda_quant.py`` for a cache with an 8-bit side), the K/V
loads dequantizing to float32 (:mod:`kvtvm.kernels.quant_access`; a plain converting load for
a full-precision side), accumulation in float32.
Runtime: batch, pages, page_size, max pages per sequence, cache strides and offset, number of
KV splits (the first extent of the workspace), ``sm_scale``, window size.

Inputs (``Hq = n_kv_heads * group_size``; query head ``h * group_size + g`` reads KV head ``h``)::

    q                [batch, Hq, D]                        the cache's dtype
    k_cache, v_cache [num_pages, page_size, H, D] (nhd) or [num_pages, H, page_size, D] (hnd)
    cache_lengths    [batch] int32      tokens cached BEFORE this step; the current token was
                                        already appended, so sequence b attends over positions
                                        [start, cache_lengths[b] + 1)
    lookup_table     [batch, max_pages] int32
    out              [batch, Hq, D]     q's dtype
    lse              [batch, Hq] float32  natural-log log-sum-exp of the scaled scores
    o_part           [num_splits, batch, Hq, D] float32   workspace (unused when num_splits = 1)
    lse_part         [num_splits, batch, Hq] float32      workspace, log2 units
    sm_scale         float32
    window           int32   sliding window in tokens (only with the feature; <= 0: none);
                             start = max(0, cache_lengths[b] + 1 - window)
    err              [ERR_SLOTS] int32  error flag (:mod:`kvtvm.kernels.errflag`)

Every index is checked in the kernel: a sequence with ``cache_lengths[b] < 0`` or
``cache_lengths[b] + 1 > max_pages * page_size`` attends over nothing (its outputs are
unspecified) and sets ``err[ERR_POSITION]``; a KV position on a page outside
``[0, num_pages)`` is left out of the softmax and sets ``err[ERR_PAGE]``.

Split ``s`` of sequence ``b`` covers positions ``[start + s*chunk, min(start + (s+1)*chunk,
L))`` with ``L = cache_lengths[b] + 1`` and ``chunk = ceil((L - start) / num_splits)``; an
empty split stores ``lse_part = NEG`` and zeros. With one split the ``attend`` stage writes
``out``/``lse`` itself and ``merge`` does nothing.

Blocks: ``attend`` (per sequence, KV head, split: online softmax in log2 units over the split)
and ``merge`` (per sequence, query head: log-sum-exp merge of the splits).

Knobs: llvm ``tile_tokens``, ``vector_bytes``, ``head_block``, ``parallel``, ``prefetch``,
``prefetch_locality``; cuda ``threads``,
``tile_tokens``, ``stages``, ``merge_threads``, ``vec``, 8-bit ``head_split`` (schedules
``schedules/decode/{cpu,cuda}.py``, both hand-written TIR kernels checked against
:func:`define`). Variants: ``"serial"`` on llvm.
"""

from __future__ import annotations

import math

from ..cuda_limits import decode_vectors, tensor_core_decode
from ._tvm import ATTR_NOALIAS, T, alloc_buffer, block, prim_func, tir
from .accessor import _ITEMSIZE, match_cache_pair, match_err, match_tensor
from .errflag import ERR_PAGE, ERR_POSITION
from .quant_access import dequant
from .reference import reference_decode  # noqa: F401  (the numpy reference, beside its kernel)
from .variants import VARIANTS as _ALL_VARIANTS

#: Named runtime variants: target -> name -> knob overrides (``"serial"`` on llvm).
VARIANTS = _ALL_VARIANTS["decode"]

#: log2(e): scores are kept in log2 units so the kernels use exp2.
LOG2E = math.log2(math.e)
#: ln(2): converts a log2-unit log-sum-exp back to natural log.
LN2 = math.log(2.0)
#: Finite "minus infinity" (fast-math safe): lse of an empty split, score of a masked token.
NEG = -3.0e38
#: lse of a split whose positions all scored -inf (weight 0 beside a finite score elsewhere).
NEG_INFINITY = float("-inf")
#: out and lse of attention whose every score is -inf: the reference's 0/0.
NAN = float("nan")


def length_ok(cache_length, capacity):
    """Whether a sequence with ``cache_length`` cached tokens (plus the current one) fits the
    ``capacity`` positions of its lookup-table row."""
    return tir.all(T.Cast("int64", cache_length) >= T.int64(0),
                   T.Cast("int64", cache_length) < capacity)


def kv_range(cache_length, window, sliding: bool, capacity=None):
    """(start, end) int64 positions attended by a sequence with ``cache_length`` cached tokens
    (the current token included); empty when the length does not fit ``capacity``."""
    end = T.Cast("int64", cache_length) + T.int64(1)
    if capacity is not None:
        end = T.if_then_else(length_ok(cache_length, capacity), end, T.int64(0))
    if not sliding:
        return T.int64(0), end
    w = T.Cast("int64", window)
    return T.if_then_else(w > T.int64(0), T.max(end - w, T.int64(0)), T.int64(0)), end


def split_range(cache_length, window, split, num_splits, sliding: bool, capacity=None):
    """(lo, hi) int64 positions of KV split ``split`` of ``num_splits`` (hi <= lo: empty;
    empty for every split when the length does not fit ``capacity``)."""
    start, end = kv_range(cache_length, window, sliding, capacity)
    chunk = T.floordiv(end - start + num_splits - T.int64(1), num_splits)
    lo = start + T.Cast("int64", split) * chunk
    return lo, T.min(lo + chunk, end)


def signature(spec):
    """Shapes shared by the definition and every schedule: (H, G, Hq, D, dtype, layout,
    sliding)."""
    H, G, D = spec.n_kv_heads, spec.group_size, spec.head_dim
    return H, G, H * G, D, spec.dtype, spec.layout, "sliding_window" in spec.features


def match_params(spec, var_q, var_k_cache, var_v_cache, var_cache_lengths, var_lookup, var_out,
                 var_lse, var_o_part, var_lse_part, var_err):
    """Bind the buffers of the decode signature (call inside a TVMScript function; the
    definition and every schedule that writes its own PrimFunc share it).

    Returns ``(batch, num_pages, page_size, max_pages, splits, q, k_cache, v_cache,
    cache_lengths, lookup, out, lse, o_part, lse_part, err)``.
    """
    H, _, Hq, D, dtype, layout, _ = signature(spec)
    batch, max_pages, splits = T.int64(), T.int64(), T.int64()
    q = match_tensor(var_q, (batch, Hq, D), dtype)
    num_pages, page_size, k_cache, v_cache = match_cache_pair(
        var_k_cache, var_v_cache, layout, H, D, dtype, spec.k_storage, spec.v_storage)
    cache_lengths = match_tensor(var_cache_lengths, (batch,), "int32")
    lookup = match_tensor(var_lookup, (batch, max_pages), "int32")
    out = match_tensor(var_out, (batch, Hq, D), dtype)
    lse = match_tensor(var_lse, (batch, Hq), "float32")
    o_part = match_tensor(var_o_part, (splits, batch, Hq, D), "float32")
    lse_part = match_tensor(var_lse_part, (splits, batch, Hq), "float32")
    err = match_err(var_err)
    return (batch, num_pages, page_size, max_pages, splits, q, k_cache, v_cache, cache_lengths,
            lookup, out, lse, o_part, lse_part, err)


def vec_choices(spec) -> list[int]:
    """CUDA knob ``vec``: elements of head_dim per thread, whole 16-byte vectors, leaving a
    power of two of lanes (at most 32) per row (:func:`kvtvm.cuda_limits.decode_vectors`)."""
    return decode_vectors(spec.dtype, spec.head_dim)


def knob_space(spec) -> dict:
    """The knob values ``kvtvm.tune`` searches for ``spec`` (its target's schedule knobs)."""
    if spec.target == "llvm":
        return {"tile_tokens": [8, 16, 32, 64], "vector_bytes": [16, 32, 64],
                "head_block": [h for h in (1, 2, 4, 8, 16, 32) if spec.n_kv_heads % h == 0],
                "prefetch_locality": [2, 3]}
    if spec.quantized:  # schedules/decode/cuda_quant.py
        from .quant_access import head_split_choices, quant_vec_choices

        cores = {"threads": [64, 128, 256], "tile_tokens": [16, 32, 64], "stages": [2, 3],
                 "merge_threads": [256], "vec": quant_vec_choices(spec),
                 "head_split": head_split_choices(spec)}
        if not tensor_core_decode(spec.dtype, spec.head_dim, spec.group_size, spec.k_storage,
                                  spec.v_storage):
            return cores
        # a union: the tensor-core kernel (its warps, tile rows and stages; it reads no
        # ``vec``, so varying it would build the same kernel again) or the CUDA cores'
        return [{"mma": [1], "threads": [64, 128], "tile_tokens": [32, 64],
                 "stages": [2, 3]}, dict(cores, mma=[0])]
    return {"threads": [64, 128, 256], "tile_tokens": [8, 16, 32, 64], "stages": [1, 2, 3],
            "merge_threads": [128, 256, 512], "vec": vec_choices(spec)}


def define(spec):
    """The unscheduled decode PrimFunc of ``spec`` (serial; the schedules rebuild it tiled)."""
    H, G, Hq, D, dtype, layout, sliding = signature(spec)

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
        for b, h, s in T.grid(batch, H, splits):
            with block("attend"):
                T.reads()
                T.writes()
                acc = alloc_buffer((D,), "float32")
                m = alloc_buffer((1,), "float32")
                den = alloc_buffer((1,), "float32")
                score = alloc_buffer((1,), "float32")
                m_new = alloc_buffer((1,), "float32")
                lo, hi = split_range(cache_lengths[b], window, s, splits, sliding,
                                     max_pages * page_size)
                if not length_ok(cache_lengths[b], max_pages * page_size):
                    err[ERR_POSITION] = 1
                for g in range(G):
                    m[0] = T.float32(NEG)
                    den[0] = T.float32(0)
                    for d in range(D):
                        acc[d] = T.float32(0)
                    for t in range(T.max(hi - lo, T.int64(0))):
                        page: T.int64 = T.Cast("int64", lookup[b, T.floordiv(lo + t, page_size)])
                        slot: T.int64 = T.floormod(lo + t, page_size)
                        if page >= 0 and page < num_pages:
                            score[0] = T.float32(0)
                            for d in range(D):
                                score[0] = score[0] + T.Cast("float32", q[b, h * G + g, d]) * dequant(
                                    k_cache, layout, page, slot, h, d, D, spec.k_storage)
                            score[0] = score[0] * sm_scale * T.float32(LOG2E)
                            m_new[0] = T.max(m[0], score[0])
                            den[0] = den[0] * T.exp2(m[0] - m_new[0]) + T.exp2(score[0] - m_new[0])
                            for d in range(D):
                                acc[d] = acc[d] * T.exp2(m[0] - m_new[0]) + T.exp2(
                                    score[0] - m_new[0]) * dequant(
                                        v_cache, layout, page, slot, h, d, D, spec.v_storage)
                            m[0] = m_new[0]
                        else:
                            err[ERR_PAGE] = 1
                    if splits == T.int64(1):
                        for d in range(D):
                            out[b, h * G + g, d] = T.Cast(dtype, acc[d] / den[0])
                        lse[b, h * G + g] = (m[0] + T.log2(den[0])) * T.float32(LN2)
                    elif tir.any(den[0] > T.float32(0), T.isnan(den[0])):  # NaN: kept
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
