"""Per-layer views over fetched KV cache inputs (seeds 001 and 003).

A collection wraps one device's :class:`~kvtvm.inputs.RaggedKVCacheInputs`; ``get_key_cache``
and ``get_value_cache`` return a per-layer :class:`LayerKVCache` whose ``blocks`` is a zero-copy
strided view of the manager's cache tensor in the layout the kernels take:

=============  ===========================================  ========  ======================
strategy       per-layer K (or V) view                       layout    page_size
=============  ===========================================  ========  ======================
CONTINUOUS     ``blocks[:, 0, layer]`` ``[num_blocks, S, H, D]``   ``nhd``   ``max_seq_len``
PAGED          ``blocks[:, 0, layer]`` ``[num_pages, P, H, D]``    ``nhd``   ``page_size``
LINEAR         ``cache[layer, :, 0]`` ``[max_batch, H, S, D]``    ``hnd``   ``max_seq_len``
=============  ===========================================  ========  ======================

(``1`` instead of ``0`` selects V.) A quantized cache (``params.quantized``) is a byte tensor and
its views come from :func:`kvtvm.storage.layer_view`: same shapes, but an 8-bit layer's view is
int8 / float8_e4m3fn ``[..., quant_row_bytes(D)]`` (values then scale), see :mod:`kvtvm.quant`.
So an engine writes this step's K/V with::

    c = inputs.collection()
    kvtvm.ops.append_kv(c.get_key_cache(l).blocks, c.get_value_cache(l).blocks, k, v,
                        inputs.qo_indptr, inputs.cache_lengths, inputs.lookup_table,
                        layout=c.layout)

The accessor methods (``cache_length``, ``row_idx``, ``load``, ...) read host copies of the
tables; on a GPU, ``row_idx``/``load``/``store`` copy the lookup table to the host once (a
sync): they are for inspection and tests, not for the hot path.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidArgumentError, describe
from .params import KVCacheStrategy
from .storage import layer_view

__all__ = ["LayerKVCache", "KVCacheCollection", "ContinuousBatchingKVCacheCollection",
           "PagedKVCacheCollection", "LinearKVCacheCollection", "make_collection",
           "layer_views_by_signature", "view_signature"]


def _index_arg(name: str, value, size: int, what: str = "") -> int:
    """``value`` as an index in ``[0, size)`` (an int, never a bool), or
    :class:`InvalidArgumentError` naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or not 0 <= value < size:
        raise InvalidArgumentError(describe(name, f"an int in [0, {size}){what}", repr(value)))
    return int(value)


@dataclass
class LayerKVCache:
    """One layer's K (or V) cache for one step: the seed-003 ``PagedKVCache`` accessor.

    Attributes
    ----------
    blocks : torch.Tensor
        Strided view ``[num_pages, page_size, H, D]`` (``nhd``) or ``[num_pages, H, page_size,
        D]`` (``hnd``).
    cache_lengths : torch.Tensor
        int32 ``[batch]``.
    lookup_table : torch.Tensor
        int32 ``[batch, W]``.
    max_seq_length, max_cache_length : int
        Max new tokens and max cache length (after the new tokens) of this step.
    page_size : int
        Tokens per page.
    layout : str
        ``"nhd"`` or ``"hnd"``.
    cache_lengths_host : numpy.ndarray
        Host copy of ``cache_lengths`` (what the accessors read).

    The accessors raise :class:`~kvtvm.errors.StaleInputsError` once the fetch is superseded
    and :class:`~kvtvm.errors.InvalidArgumentError` for an index out of range (a ``tok_idx``
    at or past the entry's cache length plus its new tokens included).
    """

    blocks: Any
    cache_lengths: Any
    lookup_table: Any
    max_seq_length: int
    max_cache_length: int
    page_size: int
    layout: str
    cache_lengths_host: np.ndarray
    _lookup_host: np.ndarray | None = None
    #: per batch entry, this step's new tokens (positions the step may read or write end at
    #: ``cache_length + new``); None: no bound past the cache length is known
    new_tokens_host: np.ndarray | None = None
    #: the fetch's token: the accessors refuse stale inputs (StaleInputsError)
    token: Any = None
    #: the device's KVCacheParams (seed 003's ``kv_params``)
    kv_params: Any = None

    @property
    def dtype(self):
        """The view's torch dtype (seed 003's ``dtype``; an 8-bit layer: its storage type)."""
        return self.blocks.dtype

    def _table(self) -> np.ndarray:
        if self._lookup_host is None:  # a copy: on a CPU the tensor is the manager's buffer,
            self._lookup_host = self.lookup_table.detach().cpu().numpy().copy()  # reused
        return self._lookup_host

    def _live(self):
        """The fetch's manager lock, held from the liveness check through the table read and
        the cache access (a fetch on another thread cannot rewrite the tables, nor a release
        hand the page on, in between), or a null context for inputs without a manager."""
        lock = getattr(self.token, "lock", None)
        return nullcontext() if lock is None else lock

    def _batch_index(self, batch_idx) -> int:
        """``batch_idx`` checked: live inputs, an entry of the batch."""
        if self.token is not None:  # (a FetchToken: StaleInputsError when superseded)
            self.token.check("kv_cache_inputs")
        return _index_arg("batch_idx", batch_idx, len(self.cache_lengths_host))

    def _position(self, batch_idx, tok_idx) -> tuple[int, int]:
        """``(batch_idx, tok_idx)`` checked: live inputs, an entry of the batch, a position
        the step's pages hold (below the cache length plus this step's new tokens)."""
        b = self._batch_index(batch_idx)
        end = int(self.cache_lengths_host[b])
        if self.new_tokens_host is not None:
            end += int(self.new_tokens_host[b])
        return b, _index_arg("tok_idx", tok_idx, end, f" (batch entry {b}'s positions)")

    @property
    def page_size_(self) -> int:
        """:attr:`page_size` (seed 003's name)."""
        return self.page_size

    def cache_lengths_nd(self):
        """:attr:`cache_lengths`, int32 ``[batch]`` (seed 003)."""
        return self.cache_lengths

    def cache_length(self, batch_idx: int) -> int:
        """Tokens cached for batch entry ``batch_idx`` before this step's tokens."""
        return int(self.cache_lengths_host[self._batch_index(batch_idx)])

    def empty_cache(self) -> bool:
        """True if every batch entry has an empty cache."""
        return not self.cache_lengths_host.any()

    def max_prompt_length(self) -> int:
        """Most new tokens of a batch entry this step."""
        return self.max_seq_length

    def max_context_length(self) -> int:
        """Largest cache length of a batch entry once this step's tokens are in."""
        return self.max_cache_length

    def page_and_slot(self, batch_idx: int, tok_idx: int) -> tuple[int, int]:
        """(page, slot in page) of token ``tok_idx`` of batch entry ``batch_idx``."""
        with self._live():
            batch_idx, tok_idx = self._position(batch_idx, tok_idx)
            page = int(self._table()[batch_idx, tok_idx // self.page_size])
        return page, tok_idx % self.page_size

    def row_idx(self, batch_idx: int, tok_idx: int) -> int:
        """Row of the token when the layer's cache is viewed as ``[num_pages * page_size]``
        token rows."""
        page, slot = self.page_and_slot(batch_idx, tok_idx)
        return page * self.page_size + slot

    def col_idx(self, head_idx: int) -> int:
        """Column of head ``head_idx`` when a token row is viewed as ``[H * D]``."""
        return self._head(head_idx) * int(self.blocks.shape[-1])

    def _head(self, head_idx) -> int:
        heads = int(self.blocks.shape[2 if self.layout == "nhd" else 1])
        return _index_arg("head_idx", head_idx, heads)

    def _index(self, bs: int, head_idx: int, tok_idx: int):
        head_idx = self._head(head_idx)
        page, slot = self.page_and_slot(bs, tok_idx)
        return (page, slot, head_idx) if self.layout == "nhd" else (page, head_idx, slot)

    def load(self, bs: int, head_idx: int, tok_idx: int, head_dim_idx=slice(None),
             width: int | None = None):
        """Element(s) ``[head_dim_idx]`` of head ``head_idx`` at token ``tok_idx`` of ``bs``:
        a copy, read while the inputs are live (a view would see, and could write, whatever a
        later step puts in that page).

        Parameters
        ----------
        bs, head_idx, tok_idx : int
            Batch entry, KV head and token position (below the entry's cache length plus
            its new tokens).
        head_dim_idx : int or slice
            Index into ``head_dim``; all of it by default.
        width : int, optional
            Seed 003's ``load[width]``: ``width`` elements from the int ``head_dim_idx``.

        Returns
        -------
        torch.Tensor
            ``[head_dim]`` (or as ``head_dim_idx`` selects; ``[width]``) in the view's dtype.
        """
        if width is not None:
            d = int(self.blocks.shape[-1])
            if _index_arg("width", width, d + 1) == 0:
                raise InvalidArgumentError(describe("width", f"an int in [1, {d}]", 0))
            first = _index_arg("head_dim_idx", head_dim_idx, d - width + 1, f" (width {width})")
            head_dim_idx = slice(first, first + width)
        with self._live():
            return self.blocks[self._index(bs, head_idx, tok_idx)][head_dim_idx].clone()

    def store(self, bs: int, head_idx: int, tok_idx: int, head_dim_idx, val) -> None:
        """Write ``val`` at element(s) ``[head_dim_idx]`` of head ``head_idx``, token
        ``tok_idx`` of ``bs`` (its values only: a tensor that requires grad would have drawn
        the manager's whole cache into its graph). Indices as :meth:`load`; ``val`` a scalar
        or a tensor broadcastable to the selected elements -- or, at an int ``head_dim_idx``,
        seed 003's ``store(..., val: SIMD[size])``: ``size`` elements from there. A ``val``
        that fits none of these is an InvalidArgumentError naming it."""
        if hasattr(val, "detach"):
            val = val.detach()
        size = int(getattr(val, "numel", lambda: 1)())
        if not isinstance(head_dim_idx, slice) and getattr(val, "dim", lambda: 0)() > 0 \
                and size > 1:  # seed 003's vector: size elements from an int index
            d = int(self.blocks.shape[-1])
            first = _index_arg("head_dim_idx", head_dim_idx, d)
            if first + size > d:
                raise InvalidArgumentError(describe(
                    "val", f"at most {d - first} elements from head_dim_idx {first} "
                    f"(head_dim {d})", f"{size} elements"))
            head_dim_idx = slice(first, first + size)
            val = val.reshape(size)
        with self._live():
            row = self.blocks[self._index(bs, head_idx, tok_idx)]
            try:
                row[head_dim_idx] = val
            except (RuntimeError, TypeError, ValueError) as err:  # (torch's shape errors)
                shape = list(getattr(val, "shape", ()))
                raise InvalidArgumentError(describe(
                    "val", f"a scalar or values broadcastable to {list(row[head_dim_idx].shape)}",
                    f"shape {shape} ({err})")) from None


class KVCacheCollection:
    """Per-layer views of one device's inputs for one step."""

    layout = "nhd"

    def __init__(self, inputs):
        self.inputs = inputs
        self.num_layers = inputs.num_layers
        ml = inputs.max_lengths
        self.max_seq_length = int(ml[0, 0])
        self.max_cache_length = int(ml[0, 1])
        self._lookup_host = None

    @property
    def blocks(self):
        return self.inputs.blocks

    @property
    def cache_lengths(self):
        return self.inputs.cache_lengths

    @property
    def lookup_table(self):
        return self.inputs.lookup_table

    @property
    def page_size(self) -> int:
        raise NotImplementedError

    def _view(self, layer: int, kv: int):
        return self.view_of(self.blocks, self.inputs.params, self.num_layers, layer, kv)

    @classmethod
    def view_of(cls, blocks, params, num_layers: int, layer: int, kv: int):
        """Layer ``layer``'s K (``kv=0``) or V (``kv=1``) view of one device's cache tensor
        ``blocks`` (``params``: that device's parameters)."""
        if params is not None and params.quantized:
            return layer_view(blocks, params, num_layers, layer, kv)
        return cls._dense_view(blocks, layer, kv)

    @staticmethod
    def _dense_view(blocks, layer: int, kv: int):
        return blocks[:, kv, layer]

    def _check_layer(self, layer) -> int:
        return _index_arg("layer", layer, self.num_layers)

    def _layer(self, layer: int, kv: int) -> LayerKVCache:
        layer = self._check_layer(layer)
        qo = self.inputs.qo_indptr_host
        acc = LayerKVCache(self._view(layer, kv), self.cache_lengths, self.lookup_table,
                           self.max_seq_length, self.max_cache_length, self.page_size,
                           self.layout, self.inputs.cache_lengths_host,
                           new_tokens_host=None if qo is None else np.diff(np.asarray(qo)),
                           token=getattr(self.inputs, "token", None),
                           kv_params=self.inputs.params)
        if self._lookup_host is not None:
            acc._lookup_host = self._lookup_host
        return acc

    def get_key_cache(self, layer_idx: int) -> LayerKVCache:
        """Layer ``layer_idx``'s K cache (zero-copy view; shapes in the module docstring);
        InvalidArgumentError unless ``0 <= layer_idx < num_layers``."""
        return self._layer(layer_idx, 0)

    def get_value_cache(self, layer_idx: int) -> LayerKVCache:
        """Layer ``layer_idx``'s V cache (as :meth:`get_key_cache`)."""
        return self._layer(layer_idx, 1)

    def cache_length(self, bs_idx: int) -> int:
        """Tokens cached for batch entry ``bs_idx`` before this step's tokens."""
        self.inputs.check_live()  # StaleInputsError when superseded
        lengths = self.inputs.cache_lengths_host
        return int(lengths[_index_arg("bs_idx", bs_idx, len(lengths))])

    def empty_cache(self) -> bool:
        return not self.inputs.cache_lengths_host.any()

    def max_prompt_length(self) -> int:
        return self.max_seq_length

    def max_context_length(self) -> int:
        return self.max_cache_length

    # seed 001's members (its comptime ones as properties)
    name_str = "kv_cache"

    @property
    def kv_params(self):
        """The device's :class:`~kvtvm.params.KVCacheParams`."""
        return self.inputs.params

    @property
    def dtype(self):
        """The torch dtype of layer 0's K view (an 8-bit cache: int8 or float8_e4m3fn; with
        ``skip_layers`` the layers differ: ``get_key_cache(l).blocks.dtype``)."""
        return self._view(0, 0).dtype

    @property
    def scale_dtype(self):
        """``"float32"`` when K or V rows carry a scale (8-bit), else None (seed 001's
        ``DType.invalid``)."""
        params = self.inputs.params
        return "float32" if params is not None and params.quantized else None

    @property
    def kv_cache_dynamic_shape(self) -> tuple:
        """Shape of layer 0's K view (``[pages, page_size, H, D]`` or, linear,
        ``[slots, H, max_seq_len, D]``; an 8-bit layer's last axis is its row bytes)."""
        return tuple(self._view(0, 0).shape)

    @property
    def kv_cache_dynamic_strides(self) -> tuple:
        """Strides (elements) of layer 0's K view."""
        return tuple(self._view(0, 0).stride())


class ContinuousBatchingKVCacheCollection(KVCacheCollection):
    """Seed 001: views of a CONTINUOUS cache; a block is a page of ``max_seq_len`` tokens."""

    name_str = "continuous_batching"

    @property
    def page_size(self) -> int:
        if self.blocks.dim() == 2:  # quantized byte tensor: a block holds max_seq_len tokens
            return int(self.blocks.shape[1]) // self.inputs.params.bytes_per_token(
                self.num_layers)
        return int(self.blocks.shape[3])


class PagedKVCacheCollection(KVCacheCollection):
    """Seed 003: views of a PAGED cache."""

    name_str = "paged"

    @property
    def page_size(self) -> int:
        if self.blocks.dim() == 2:  # quantized byte tensor: a block holds max_seq_len tokens
            return int(self.blocks.shape[1]) // self.inputs.params.bytes_per_token(
                self.num_layers)
        return int(self.blocks.shape[3])


class LinearKVCacheCollection(KVCacheCollection):
    """Views of a LINEAR cache (head-major, ``hnd``); a batch slot is a page of
    ``max_seq_len`` tokens."""

    layout = "hnd"
    name_str = "linear"

    @property
    def page_size(self) -> int:
        if self.blocks.dim() == 3:  # quantized byte tensor [1, slots, slot_bytes]
            return int(self.blocks.shape[2]) // self.inputs.params.bytes_per_token(
                self.num_layers)
        return int(self.blocks.shape[4])

    @staticmethod
    def _dense_view(blocks, layer: int, kv: int):
        return blocks[layer, :, kv]


_COLLECTIONS = {KVCacheStrategy.CONTINUOUS: ContinuousBatchingKVCacheCollection,
                KVCacheStrategy.PAGED: PagedKVCacheCollection,
                KVCacheStrategy.LINEAR: LinearKVCacheCollection}


def make_collection(inputs) -> KVCacheCollection:
    """The collection class matching ``inputs.params.cache_strategy``."""
    return _COLLECTIONS[inputs.params.cache_strategy](inputs)


def layer_views_by_signature(caches, params, num_layers: int) -> dict:
    """Every per-layer K and V view the collections cut from a manager's cache tensors
    (``caches``: one per device; ``params``: the per-device parameters), keyed by
    :func:`view_signature`: ``signature -> (layer, kv, dtype, device index)``. The ops look
    a cache argument up here to refuse another view of the same memory (a slice, K and V
    swapped, two layers, two devices' head shards, another dtype) with a fetch's tables."""
    cls = _COLLECTIONS[params.cache_strategy]
    out = {}
    for dev, blocks in enumerate(caches):
        for layer in range(num_layers):
            for kv in (0, 1):
                view = cls.view_of(blocks, params, num_layers, layer, kv)
                out[view_signature(view)] = (layer, kv, view.dtype, dev)
    return out


def view_signature(t) -> tuple:
    """Where a tensor view lies and how it walks memory: (device, first byte, shape, strides,
    item size) -- equal for two views of the same elements whatever their dtype (the dtype is
    compared apart: an 8-bit cache's float8 view and the int8 view the kernels take)."""
    return t.device, t.data_ptr(), t.shape, t.stride(), t.element_size()
