"""The page copier a manager is handed: the one kernel call a manager needs, from above.

Managers never import kernels. The paged manager copies a page on copy-on-write (``fork``)
and :class:`~kvtvm.manager.LinearKVCache` moves batch slots on ``evict``; each calls a
*copier* it was given at construction (``page_copier=`` / ``slot_copier=``). A manager
constructed without one uses the default registered here by the package root
(:mod:`kvtvm`), which binds :func:`kvtvm.ops.copy_pages` / :func:`kvtvm.ops.copy_slots` and
imports the ops only when a copy first happens. This module imports only :mod:`kvtvm.errors`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, runtime_checkable

from ..errors import InvalidArgumentError, describe

__all__ = ["PageCopier", "set_default_copiers", "default_page_copier",
           "default_slot_copier", "resolve_copier", "copy_view"]


@runtime_checkable
class PageCopier(Protocol):
    """Copies whole rows (pages, blocks or batch slots) of a cache tensor in place.

    Called as ``copier(blocks, src, dst)``:

    blocks : torch.Tensor
        One device's cache tensor. For a page copier axis 0 is the page
        (``[num_pages, 2, num_layers, page_size, n_kv_heads, head_dim]``); for a slot copier
        the LINEAR tensor ``[num_layers, max_batch_size, 2, n_kv_heads, max_seq_len,
        head_dim]``, whose axis 1 is the slot.
    src, dst : torch.Tensor
        int32 ``[n]`` on the host. Sequential semantics: copy ``i`` sees the result of copies
        ``0 .. i-1`` (as :func:`kvtvm.ops.copy_pages`).

    It returns nothing and raises before writing anything on bad input.
    """

    def __call__(self, blocks: Any, src: Any, dst: Any) -> None: ...


_defaults: dict[str, Optional[Callable]] = {"page": None, "slot": None}


def set_default_copiers(page: Optional[Callable] = None,
                        slot: Optional[Callable] = None) -> None:
    """Register the copiers managers use when constructed without one.

    Parameters
    ----------
    page : PageCopier, optional
        Copies pages (axis 0); used by ``fork``'s copy-on-write.
    slot : PageCopier, optional
        Copies LINEAR batch slots (axis 1); used by ``LinearKVCache.evict``.

    A ``None`` argument leaves that default as it is. :mod:`kvtvm` registers the kernel-backed
    copiers when it is imported.
    """
    for kind, fn in (("page", page), ("slot", slot)):
        if fn is not None:
            if not callable(fn):
                raise InvalidArgumentError(describe(f"set_default_copiers: {kind}",
                                                    "a callable (blocks, src, dst) -> None",
                                                    type(fn).__name__))
            _defaults[kind] = fn


def default_page_copier() -> Optional[Callable]:
    """The registered default page copier (None if none is registered)."""
    return _defaults["page"]


def default_slot_copier() -> Optional[Callable]:
    """The registered default slot copier (None if none is registered)."""
    return _defaults["slot"]


def resolve_copier(copier: Optional[Callable], kind: str, what: str) -> Optional[Callable]:
    """``copier`` if given (it must be callable), else the registered default of ``kind``
    (``"page"`` or ``"slot"``); ``what`` names the argument in the error."""
    if copier is None:
        return _defaults[kind]
    if not callable(copier):
        raise InvalidArgumentError(describe(what, "a callable (blocks, src, dst) -> None",
                                            type(copier).__name__))
    return copier


def copy_view(cache, axis: int):
    """The tensor a copier is handed for ``cache``: ``cache`` itself, or for a quantized
    cache (a uint8 byte tensor, :mod:`kvtvm.params`) a float32 view ``[units, 1, 1, 1,
    unit_bytes // 16, 4]`` of the same bytes (``axis=1``, LINEAR: ``[1, units, 1, 1, ..., 4]``),
    so one float32 copy kernel moves 16-byte words of any format bit for bit."""
    import torch

    if cache.dtype != torch.uint8:
        return cache
    words = cache.view(torch.float32)
    if axis == 1:
        return words.view(1, cache.shape[1], 1, 1, -1, 4)
    return words.view(cache.shape[0], 1, 1, 1, -1, 4)
