"""Per-layer views of a quantized (or mixed-format) cache tensor, and what the ops read off a
view.

A quantized cache is one uint8 tensor (see :mod:`kvtvm.params`); :func:`layer_view` cuts a
layer's K or V out of it as a zero-copy view in the layout the kernels take:

=============  ================================================  ========
strategy       view                                               layout
=============  ================================================  ========
CONTINUOUS     ``[num_blocks, max_seq_len, H, row]``              ``nhd``
PAGED          ``[num_pages, page_size, H, row]``                 ``nhd``
LINEAR         ``[max_batch_size, H, max_seq_len, row]``          ``hnd``
=============  ================================================  ========

For an 8-bit layer the view's dtype is the storage type (``torch.int8`` or
``torch.float8_e4m3fn``) and ``row = quant_row_bytes(head_dim)`` (values, float32 scale,
padding; :mod:`kvtvm.quant`). A full-precision layer of a mixed cache (a skipped layer, the V
of a K-only cache) is a ``dtype`` view ``[..., head_dim]`` whose rows are padded to 16 bytes
(so its token stride is larger than ``H * head_dim``), which every kernel already accepts.

:func:`view_storage` is how the ops learn the storage type from a view, with no extra argument:
the view's dtype names it, and its last extent must be the row of that type for the call's
``head_dim``.
"""

from __future__ import annotations

from typing import Any

from .errors import DTypeMismatchError, InvalidArgumentError, describe
from .params import DTYPE_SIZES, KVCacheParams, KVCacheStrategy
from .quant import QUANT_DTYPES, quant_row_bytes

__all__ = ["layer_view", "view_storage", "split_rows"]

#: Attribute of an 8-bit view :func:`layer_view` cut: ``(head_dim, dtype)`` of its params. Rows
#: of several head_dims have one byte length (96, 100, 104 and 108 are all 112-byte rows), and
#: 8-bit rows do not say which q/k/v dtype the cache was made for, so the last extent alone
#: cannot tell a view of another ``params``; :func:`view_storage` checks it. (It lives on the
#: view object: a re-view, ``view[:]``, is checked by its row length only.)
_HEAD_DIM_ATTR = "_kvtvm_head_dim"


def _torch_dtype(storage: str):
    import torch

    return getattr(torch, storage)


def layer_view(cache, params: KVCacheParams, num_layers: int, layer: int, kv: int,
               n_devices: int = 1):
    """Layer ``layer``'s K (``kv=0``) or V (``kv=1``) view of a quantized cache tensor.

    Parameters
    ----------
    cache : torch.Tensor
        uint8 ``[units, unit_bytes]`` (``[1, units, unit_bytes]`` for LINEAR), as
        :meth:`KVCacheParams.cache_shape` of a quantized ``params``.
    params : KVCacheParams
    num_layers, layer, kv : int
    n_devices : int
        Devices the heads are split over (each device's tensor holds its share).

    Returns
    -------
    torch.Tensor
        A zero-copy view (see the module docstring for its shape and dtype).
    """
    linear = params.cache_strategy is KVCacheStrategy.LINEAR
    flat = cache[0] if linear else cache
    heads = params.heads_per_device(n_devices)
    tokens = int(flat.shape[1]) // params.bytes_per_token(num_layers, n_devices)
    kv_, layer_, offset, storage, row = params.segments(num_layers, tokens, n_devices)[
        kv * num_layers + layer]
    assert (kv_, layer_) == (kv, layer)
    seg = flat[:, offset:offset + tokens * heads * row].view(_torch_dtype(storage))
    elems = row // (1 if storage in QUANT_DTYPES else DTYPE_SIZES[storage])
    dims = (heads, tokens, elems) if linear else (tokens, heads, elems)
    view = seg.unflatten(1, dims)
    if storage not in QUANT_DTYPES:
        return view[..., :params.head_dim]
    setattr(view, _HEAD_DIM_ATTR, (params.head_dim, params.dtype))
    return view


def view_storage(name: str, view: Any, head_dim: int, dtype: str) -> str:
    """The storage type of a cache view the ops were given: ``dtype`` (a full-precision view,
    last extent ``head_dim``) or ``"int8"`` / ``"float8_e4m3fn"`` (last extent
    ``quant_row_bytes(head_dim)``).

    Raises
    ------
    DTypeMismatchError
        The view's dtype is neither ``dtype`` nor an 8-bit storage type.
    InvalidArgumentError
        The last extent does not fit the storage type and ``head_dim``, or the view was cut
        (:func:`layer_view`) from a cache of another ``head_dim`` with rows of the same length.
    """
    storage = str(view.dtype).replace("torch.", "")
    if storage == dtype:
        want = head_dim
    elif storage in QUANT_DTYPES:
        want = quant_row_bytes(head_dim)
    else:
        raise DTypeMismatchError(describe(f"{name} dtype", [dtype, *QUANT_DTYPES], storage))
    if int(view.shape[-1]) != want:
        raise InvalidArgumentError(describe(
            f"{name}.shape[-1]", f"{want} (a {storage} row of head_dim={head_dim})",
            int(view.shape[-1])))
    made_dim, made_dtype = getattr(view, _HEAD_DIM_ATTR, (head_dim, dtype))
    if made_dim != head_dim:
        raise InvalidArgumentError(describe(
            name, f"a view of a head_dim={head_dim} cache (the call's head_dim)",
            f"a view of a head_dim={made_dim} cache (its {want}-byte rows hold {made_dim} "
            "values)"))
    if made_dtype != dtype:
        raise DTypeMismatchError(describe(
            name, f"a view of a cache for {dtype} q/k/v (the call's)",
            f"a view of a cache for {made_dtype} ones"))
    return storage


def split_rows(view, head_dim: int):
    """``(values, scales)`` of a quantized cache view ``[..., quant_row_bytes(D)]``: values
    ``[..., D]`` in the storage dtype, scales float32 ``[...]``. Both are views of the cache
    when ``D`` is a multiple of 4; otherwise the scale sits at a byte offset no float32 view
    can start at, and ``scales`` is a copy (writing it changes nothing in the cache)."""
    import torch

    values = view[..., :head_dim]
    scale_bytes = view.view(torch.uint8)[..., head_dim:head_dim + 4]
    if head_dim % 4 or scale_bytes.storage_offset() % 4:
        scale_bytes = scale_bytes.contiguous()
    return values, scale_bytes.view(torch.float32)[..., 0]
