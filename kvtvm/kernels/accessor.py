"""The one cache accessor every kernel is written against.

A sequence ``b`` of the batch owns pages ``lookup_table[b, :]``; its token ``t`` lives in page
``lookup_table[b, t // page_size]`` at slot ``t % page_size``. A per-layer K (or V) cache is a
4-D strided buffer whose token layout is a compile-time choice:

- ``nhd``: ``[num_pages, page_size, n_kv_heads, head_dim]`` (PAGED; CONTINUOUS with
  ``page_size = max_seq_len`` and one page per sequence);
- ``hnd``: ``[num_pages, n_kv_heads, page_size, head_dim]`` (LINEAR: page = batch slot).

Strides (but the innermost, which is 1) and element offset are symbolic (int64), so a strided view of one layer of the
manager's cache tensor is passed with no copy. ``page_size`` is a runtime value.

A side of the cache may be stored quantized (:mod:`kvtvm.quant`: ``KernelSpec.k_storage`` /
``v_storage``); :func:`match_cache_pair` binds it as the rows' bytes and the kernels read it
through :mod:`kvtvm.kernels.quant_access` (``dequant``, ``load_value``, ``row_scale``), which
for a full-precision side are plain converting loads -- one kernel per family serves every
storage type.
"""

from __future__ import annotations

from ..quant import quant_row_bytes
from ._tvm import T
from .errflag import ERR_SLOTS


def i64(value):
    """An int64 TIR constant (symbolic strides only bind against int64 shapes)."""
    return T.int64(value) if isinstance(value, int) else value


def cache_shape(layout: str, num_pages, page_size, n_kv_heads: int, head_dim: int):
    """Shape of a per-layer cache buffer in ``layout`` (int64 extents)."""
    n_kv_heads, head_dim = i64(n_kv_heads), i64(head_dim)
    if layout == "nhd":
        return (num_pages, page_size, n_kv_heads, head_dim)
    return (num_pages, n_kv_heads, page_size, head_dim)


def cache_index(layout: str, page, slot, head, dim):
    """Index of (page, slot, head, dim) in a cache buffer of ``layout``."""
    if layout == "nhd":
        return (page, slot, head, dim)
    return (page, head, slot, dim)


#: Bytes per element: the only alignment kvtvm assumes of a tensor it is given.
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "int32": 4, "int64": 8}


def match_tensor(handle, shape, dtype: str, **kwargs):
    """``T.match_buffer`` of a caller's tensor, assuming only element alignment.

    TVM's default (64 bytes) lets LLVM emit aligned vector accesses, which fault on a numpy
    array or a view that starts elsewhere; unaligned vector accesses cost nothing on aligned
    data. (CUDA kernels that move 16-byte vectors have their ops check 16-byte alignment.)
    """
    return T.match_buffer(handle, shape, dtype, align=_ITEMSIZE[dtype], **kwargs)


def match_cache(handle, layout: str, num_pages, page_size, n_kv_heads: int, head_dim: int,
                dtype: str, strides, elem_offset):
    """``T.match_buffer`` of a strided per-layer cache (call inside a TVMScript function)."""
    return match_tensor(handle, cache_shape(layout, num_pages, page_size, n_kv_heads, head_dim),
                        dtype, strides=[i64(s) for s in strides], elem_offset=elem_offset)


def cache_row_elems(storage: str, head_dim: int) -> int:
    """Last extent of a cache buffer stored as ``storage``: the quantized row's bytes
    (:func:`kvtvm.quant.quant_row_bytes`: values, float32 scale, padding), or ``head_dim`` for a
    full-precision buffer (``storage == ""``)."""
    return quant_row_bytes(head_dim) if storage else head_dim


def match_storage_cache(handle, layout: str, num_pages, page_size, n_kv_heads: int,
                        head_dim: int, dtype: str, storage: str = ""):
    """``T.match_buffer`` of a strided per-layer cache stored as ``storage``: ``""`` binds a
    ``dtype`` buffer; ``"int8"`` / ``"float8_e4m3fn"`` bind the rows' bytes as an ``int8``
    buffer (byte alignment only; the ops hand an ``int8`` view of the same bytes whatever the
    8-bit type, :mod:`kvtvm.kernels.quant_access` decodes them)."""
    shape = cache_shape(layout, num_pages, page_size, n_kv_heads,
                        cache_row_elems(storage, head_dim))
    strides = [T.int64(), T.int64(), T.int64(), i64(1)]
    if storage:
        return T.match_buffer(handle, shape, "int8", align=1, strides=strides,
                              elem_offset=T.int64())
    return match_tensor(handle, shape, dtype, strides=strides, elem_offset=T.int64())


def match_cache_pair(var_k_cache, var_v_cache, layout: str, n_kv_heads: int, head_dim: int,
                     dtype: str, k_storage: str = "", v_storage: str = ""):
    """Bind the per-layer K and V caches of a kernel signature (call inside a TVMScript
    function), each stored as its own ``k_storage`` / ``v_storage`` (``""``: ``dtype``, see
    :func:`match_storage_cache`). They share ``num_pages`` and ``page_size``; each has its own
    strides and offset. Returns ``(num_pages, page_size, k_cache, v_cache)``."""
    num_pages, page_size = T.int64(), T.int64()
    k_cache = match_storage_cache(var_k_cache, layout, num_pages, page_size, n_kv_heads,
                                  head_dim, dtype, k_storage)
    v_cache = match_storage_cache(var_v_cache, layout, num_pages, page_size, n_kv_heads,
                                  head_dim, dtype, v_storage)
    return num_pages, page_size, k_cache, v_cache


def match_err(handle):
    """``T.match_buffer`` of a kernel's error flag: int32 ``[ERR_SLOTS]`` (see
    :mod:`kvtvm.kernels.errflag`)."""
    return match_tensor(handle, (ERR_SLOTS,), "int32")


#: Binary-search steps of :func:`find_sequence`: enough for a batch of 2**16 sequences.
SEARCH_STEPS = 16


@T.macro
def find_sequence(qo_indptr, bounds, batch, row):
    """Set ``bounds[0]`` to the sequence of ragged row ``row``: the largest ``b`` with
    ``qo_indptr[b] <= row`` (binary search; ``bounds`` is a local int32 ``[2]`` buffer).
    Expands inside a TVMScript function."""
    bounds[0] = 0
    bounds[1] = T.Cast("int32", batch)
    for _ in range(SEARCH_STEPS + 1):
        if bounds[1] - bounds[0] > 1:
            if T.Cast("int64", qo_indptr[(bounds[0] + bounds[1]) // 2]) <= row:
                bounds[0] = (bounds[0] + bounds[1]) // 2
            else:
                bounds[1] = (bounds[0] + bounds[1]) // 2
