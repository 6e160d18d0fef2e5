"""The DLPack boundary shared by every op: tensor conversion and typed argument checks.

Every op accepts torch tensors (CPU or CUDA) and, on the CPU, numpy arrays; nothing is copied:
numpy arrays are wrapped with ``torch.from_numpy`` and torch tensors go to the TVM function
through DLPack. Before any launch an op checks dtype, device, rank, shape, strides and (for
host-resident index tensors, or when ``check_indices=True``) index ranges, and raises one of
kvtvm's typed errors naming the argument, what was expected and what it got; nothing is
written when it raises. Launching lives in :mod:`kvtvm.ops.launch`.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import (DeviceMismatchError, DTypeMismatchError, InvalidArgumentError,
                      SequenceTooLongError, describe)
from ..collection import view_signature
from ..inputs import check_live, token_of
from ..compiler import LAYOUTS
from ..params import DTYPE_SIZES


# ------------------------------------------------------------------------------------------
# The DLPack boundary
# ------------------------------------------------------------------------------------------


#: Arguments an op may write in place (the caches: append; attention only reads them).
WRITTEN = frozenset({"k_cache", "v_cache", "out", "lse", "blocks", "cache"})


def as_tensor(name: str, value: Any, written: bool | None = None):
    """``value`` as a torch tensor sharing its memory (the one DLPack boundary of kvtvm).

    Accepts a strided ``torch.Tensor`` or a numpy array (including ``ml_dtypes.bfloat16``);
    anything else raises :class:`InvalidArgumentError`. ``written`` (default: ``name`` in
    :data:`WRITTEN`): the op writes it in place, so a read-only array, or a tensor that
    requires grad (autograd would not see the write), is refused. A tensor carrying torch's
    lazy negation bit is refused too: the kernels read and write its memory as it is.
    """
    import torch

    if written is None:
        written = name in WRITTEN
    if isinstance(value, torch.Tensor):
        if value.layout is not torch.strided or value.is_nested:
            raise InvalidArgumentError(describe(name, "a strided tensor",
                                                "a nested tensor" if value.is_nested
                                                else f"layout {value.layout}"))
        if value.is_neg():  # (torch's own DLPack export resolves it; tvm_ffi's does not)
            raise InvalidArgumentError(describe(
                name, "a tensor without torch's lazy negation bit (.resolve_neg() first)",
                "a negated view"))
        if written and value.requires_grad:
            raise InvalidArgumentError(describe(
                name, "a tensor that does not require grad (kvtvm writes it in place, "
                "unseen by autograd: pass a detached tensor)", "requires_grad=True"))
        return value
    if isinstance(value, np.ndarray):
        if written and not value.flags.writeable:
            raise InvalidArgumentError(describe(name, "a writable array (kvtvm writes it in "
                                                "place)", "a read-only array"))
        if any(s < 0 for s in value.strides):
            raise InvalidArgumentError(describe(name, "an array with non-negative strides",
                                                f"strides {list(value.strides)}"))
        if not value.dtype.isnative:  # torch.from_numpy would raise a bare ValueError
            raise DTypeMismatchError(describe(name, "an array of native byte order",
                                              value.dtype.str))
        if value.dtype.name == "bfloat16":
            return torch.from_numpy(value.view(np.uint16)).view(torch.bfloat16)
        try:
            if not value.flags.writeable:  # read only here (torch warns it cannot mark it so)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    return torch.from_numpy(value)
            return torch.from_numpy(value)
        except TypeError:
            raise DTypeMismatchError(describe(name, "a supported dtype",
                                              value.dtype)) from None
        except ValueError:  # (a structured array's field: strides not whole items)
            raise InvalidArgumentError(describe(
                name, "an array whose strides are whole items",
                f"strides {list(value.strides)} of {value.dtype.itemsize}-byte items")) from None
    raise InvalidArgumentError(describe(name, "a torch.Tensor or numpy.ndarray",
                                        type(value).__name__))


_DTYPE_NAMES: dict = {}  # torch.dtype -> "float16", ...: str() of a dtype costs a microsecond


def _dtype(t) -> str:
    dt = t.dtype
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = _DTYPE_NAMES[dt] = str(dt).replace("torch.", "")
    return name


def check_dtype(name: str, t, expected) -> None:
    expected = (expected,) if isinstance(expected, str) else tuple(expected)
    if _dtype(t) not in expected:
        raise DTypeMismatchError(describe(name, " or ".join(expected), _dtype(t)))


def check_rank(name: str, t, rank: int, meaning: str) -> None:
    if t.dim() != rank:
        raise InvalidArgumentError(describe(name, f"rank {rank} {meaning}",
                                            f"shape {list(t.shape)}"))


def check_dim(name: str, t, axis: int, expected: int, meaning: str) -> None:
    if t.shape[axis] != expected:
        raise InvalidArgumentError(describe(f"{name}.shape[{axis}] ({meaning})", expected,
                                            f"{t.shape[axis]} (shape {list(t.shape)})"))


def check_contiguous(name: str, t) -> None:
    if not t.is_contiguous():
        raise InvalidArgumentError(describe(name, "a contiguous tensor",
                                            f"strides {list(t.stride())}"))


def check_vector_aligned(tensors: dict, nbytes: int = 16, strides: bool = True) -> None:
    """Each tensor's data pointer and (``strides``) every byte stride but the innermost are
    multiples of ``nbytes`` (CUDA kernels move rows in ``nbytes`` vectors). ``strides=False``
    for contiguous rows moved in vectors that divide a row: the pointer alone decides."""
    for name, t in tensors.items():
        esize = t.element_size()
        bad = [st * esize for st in t.stride()[:-1] if (st * esize) % nbytes] if strides else []
        if t.data_ptr() % nbytes or bad:
            raise InvalidArgumentError(describe(
                name, f"{nbytes}-byte aligned rows on CUDA (data pointer and strides)",
                f"pointer % {nbytes} = {t.data_ptr() % nbytes}, byte strides {bad}"))


def common_device(tensors: dict):
    """The one device every tensor of a call lives on; raises when they differ, or when it is
    neither the CPU nor a CUDA GPU (e.g. ``meta``: no kernel runs there)."""
    first_name, first = next(iter(tensors.items()))
    device = first.device
    for name, t in tensors.items():
        if t.device != device:
            raise DeviceMismatchError(describe(name, f"device {device} (as {first_name})",
                                               t.device))
    if device.type not in ("cpu", "cuda"):
        raise DeviceMismatchError(describe(first_name, "a tensor on cpu or cuda", device))
    return device


def host_array(t) -> np.ndarray:
    """A host numpy copy (or view) of a tensor's values, for index checks."""
    return t.detach().cpu().numpy()


# ------------------------------------------------------------------------------------------
# Shared checks of the paged-cache arguments
# ------------------------------------------------------------------------------------------


@dataclass
class CacheGeometry:
    num_pages: int
    page_size: int
    n_kv_heads: int
    head_dim: int
    dtype: str


def check_cache_pair(k_cache, v_cache, layout: str) -> CacheGeometry:
    """Validate per-layer K and V caches of ``layout``; returns their geometry."""
    if layout not in LAYOUTS:
        raise InvalidArgumentError(describe("layout", LAYOUTS, repr(layout)))
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_rank(name, t, 4, "[num_pages, page_size, n_kv_heads, head_dim]" if layout == "nhd"
                   else "[num_pages, n_kv_heads, page_size, head_dim]")
        check_dtype(name, t, tuple(DTYPE_SIZES))
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise InvalidArgumentError(describe(f"{name}.stride(-1)", 1, t.stride(-1)))
    check_dtype("v_cache", v_cache, _dtype(k_cache))
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise InvalidArgumentError(describe("v_cache.shape", list(k_cache.shape),
                                            list(v_cache.shape)))
    num_pages, a, b, head_dim = k_cache.shape
    page_size, heads = (a, b) if layout == "nhd" else (b, a)
    return checked_geometry(CacheGeometry(num_pages, page_size, heads, head_dim,
                                          _dtype(k_cache)), k_cache, layout)


def checked_geometry(geo: CacheGeometry, k_cache, layout: str) -> CacheGeometry:
    """``geo`` after checking that ``page_size``, ``n_kv_heads`` and ``head_dim`` are at
    least 1 (an empty axis holds no token or head; an empty head_dim has no score scale)."""
    axes = {"page_size": 1 if layout == "nhd" else 2, "n_kv_heads": 2 if layout == "nhd" else 1}
    for what, value, axis in (("page_size", geo.page_size, axes["page_size"]),
                              ("n_kv_heads", geo.n_kv_heads, axes["n_kv_heads"]),
                              ("head_dim", geo.head_dim, 3)):
        if value < 1:
            raise InvalidArgumentError(describe(f"k_cache.shape[{axis}] ({what})", ">= 1",
                                                f"{value} (shape {list(k_cache.shape)})"))
    return geo


def check_batch_tables(qo_indptr, cache_lengths, lookup_table, rows: str | None = None,
                       num_rows: int = 0):
    """Validate dtypes and shapes of the per-batch tables; returns the batch size. ``rows``
    names the ragged rows' tensor (``num_rows`` of them): rows with an empty batch are refused
    whatever ``check_indices`` says (no sequence could own them; a kernel would look one up)."""
    for name, t in (("qo_indptr", qo_indptr), ("cache_lengths", cache_lengths),
                    ("lookup_table", lookup_table)):
        check_dtype(name, t, "int32")
        check_contiguous(name, t)
    check_rank("cache_lengths", cache_lengths, 1, "[batch]")
    batch = cache_lengths.shape[0]
    check_rank("qo_indptr", qo_indptr, 1, "[batch + 1]")
    check_dim("qo_indptr", qo_indptr, 0, batch + 1, "batch + 1")
    check_rank("lookup_table", lookup_table, 2, "[batch, max_pages_per_seq]")
    check_dim("lookup_table", lookup_table, 0, batch, "batch")
    if batch == 0 and num_rows:
        raise InvalidArgumentError(describe(
            "cache_lengths.shape[0] (batch)", f"at least 1: {rows} holds {num_rows} rows", 0))
    return batch


def check_batch_indices(qo_indptr, cache_lengths, lookup_table, geometry: CacheGeometry,
                        num_tokens: int | None, extra_tokens=None, rows: str = "k") -> None:
    """Check index ranges on the host: ``qo_indptr`` runs from 0 to ``num_tokens`` (the rows
    of argument ``rows``) without decreasing, no length is negative, every sequence's final
    length fits the pages its lookup-table row holds (the row's width; for a manager's table,
    the pages its fetch gave the sequence: past them a PAGED row is padded with 0, another
    sequence's page), and every page of the row up to that length is in ``[0, num_pages)`` --
    with a sliding window too, where the kernels skip the pages before it."""
    indptr = host_array(qo_indptr).astype(np.int64)
    lengths = host_array(cache_lengths).astype(np.int64)
    table = host_array(lookup_table)
    if indptr.size and indptr[0] != 0:
        raise InvalidArgumentError(describe("qo_indptr[0]", 0, int(indptr[0])))
    steps = np.diff(indptr)
    if (steps < 0).any():
        b = int(np.argmax(steps < 0))
        raise InvalidArgumentError(describe(f"qo_indptr[{b}:{b + 2}]", "non-decreasing",
                                            indptr[b:b + 2].tolist()))
    if num_tokens is not None and indptr.size and indptr[-1] != num_tokens:
        raise InvalidArgumentError(describe("qo_indptr[-1]", f"{num_tokens} (rows of {rows})",
                                            int(indptr[-1])))
    if (lengths < 0).any():
        b = int(np.argmax(lengths < 0))
        raise InvalidArgumentError(describe(f"cache_lengths[{b}]", ">= 0", int(lengths[b])))
    final = lengths + (steps if extra_tokens is None else extra_tokens)
    capacity = table.shape[1] * geometry.page_size
    if (final > capacity).any():
        b = int(np.argmax(final > capacity))
        raise SequenceTooLongError(describe(
            f"cache_lengths[{b}] + new tokens", f"<= {capacity} (lookup_table holds "
            f"{table.shape[1]} pages of {geometry.page_size})", int(final[b])))
    token = token_of(lookup_table)
    held = getattr(token, "capacity", None)
    if held is not None and len(held) == len(final) and (final > held).any():
        # the tables may be another fetch's by now (threads that do not serialise): judge
        # them under the manager's lock, while they are this fetch's, or report them stale
        with token.lock or contextlib.nullcontext():
            check_live("lookup_table", token)
            final = host_array(cache_lengths).astype(np.int64) + (
                steps if extra_tokens is None else extra_tokens)
        if (final > held).any():
            b = int(np.argmax(final > held))
            n = int(held[b]) // geometry.page_size
            raise InvalidArgumentError(describe(
                f"cache_lengths[{b}] + new tokens", f"<= {int(held[b])} (the fetch gave row {b} "
                f"{n} page{'' if n == 1 else 's'} of lookup_table; past them the row is "
                "padding)", int(final[b])))
    pages_used = -(-final // geometry.page_size)
    used = np.arange(table.shape[1])[None, :] < pages_used[:, None]
    bad = used & ((table < 0) | (table >= geometry.num_pages))
    if bad.any():
        b, i = (int(x) for x in np.argwhere(bad)[0])
        raise InvalidArgumentError(describe(f"lookup_table[{b}, {i}]",
                                            f"a page in [0, {geometry.num_pages})",
                                            int(table[b, i])))


def indices_on_host(*tensors) -> bool:
    """True when every index tensor is in host memory (checking them costs no sync)."""
    return all(t.device.type == "cpu" for t in tensors)


def live_tokens(tensors: dict, caches: dict | None = None) -> tuple:
    """The fetch tokens stamped on the given table tensors (name -> tensor), after checking
    that none is dead: raises :class:`~kvtvm.errors.StaleInputsError` naming the tensor.

    Tables of two fetches, or ``caches`` (name -> cache view) outside the cache of the
    manager whose fetch made the tables, raise :class:`~kvtvm.errors.InvalidArgumentError`
    (the kernel would write another manager's memory at this fetch's positions). The layout
    is :func:`check_fetch_layout`'s, checked before the shapes."""
    tokens = ()
    for name, t in tensors.items():
        tok = token_of(t)
        if tok is not None:
            check_live(name, tok)
            if tok not in tokens:
                tokens += (tok,)
    if len(tokens) > 1:
        raise InvalidArgumentError(describe(
            " / ".join(tensors), "the tables of one fetch", f"tables of {len(tokens)} fetches"))
    if tokens and caches:
        check_cache_owner(tokens[0], caches)
    return tokens


def check_fetch_layout(layout: str, *tables) -> None:
    """InvalidArgumentError naming ``layout`` when it is not one of :data:`LAYOUTS`, or when
    a fetch's table among ``tables`` says the fetch's cache views have the
    other layout. Checked before the shapes: an ``"nhd"`` call on a linear cache's ``"hnd"``
    views otherwise failed on ``n_kv_heads`` (the axes it swaps), never naming ``layout``."""
    if layout not in LAYOUTS:
        raise InvalidArgumentError(describe("layout", LAYOUTS, repr(layout)))
    for t in tables:
        tok = token_of(t)
        if tok is not None and tok.layout not in (None, layout):
            raise InvalidArgumentError(describe(
                "layout", f"{tok.layout!r} (the layout of the fetch's cache views)",
                repr(layout)))


#: The side of the cache each cache argument must be (0: K, 1: V).
CACHE_ARGS = ("k_cache", "v_cache")
_SIDE = {name: side for side, name in enumerate(CACHE_ARGS)}


def check_cache_owner(token, caches: dict, kernel_args=()) -> None:
    """Each cache view (name -> tensor) is one of the per-layer views of the manager that made
    ``token``'s fetch -- ``k_cache`` a K view, ``v_cache`` a V view, both of one layer, of the
    view's dtype, K and V of one device's head shard -- else InvalidArgumentError naming it
    (another manager's cache, a copy, a shifted slice, K and V swapped or of two layers or
    shards, another dtype: the kernel would write or read other positions or heads, or read
    the bytes as another type). ``kernel_args``: names of
    tensors a prepared launch holds, where a float8 cache is its int8 view."""
    if not token.views:
        return
    found = {}
    for name, t in caches.items():
        where = token.views.get(view_signature(t))
        if where is None:
            raise InvalidArgumentError(describe(
                name, "a per-layer view of the cache of the manager whose fetch made the "
                "tables (k_cache(layer) / v_cache(layer))",
                "other memory or another view of it (another manager's cache, a copy, a "
                "slice)"))
        layer, side, dtype, shard = where
        if _SIDE.get(name, side) != side:
            raise InvalidArgumentError(describe(
                name, f"a {'KV'[_SIDE[name]]} view", f"layer {layer}'s {'KV'[side]} view"))
        if t.dtype != dtype and not (name in kernel_args and str(t.dtype) == "torch.int8"
                                     and str(dtype) == "torch.float8_e4m3fn"):
            raise InvalidArgumentError(describe(
                name, f"the cache's {str(dtype).removeprefix('torch.')} view",
                f"a {str(t.dtype).removeprefix('torch.')} view of it"))
        found[name] = layer, shard
    if len({layer for layer, _ in found.values()}) > 1:
        raise InvalidArgumentError(describe(
            " / ".join(found), "views of one layer",
            ", ".join(f"{n} of layer {layer}" for n, (layer, _) in found.items())))
    if len({shard for _, shard in found.values()}) > 1:  # heads split over devices
        raise InvalidArgumentError(describe(
            " / ".join(found), "views of one device's head shard (inputs[d].k_cache(layer) "
            "with inputs[d].v_cache(layer))",
            ", ".join(f"{n} of device {shard}" for n, (_, shard) in found.items())))


# ------------------------------------------------------------------------------------------
# Scalar arguments of the attention ops (one rule for decode, prefill and the plans)
# ------------------------------------------------------------------------------------------

#: Largest value of an int32 kernel parameter (sliding_window is one).
INT32_MAX = 2**31 - 1


def _is_bool(value) -> bool:
    return isinstance(value, (bool, np.bool_))


#: The largest finite float32 (``sm_scale`` is a float32 kernel parameter: 1e39 became inf).
FLOAT32_MAX = 3.4028234663852886e38
#: The largest ``|sm_scale|``: the kernels scale scores by ``sm_scale * log2(e)`` in float32
#: (the softmax runs in base 2), which past this is inf: prefill gave NaN for scores of a few
#: hundred at sm_scale 2.4e38.
SM_SCALE_MAX = FLOAT32_MAX / math.log2(math.e)


def check_sm_scale(sm_scale) -> float | None:
    """``sm_scale`` as a float: None, or a real number with ``sm_scale * log2(e)`` finite in
    float32 (int, float, numpy scalar; not a bool, a string or a tensor)."""
    if sm_scale is None:
        return None
    try:
        finite = abs(float(sm_scale)) <= SM_SCALE_MAX
    except (TypeError, ValueError, OverflowError):  # (an int of 400 digits, a string)
        finite = False
    if _is_bool(sm_scale) or not isinstance(sm_scale, numbers.Real) or not finite:
        raise InvalidArgumentError(describe(
            "sm_scale", "a float whose product with log2(e) is finite in float32 (at most "
            f"{SM_SCALE_MAX:.4g} in magnitude)", repr(sm_scale)))
    return float(sm_scale)


def check_sliding_window(sliding_window) -> int | None:
    """``sliding_window`` as an int: None, or an integer in ``[1, 2**31)`` (the kernels take an
    int32; a larger window would wrap around to a small one)."""
    if sliding_window is None:
        return None
    if _is_bool(sliding_window) or not isinstance(sliding_window, numbers.Integral) \
            or not 1 <= int(sliding_window) <= INT32_MAX:
        raise InvalidArgumentError(describe("sliding_window",
                                            "None or an int in [1, 2**31 - 1]",
                                            repr(sliding_window)))
    return int(sliding_window)


def check_causal(causal) -> bool:
    """``causal`` as a bool: a bool, a numpy bool, or the int 0 / 1."""
    if _is_bool(causal) or (isinstance(causal, numbers.Integral) and int(causal) in (0, 1)):
        return bool(causal)
    raise InvalidArgumentError(describe("causal", "a bool", repr(causal)))


def check_flag(name: str, value) -> bool | None:
    """An optional bool argument (``check_indices``): None, a bool or a numpy bool."""
    if value is None or _is_bool(value):
        return None if value is None else bool(value)
    raise InvalidArgumentError(describe(name, "None, True or False", repr(value)))


def sync_checked_call(device, check_indices: bool) -> None:
    """A checked call on a GPU first reports what earlier unchecked launches skipped
    (:func:`kvtvm.ops.errflag.check`; the host checks synchronize anyway)."""
    if check_indices and device.type == "cuda":
        from .errflag import check

        check(device)


def _span(t):
    """Byte addresses ``(first, end)`` from a tensor's first element to past its last (strides
    are never negative in torch): a strided cache view's, not its whole storage's (a cache and
    its tables in one arena were refused)."""
    start = t.data_ptr()
    if t.is_contiguous() or t.numel() == 0:
        return start, start + t.nbytes
    last = 0
    for n, st in zip(t.shape, t.stride()):
        last += (n - 1) * st
    return start, start + (last + 1) * t.element_size()


def pages_apart(a, b) -> int:
    """How many pages (axis 0) view ``b`` lies past view ``a`` of the same layout, when that is
    a whole non-zero number (transformers' paged K and V, one page apart); else 0."""
    if a.dim() == 0 or a.shape[0] < 2 or a.stride(0) <= 0 or a.shape != b.shape \
            or a.stride() != b.stride() or a.element_size() != b.element_size():
        return 0
    step = a.stride(0) * a.element_size()
    shift = b.data_ptr() - a.data_ptr()
    return shift // step if shift and shift % step == 0 else 0


def check_pages_kept_apart(table, apart: int) -> None:
    """K and V page arrays ``apart`` pages apart in one buffer (:func:`pages_apart`): K's page
    ``p`` is V's page ``p - apart``, so a table naming both would have V written over K."""
    pages = np.unique(host_array(table))
    pages = pages[pages >= 0]
    hit = np.intersect1d(pages, pages + apart)
    if hit.size:
        raise InvalidArgumentError(describe(
            "lookup_table", f"pages that keep K and V apart (v_cache starts {apart} pages into "
            f"k_cache: K's page p is V's page p - {apart})",
            f"pages {int(hit[0])} and {int(hit[0]) - apart}"))


def _elements_meet(a, b) -> bool:
    """Whether two views of one layout (shape, strides, item size) share a byte of their
    elements -- not merely of their storage: K and V of a layer are interleaved views of one
    cache, disjoint element by element. The byte offset between them is matched against the
    differences of element offsets, axis by axis from the largest stride; for views whose axes
    each step past everything the smaller ones span (:func:`check_no_self_overlap`), at most two
    multiples of each stride can take part, so this is exact in at most ``2 ** rank`` steps.
    Views of different layouts meet when their data pointers are equal; views a whole number
    of pages apart (axis 0) do not: transformers' paged K and V are page arrays of one buffer
    one page apart, whose page tables keep the two sides on different pages."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    size = a.element_size()
    if a.shape != b.shape or a.stride() != b.stride() or b.element_size() != size:
        return a.data_ptr() == b.data_ptr()
    if pages_apart(a, b):
        return False
    axes = sorted(((st * size, n) for st, n in zip(a.stride(), a.shape) if n > 1),
                  reverse=True)

    def reach(k: int, rest: int) -> bool:
        if k == len(axes):
            return -size < rest < size
        step, n = axes[k]
        first = rest // step
        return any(reach(k + 1, rest - m * step) for m in (first, first + 1) if -n < m < n)

    return reach(0, b.data_ptr() - a.data_ptr())


def check_no_alias(written: dict, read: dict, kv_owned: bool = False) -> None:
    """Refuse a written tensor sharing memory with any other argument of the call -- the
    int32 tables included (all on one device: :func:`common_device` first).

    Byte spans (first to last element) are compared, except between the K and V caches, which
    are interleaved views of one cache tensor (or, transformers' paged views, page arrays one
    page apart in one buffer whose page tables interleave them): those alias when their
    elements meet (:func:`_elements_meet`) -- unless ``kv_owned``: the caller found them a
    manager's own K and V views of one layer (:func:`check_cache_owner`), disjoint by make.
    """
    spans = [(n, _span(t)) for n, t in written.items()]
    spans += [(n, _span(t)) for n, t in read.items()]
    for wn, (w0, w1) in spans[:len(written)]:
        for on, (o0, o1) in spans:
            if on == wn:
                continue
            if wn in CACHE_ARGS and on in CACHE_ARGS:
                overlap = not kv_owned and _elements_meet(written[wn], written[on])
            else:
                overlap = w0 < o1 and o0 < w1
            if overlap:
                raise InvalidArgumentError(describe(f"{wn} and {on}", "separate memory",
                                                    "tensors sharing memory"))


def check_no_self_overlap(name: str, t) -> None:
    """Refuse a tensor the op writes whose elements share memory with each other (an
    ``expand``-ed or ``as_strided`` view: a write to one page would land in others). Sorted by
    stride, each axis must step past everything the smaller axes span -- true of every cache
    view a manager hands out, padded rows included."""
    strides, shape = t.stride(), t.shape
    span = 1
    for stride, size in zip(reversed(strides), reversed(shape)):  # the usual order: no sort
        if size > 1:
            if stride < span:
                break
            span += stride * (size - 1)
    else:
        return
    span = 1
    for stride, size in sorted((st, n) for st, n in zip(strides, shape) if n > 1):
        if stride < span:
            raise InvalidArgumentError(describe(
                f"{name}.stride()", "strides of non-overlapping elements (kvtvm writes it)",
                f"{list(strides)} for shape {list(shape)}"))
        span += stride * (size - 1)
