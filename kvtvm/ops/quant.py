"""The ops' side of quantized caches: telling a quantized K/V pair from its views, checking it,
and the kernel arguments it becomes.

A call whose ``k_cache`` or ``v_cache`` is an 8-bit view (``int8`` / ``float8_e4m3fn`` rows of
``quant_row_bytes(head_dim)``, :mod:`kvtvm.storage`) takes this path; any other call is checked
by :func:`kvtvm.ops.checks.check_cache_pair` exactly as before. The storage types come from the
views alone (:func:`kvtvm.storage.view_storage`) and select the kernel
(``KernelSpec.k_storage`` / ``v_storage``); an 8-bit side reaches the kernel as an ``int8`` view
of the same bytes (no copy, no float8 DLPack needed).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..compiler import LAYOUTS
from ..errors import DTypeMismatchError, InvalidArgumentError, describe
from ..quant import QUANT_DTYPES
from ..storage import view_storage
from .checks import CacheGeometry, check_rank, checked_geometry

__all__ = ["is_quantized_pair", "QuantPair", "check_quant_cache_pair", "check_quant_target",
           "QUANT_TARGETS"]

#: Where kernels reading / writing quantized caches run: (target, op) -> storage types. CUDA
#: has the quantizing append and decode (schedules/{append,decode}/cuda_quant.py; checked on an
#: H100 against the references, docs/PERF.md) and prefill (the tensor-core kernel staging 8-bit
#: tiles, schedules/prefill/cuda_quant_tiles.py; float32 queries: the simt kernel dequantizing
#: as it loads).
QUANT_TARGETS = {("llvm", "append"): QUANT_DTYPES, ("llvm", "decode"): QUANT_DTYPES,
                 ("llvm", "prefill"): QUANT_DTYPES, ("cuda", "append"): QUANT_DTYPES,
                 ("cuda", "decode"): QUANT_DTYPES, ("cuda", "prefill"): QUANT_DTYPES}
#: (target, op) whose quantized kernels need both K and V 8-bit: none now (the CUDA append,
#: decode and prefill each take either side 8-bit or full precision: K-only, V-only, mixed).
BOTH_8BIT = ()

def _is_8bit(t) -> bool:
    return t.element_size() == 1


def is_quantized_pair(k_cache, v_cache) -> bool:
    """Whether either view of a call is an 8-bit (quantized) cache view."""
    return _is_8bit(k_cache) or _is_8bit(v_cache)


@dataclass
class QuantPair:
    """A checked quantized K/V pair: geometry, storage types (``""``: full precision) and the
    tensors the kernel takes."""

    geometry: CacheGeometry
    k_storage: str
    v_storage: str
    k_arg: object
    v_arg: object

    @property
    def spec_fields(self) -> dict:
        """The ``KernelSpec`` fields of the storage types."""
        return {"k_storage": self.k_storage, "v_storage": self.v_storage}


def _kernel_view(t, storage: str):
    import torch

    return t.view(torch.int8) if storage else t


def check_quant_cache_pair(k_cache, v_cache, layout: str, dtype: str,
                           head_dim: int) -> QuantPair:
    """Check a K/V pair of which at least one side is quantized.

    Parameters
    ----------
    k_cache, v_cache : torch.Tensor
        One layer's views: ``[num_pages, page_size, H, row]`` (nhd) or ``[num_pages, H,
        page_size, row]`` (hnd); ``row`` is ``head_dim`` for a full-precision side (of
        ``dtype``) and ``quant_row_bytes(head_dim)`` for an 8-bit one.
    layout : {"nhd", "hnd"}
    dtype : str
        Element type of the call's q/k/v tensors.
    head_dim : int
        Read off the call's q (or k) tensor.

    Raises
    ------
    DTypeMismatchError, InvalidArgumentError
        A view of another type or another ``params`` (its row does not fit ``head_dim``), or
        K and V of different page/head geometry.
    """
    if layout not in LAYOUTS:
        raise InvalidArgumentError(describe("layout", LAYOUTS, repr(layout)))
    storages = []
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_rank(name, t, 4, "[num_pages, page_size, n_kv_heads, row]" if layout == "nhd"
                   else "[num_pages, n_kv_heads, page_size, row]")
        storages.append(view_storage(name, t, head_dim, dtype))
        if t.stride(-1) != 1:
            raise InvalidArgumentError(describe(f"{name}.stride(-1)", 1, t.stride(-1)))
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        raise InvalidArgumentError(describe("v_cache.shape[:3]", list(k_cache.shape[:3]),
                                            list(v_cache.shape[:3])))
    num_pages, a, b = (int(x) for x in k_cache.shape[:3])
    page_size, heads = (a, b) if layout == "nhd" else (b, a)
    ks, vs = ("" if s == dtype else s for s in storages)
    geo = checked_geometry(CacheGeometry(num_pages, page_size, heads, head_dim, dtype),
                           k_cache, layout)
    return QuantPair(geo, ks, vs,
                     _kernel_view(k_cache, ks), _kernel_view(v_cache, vs))


def check_quant_target(device, pair: QuantPair, op: str) -> None:
    """Raise unless ``op`` has kernels reading this pair's storage types on ``device``.

    Raises
    ------
    DTypeMismatchError
        Naming the storage type given and those supported there.
    """
    target = "llvm" if device.type == "cpu" else device.type
    supported = QUANT_TARGETS.get((target, op), ())
    for name, storage in (("k_cache", pair.k_storage), ("v_cache", pair.v_storage)):
        if storage and storage not in supported:
            raise DTypeMismatchError(describe(
                f"{name} storage for {op} on {device}",
                f"one of {[pair.geometry.dtype, *supported]}"
                + ("" if supported else f" (no quantized {op} kernel for {target} yet; "
                   "the CPU has them)"), storage))
    if (target, op) in BOTH_8BIT and not (pair.k_storage and pair.v_storage):
        name = "v_cache" if pair.k_storage else "k_cache"
        raise DTypeMismatchError(describe(
            f"{name} storage for {op} on {device}",
            f"8-bit like the other view ({', '.join(QUANT_DTYPES)}): {target} kernels read "
            "K and V both quantized or both full precision",
            pair.geometry.dtype))


def quant_pair_for(k_cache, v_cache, layout: str, ref_name: str, ref) -> QuantPair | None:
    """The checked quantized pair of a call, or None when neither view is 8-bit (the caller
    then checks the pair as before). ``ref`` (``q`` or ``k``) gives dtype and head_dim.

    Raises
    ------
    DTypeMismatchError, InvalidArgumentError
    """
    if not is_quantized_pair(k_cache, v_cache):
        return None
    from ..params import DTYPE_SIZES
    from .checks import _dtype, check_dtype

    check_dtype(ref_name, ref, tuple(DTYPE_SIZES))
    check_rank(ref_name, ref, 3, f"[{'batch' if ref_name == 'q' else 'num_tokens'}, heads, "
               "head_dim]")
    if int(ref.shape[2]) < 1:
        raise InvalidArgumentError(describe(f"{ref_name}.shape[2] (head_dim)", ">= 1",
                                            f"0 (shape {list(ref.shape)})"))
    return check_quant_cache_pair(k_cache, v_cache, layout, _dtype(ref), int(ref.shape[2]))
