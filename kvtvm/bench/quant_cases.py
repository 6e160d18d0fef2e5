"""Quantized (and other-precision) copies of a benchmark case's cache for ``--cache-dtype``:
the same K/V stored as int8 / float8_e4m3fn rows (kvtvm's quantizing append, byte-equal to the
reference quantizer of :mod:`kvtvm.quant`) or as another full-precision type, and the stored
bytes a kernel reads."""

from __future__ import annotations

from ..params import DTYPE_SIZES
from ..quant import QUANT_DTYPES, quant_row_bytes

__all__ = ["CACHE_DTYPES", "cache_as", "kernel_cache_arg", "row_bytes", "speedup_lines"]

#: what ``--cache-dtype`` accepts
CACHE_DTYPES = (*sorted(DTYPE_SIZES), *QUANT_DTYPES)


def cache_as(cache, storage: str):
    """``cache [pages, page_size, H, D]`` (nhd) stored as ``storage``: a quantized view
    ``[..., quant_row_bytes(D)]`` written by kvtvm's own quantizing append on the cache's device
    (every row in page order: the reference bytes, fast on a GPU), or a full-precision copy."""
    import torch

    if storage not in QUANT_DTYPES:
        return cache.to(getattr(torch, storage))
    from .. import ops

    pages, page_size, heads, dim = cache.shape
    rows = cache.reshape(-1, heads, dim)
    dev = cache.device
    out = torch.zeros((pages, page_size, heads, quant_row_bytes(dim)), dtype=torch.int8,
                      device=dev).view(getattr(torch, storage))
    spare = torch.zeros_like(out)  # the V side of the call, dropped
    indptr = torch.tensor([0, rows.shape[0]], dtype=torch.int32, device=dev)
    lengths = torch.zeros(1, dtype=torch.int32, device=dev)
    table = torch.arange(pages, dtype=torch.int32, device=dev)[None]
    ops.append_kv(out, spare, rows, rows, indptr, lengths, table)
    del spare
    return out


def kernel_cache_arg(cache, storage: str, layout: str):
    """What a kernel of a spec storing one side as ``storage`` (``""``: full precision) takes
    for ``cache [pages, page_size, H, D]`` (nhd): the cache itself, or its quantized rows as an
    ``int8`` view (as :mod:`kvtvm.ops.quant` hands them over); ``hnd``: the strided ``[pages, H,
    page_size, ...]`` view of the same memory. For ``python -m kvtvm.tune``'s workloads."""
    import torch

    if storage:
        cache = cache_as(cache, storage).view(torch.int8)
    return cache.transpose(1, 2) if layout == "hnd" else cache


def row_bytes(storage: str, head_dim: int) -> int:
    """Bytes of one stored (token, head) row."""
    if storage in QUANT_DTYPES:
        return quant_row_bytes(head_dim)
    return DTYPE_SIZES[storage] * head_dim


def _gbs(row) -> float:
    """GB/s of the K/V bytes the run's cache stores (``extra["stored_bytes"]``)."""
    return row.extra.get("stored_bytes", 0) / (row.ms * 1e-3) / 1e9


def speedup_lines(rows, baseline: str, dtype: str) -> list[str]:
    """``<case>: kvtvm <storage> N x the <dtype> cache (M x the float16 cache)`` for each case
    and each ``kvtvm <storage>`` row: speed-ups against the full-precision runs."""
    by = {(r.case, r.impl): r for r in rows}
    lines = []
    for r in rows:
        if not r.impl.startswith("kvtvm ") or (r.case, baseline) not in by:
            continue
        base = by[(r.case, baseline)]
        others = [f"{o.ms / r.ms:.2f}x the {o.impl[6:]} cache" for o in rows
                  if o.case == r.case and o.impl.startswith("kvtvm ") and o is not r
                  and o.impl[6:] in DTYPE_SIZES and r.impl[6:] in QUANT_DTYPES]
        lines.append(f"{r.case}: {r.impl} {base.ms / r.ms:.2f}x the {dtype} cache"
                     + "".join(f", {o}" for o in others)
                     + f" ({_gbs(r):.3g} GB/s of stored bytes vs {_gbs(base):.3g})")
    return lines
