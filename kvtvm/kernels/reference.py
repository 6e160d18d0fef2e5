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

__all__ = ["reference_append", "reference_copy_pages", "reference_decode", "reference_prefill"]


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
    """Plain numpy append: returns new (k_cache, v_cache) arrays, inputs untouched."""
    k_out, v_out = np.array(k_cache, copy=True), np.array(v_cache, copy=True)
    k, v = _stored(k, k_out), _stored(v, v_out)
    page_size = k_out.shape[1] if layout == "nhd" else k_out.shape[2]
    for b in range(len(cache_lengths)):
        for row in range(int(qo_indptr[b]), int(qo_indptr[b + 1])):
            pos = int(cache_lengths[b]) + row - int(qo_indptr[b])
            page, slot = int(lookup_table[b, pos // page_size]), pos % page_size
            if layout == "nhd":
                k_out[page, slot], v_out[page, slot] = k[row], v[row]
            else:
                k_out[page, :, slot], v_out[page, :, slot] = k[row], v[row]
    return k_out, v_out


def reference_copy_pages(buf: np.ndarray, src, dst, axis: int = 0) -> np.ndarray:
    """Numpy reference: a copy of ``buf`` after ``buf[..., dst[i], ...] = buf[..., src[i], ...]``
    along ``axis``, for ``i`` in order."""
    out = np.array(buf, copy=True)
    moved = np.moveaxis(out, axis, 0)  # a view: writes land in ``out``
    for s, d in zip(np.asarray(src).tolist(), np.asarray(dst).tolist()):
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
        out[start:end] = np.einsum("hqk,khd->qhd", p / total, vals)
        lse[start:end] = (np.log(total) + top)[..., 0].T
    return out, lse
