"""Plain numpy references of every kernel family, in float64 where it matters.

Tests compare the kernels with these, never with another optimized kernel. They need numpy
alone -- no TVM -- so they also run where only the TVM runtime is installed (a deployment, the
GPU machine of a runtime-only check); each family module re-exports its own.

Every reference also takes quantized cache views (int8 / float8_e4m3fn rows of
``quant_row_bytes(head_dim)``, :mod:`kvtvm.quant`): append quantizes each new row with the
reference quantizer, attention runs over the reference-dequantized K/V.
"""

from __future__ import annotations

import math

import numpy as np

from ..quant import dequantize_rows, quantize_rows

__all__ = ["reference_append", "reference_copy_pages", "reference_decode", "reference_prefill",
           "reference_errors", "append_row_target"]

#: Error-flag slots (the same as :mod:`kvtvm.kernels.errflag`, which needs no TVM either).
_ERR_PAGE, _ERR_POSITION, _ERR_INDPTR = 0, 1, 2


def _find_sequence(qo_indptr, row: int) -> int:
    """The kernels' binary search (``kvtvm.kernels.accessor.find_sequence``): the largest
    ``b`` with ``qo_indptr[b] <= row`` when ``qo_indptr`` does not decrease."""
    lo, hi = 0, len(qo_indptr) - 1
    for _ in range(17):
        if hi - lo > 1:
            mid = (lo + hi) // 2
            if int(qo_indptr[mid]) <= row:
                lo = mid
            else:
                hi = mid
    return lo


def append_row_target(row, qo_indptr, cache_lengths, lookup_table, num_pages, page_size):
    """Where the append kernel writes ragged row ``row``: ``(batch index, page, slot, None)``,
    or ``(b, None, None, err_slot)`` when it skips the row (the kernels' skip semantics)."""
    b = _find_sequence(qo_indptr, row)
    if not int(qo_indptr[b]) <= row < int(qo_indptr[b + 1]):
        return b, None, None, _ERR_INDPTR
    pos = int(cache_lengths[b]) + row - int(qo_indptr[b])
    if not 0 <= pos < lookup_table.shape[1] * page_size:
        return b, None, None, _ERR_POSITION
    page = int(lookup_table[b, pos // page_size])
    if not 0 <= page < num_pages:
        return b, None, None, _ERR_PAGE
    return b, page, pos % page_size, None


def reference_errors(qo_indptr, cache_lengths, lookup_table, num_pages, page_size,
                     num_tokens) -> np.ndarray:
    """int32 ``[4]``: the error flag the append kernel leaves for these tables (see
    :mod:`kvtvm.kernels.errflag`)."""
    flags = np.zeros(4, np.int32)
    table = np.asarray(lookup_table)
    for row in range(num_tokens):
        err = append_row_target(row, qo_indptr, cache_lengths, table, num_pages, page_size)[3]
        if err is not None:
            flags[err] = 1
    return flags


def _is_quantized(cache, head_dim: int) -> bool:
    """A quantized view: 1-byte elements, rows longer than ``head_dim`` (values + scale)."""
    return cache.dtype.itemsize == 1 and cache.shape[-1] != head_dim


def _stored(rows, cache):
    """``rows [n, H, D]`` as the cache stores them (quantized rows for a quantized cache)."""
    rows = np.asarray(rows)
    if not _is_quantized(cache, rows.shape[-1]):
        return rows
    return quantize_rows(rows, "int8" if cache.dtype == np.int8 else "float8_e4m3fn")


def _loaded(cache, head_dim: int):
    """The cache as float64 ``[..., head_dim]`` (dequantized if quantized)."""
    cache = np.asarray(cache)
    if _is_quantized(cache, head_dim):
        return dequantize_rows(cache, head_dim).astype(np.float64)
    return cache.astype(np.float64)


def reference_append(k_cache, v_cache, k, v, qo_indptr, cache_lengths, lookup_table,
                     layout: str = "nhd"):
    """Plain numpy append: returns new (k_cache, v_cache) arrays, inputs untouched. A row the
    kernel skips (out-of-range position, page or row offset) is not written."""
    k_out, v_out = np.array(k_cache, copy=True), np.array(v_cache, copy=True)
    k, v = _stored(k, k_out), _stored(v, v_out)
    page_size = k_out.shape[1] if layout == "nhd" else k_out.shape[2]
    table = np.asarray(lookup_table)
    for row in range(len(k)):
        _, page, slot, err = append_row_target(row, qo_indptr, cache_lengths, table,
                                               k_out.shape[0], page_size)
        if err is not None:
            continue
        if layout == "nhd":
            k_out[page, slot], v_out[page, slot] = k[row], v[row]
        else:
            k_out[page, :, slot], v_out[page, :, slot] = k[row], v[row]
    return k_out, v_out


def reference_copy_pages(buf: np.ndarray, src, dst, axis: int = 0) -> np.ndarray:
    """Numpy reference: a copy of ``buf`` after ``buf[..., dst[i], ...] = buf[..., src[i], ...]``
    along ``axis``, for ``i`` in order; a copy with an index outside the axis is skipped."""
    out = np.array(buf, copy=True)
    moved = np.moveaxis(out, axis, 0)  # a view: writes land in ``out``
    rows = moved.shape[0]
    for s, d in zip(np.asarray(src).tolist(), np.asarray(dst).tolist()):
        if 0 <= s < rows and 0 <= d < rows:
            moved[d] = moved[s]
    return out


def reference_decode(q, k_cache, v_cache, cache_lengths, lookup_table, *, layout: str = "nhd",
                     sm_scale: float | None = None, sliding_window: int | None = None):
    """Plain numpy decode attention in float64: returns (out [batch, Hq, D] float64,
    lse [batch, Hq] float64, natural log)."""
    q = np.asarray(q, np.float64)
    batch, Hq, D = q.shape
    k_cache, v_cache = _loaded(k_cache, D), _loaded(v_cache, D)
    H = k_cache.shape[2] if layout == "nhd" else k_cache.shape[1]
    page_size = k_cache.shape[1] if layout == "nhd" else k_cache.shape[2]
    G = Hq // H
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    out = np.zeros((batch, Hq, D))
    lse = np.zeros((batch, Hq))
    for b in range(batch):
        end = int(cache_lengths[b]) + 1
        start = max(0, end - sliding_window) if sliding_window and sliding_window > 0 else 0
        pos = np.arange(start, end)
        pages = np.asarray(lookup_table)[b, pos // page_size]
        slots = pos % page_size
        if layout == "nhd":
            k, v = k_cache[pages, slots], v_cache[pages, slots]            # [n, H, D]
        else:
            k, v = k_cache[pages, :, slots], v_cache[pages, :, slots]      # [n, H, D]
        for hq in range(Hq):
            s = k[:, hq // G] @ q[b, hq] * scale
            mx = s.max()
            p = np.exp(s - mx)
            out[b, hq] = p @ v[:, hq // G] / p.sum()
            lse[b, hq] = mx + np.log(p.sum())
    return out, lse


def reference_prefill(q, k_cache, v_cache, qo_indptr, cache_lengths, lookup_table,
                      layout: str = "nhd", causal: bool = True, sm_scale=None,
                      sliding_window=None):
    """Plain numpy prefill attention in float64: returns ``(out, lse)``.

    ``out`` is ``[num_tokens, n_q_heads, head_dim]`` and ``lse`` ``[num_tokens, n_q_heads]``
    (natural log of the sum of ``exp(sm_scale * q.k)`` over the visible KV positions).
    """
    q = np.asarray(q, np.float64)
    ntok, hq, d = q.shape
    k_cache, v_cache = _loaded(k_cache, d), _loaded(v_cache, d)
    if layout == "nhd":
        page_size, h = k_cache.shape[1], k_cache.shape[2]
    else:
        page_size, h = k_cache.shape[2], k_cache.shape[1]
    g = hq // h
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    out = np.zeros((ntok, hq, d))
    lse = np.zeros((ntok, hq))
    for b in range(len(cache_lengths)):
        start, end = int(qo_indptr[b]), int(qo_indptr[b + 1])
        if end == start:
            continue
        clen = int(cache_lengths[b])
        kv_len = clen + end - start
        pos = np.arange(kv_len)
        pages = np.asarray(lookup_table[b])[pos // page_size]
        if layout == "nhd":
            keys, vals = k_cache[pages, pos % page_size], v_cache[pages, pos % page_size]
        else:
            keys, vals = k_cache[pages, :, pos % page_size], v_cache[pages, :, pos % page_size]
        keys, vals = np.repeat(keys, g, axis=1), np.repeat(vals, g, axis=1)  # [kv, hq, d]
        scores = np.einsum("qhd,khd->hqk", q[start:end], keys) * scale
        qpos = clen + np.arange(end - start)
        visible = np.ones((end - start, kv_len), bool)
        if causal:
            visible &= pos[None, :] <= qpos[:, None]
        if sliding_window is not None:
            visible &= pos[None, :] > qpos[:, None] - int(sliding_window)
        scores = np.where(visible[None], scores, -np.inf)
        top = scores.max(axis=-1, keepdims=True)
        p = np.exp(scores - top)
        total = p.sum(axis=-1, keepdims=True)
        if np.isfinite(vals).all():
            out[start:end] = np.einsum("hqk,khd->qhd", p / total, vals)
        else:  # a masked position weighs nothing: no 0 * NaN from a value it cannot see
            for i in range(end - start):
                seen = visible[i]
                out[start + i] = np.einsum("hk,khd->hd", (p / total)[:, i, seen], vals[seen])
        lse[start:end] = (np.log(total) + top)[..., 0].T
    return out, lse
