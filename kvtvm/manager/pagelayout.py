"""Where a page's KV heads live: the full-head rows of pages gathered from a cache that splits
the heads over devices, and full-head rows written back split (resharding), for dense and
quantized pages. Used by export/import (:mod:`.pageio`) and the tiers (:mod:`.tiers`).

A dense page is ``[2, L, P, heads, D]``: a device holds a slice of the head axis. A quantized
(or mixed-format) page is one byte row (:mod:`kvtvm.params`): segments ``(kv, layer)`` of
``[P, heads, row_bytes]`` one after the other, so a device's page is, segment by segment, the
slice of its heads; :func:`split_quant_rows` / :func:`join_quant_rows` convert between the
full-head byte row (what a header's ``page_bytes`` describes) and the devices' ones, byte for
byte (the values, the float32 scale and the padding of every (token, head) row move together).
"""

from __future__ import annotations

from ..errors import InvalidArgumentError, describe
from .args import check_int

__all__ = ["split_quant_rows", "join_quant_rows", "page_runs", "PageLayoutMixin"]


def page_runs(pages: list) -> list:
    """``[(i, j, first page)]``: maximal runs ``pages[i:j]`` of consecutive ascending pages."""
    out, i = [], 0
    for j in range(1, len(pages) + 1):
        if j == len(pages) or pages[j] != pages[j - 1] + 1:
            out.append((i, j, pages[i]))
            i = j
    return out


def split_quant_rows(rows, params, num_layers: int, n_devices: int) -> list:
    """Full-head quantized pages ``[n, bytes_per_page(L)]`` (uint8) -> one
    ``[n, bytes_per_page(L, n_devices)]`` tensor per device (head slices, in device order)."""
    import torch

    if n_devices == 1:
        return [rows]
    P, H = params.page_size, params.n_kv_heads
    hpd, n = params.heads_per_device(n_devices), rows.shape[0]
    parts = []
    for d in range(n_devices):
        segs = [rows[:, off:off + P * H * row].reshape(n, P, H, row)[:, :, d * hpd:(d + 1) * hpd]
                .reshape(n, P * hpd * row)  # not -1: n may be 0 (nothing carried)
                for _, _, off, _, row in params.segments(num_layers, P, 1)]
        parts.append(torch.cat(segs, dim=1))
    return parts


def join_quant_rows(parts, params, num_layers: int):
    """Inverse of :func:`split_quant_rows`: the devices' pages ``[n, bytes_per_page(L, d)]``
    -> full-head pages ``[n, bytes_per_page(L)]`` (on the first part's device)."""
    import torch

    if len(parts) == 1:
        return parts[0]
    P, n, dev = params.page_size, parts[0].shape[0], parts[0].device
    hpd = params.heads_per_device(len(parts))
    segs = []
    for _, _, off, _, row in params.segments(num_layers, P, len(parts)):
        size = P * hpd * row
        heads = [p[:, off:off + size].to(dev).reshape(n, P, hpd, row) for p in parts]
        segs.append(torch.cat(heads, dim=2).reshape(n, P * hpd * len(parts) * row))
    return torch.cat(segs, dim=1)


class PageLayoutMixin:
    """Gather / scatter of full-head pages for :class:`~kvtvm.manager.PagedKVCacheManager`."""

    def _gather(self, pages: list, heads: tuple):
        """``[n, 2, L, P, h1-h0, D]`` (``[n, page_bytes]`` quantized) of the given pages: a
        view when they are consecutive, on one device, with every head; else one gather (on
        the host when the cache spans devices)."""
        h0, h1 = heads
        if self.n_devices == 1 and (h0, h1) == (0, self.params.n_kv_heads) and pages and \
                pages == list(range(pages[0], pages[0] + len(pages))):
            return self._blocks[0][pages[0]:pages[0] + len(pages)]
        import torch

        idx = torch.tensor(pages, dtype=torch.int64)
        many = len(self._blocks) > 1
        parts = [b.index_select(0, idx.to(b.device)) for b in self._blocks]
        if many:
            parts = [p.cpu() for p in parts]
        if self.params.quantized:  # every head (see _check_heads)
            return join_quant_rows(parts, self.params, self.num_layers)
        full = torch.cat(parts, dim=4) if many else parts[0]
        return full[:, :, :, :, h0:h1].contiguous()

    def _scatter(self, pages: list, rows) -> None:
        """Write full-head pages ``rows`` (``[n, *page_shape]``) into cache ``pages``,
        each device taking its heads."""
        import torch

        if self.n_devices == 1:  # a few runs of consecutive pages: slice copies, no index
            blocks, spans = self._blocks[0], page_runs(pages)
            if len(spans) <= 4:
                rows = rows.to(blocks.device)
                if rows.untyped_storage().data_ptr() == blocks.untyped_storage().data_ptr():
                    rows = rows.clone()  # an export of this very cache (a view of it)
                for i, j, p in spans:
                    blocks[p:p + j - i].copy_(rows[i:j])
                return
        idx = torch.tensor(pages, dtype=torch.int64)
        if self.params.quantized:
            parts = split_quant_rows(rows, self.params, self.num_layers, self.n_devices)
        else:
            hpd = self.params.heads_per_device(self.n_devices)
            parts = [rows[:, :, :, :, d * hpd:(d + 1) * hpd] for d in range(self.n_devices)]
        for part, blocks in zip(parts, self._blocks):
            part = part.to(blocks.device)
            if part.untyped_storage().data_ptr() == blocks.untyped_storage().data_ptr():
                part = part.clone()  # an export of this very cache (a view of it)
            blocks.index_copy_(0, idx.to(blocks.device), part)

    def _check_heads(self, heads) -> tuple:
        H = self.params.n_kv_heads
        if heads is None:
            return 0, H
        if not isinstance(heads, (tuple, list)) or len(heads) != 2:
            raise InvalidArgumentError(describe("heads", "(h0, h1)", repr(heads)))
        h0, h1 = (check_int("heads", x) for x in heads)
        if self.params.quantized and (h0, h1) != (0, H):
            raise InvalidArgumentError(describe("heads", f"(0, {H}) for a quantized cache "
                                                "(its pages travel whole)", repr(heads)))
        if not 0 <= h0 < h1 <= H:
            raise InvalidArgumentError(describe("heads", f"0 <= h0 < h1 <= {H}", (h0, h1)))
        return h0, h1
