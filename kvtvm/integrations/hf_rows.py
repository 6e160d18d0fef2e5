"""Rows of a transformers batch as kvtvm sequences: left padding and beam reordering.

transformers runs ``generate`` on a rectangular batch ``[B, T]``; kvtvm keeps one sequence per
row holding only the row's real tokens. Two pieces map one onto the other for
:class:`kvtvm.integrations.hf.KVTVMCache`:

* :func:`step_rows` reads the 2-D ``attention_mask`` of a forward (``[B, past + T]``, what
  transformers hands the mask function) and says how many of the ``T`` new positions of each
  row are real tokens, and which flat positions of the ``[B * T]`` step they are. Only left
  padding is expressible (the pads of a row come before its first token, in its first forward);
  right padding, holes, or pads after the first forward are refused.
* :func:`regather` turns the sequences held for the rows into those of new rows, ``new row i =
  old row src[i]`` (beam search's ``reorder_cache``, ``batch_select_indices``,
  ``batch_repeat_interleave``): the first row taking an old sequence keeps it, every further
  one gets a copy (a paged manager's ``fork``: pages shared, the partial last page copied on
  write; a continuous manager copies the block with :func:`kvtvm.ops.copy_pages`), and old
  sequences no row takes are released.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import InvalidArgumentError, KVCacheCapacityError, describe
from ..inputs import BatchItem
from ..manager import PagedKVCacheManager

__all__ = ["PaddingMask", "step_rows", "row_indices", "check_room", "regather"]

_LEFT_ONLY = "kvtvm supports left padding only (tokenizer(..., padding_side='left'))"


class PaddingMask:
    """What the ``"kvtvm"`` mask function hands the attention: the forward's 2-D mask.

    ``mask``: bool ``[B, past + T]``, True at real tokens (transformers' ``attention_mask``).
    """

    __slots__ = ("mask",)

    def __init__(self, mask: torch.Tensor):
        self.mask = mask


def step_rows(mask: torch.Tensor | None, past: int, pads: np.ndarray | None, batch: int,
              new: int):
    """Real tokens of each row in one forward.

    Parameters
    ----------
    mask : bool Tensor ``[batch, past + new]`` or None
        The forward's 2-D attention mask (None: every position is a real token).
    past : int
        Positions (pads included) the rows already hold.
    pads : int64 ndarray ``[batch]`` or None
        Left pads of each row held (None: no rows held yet; ``past`` is then 0).
    batch, new : int
        Rows, and new positions per row, of this forward.

    Returns
    -------
    pads : int64 ndarray ``[batch]``
        Left pads of each row after this forward.
    counts : int64 ndarray ``[batch]``
        Real new tokens of each row (at least 1).
    rows : int64 Tensor ``[sum(counts)]`` or None
        Flat indices into the ``[batch * new]`` positions of the real tokens, in order (None:
        every position is real).

    Raises
    ------
    InvalidArgumentError
        ``attention_mask`` is not a left-padded mask of this batch (right padding, a hole, a
        row without a token, pads after the first forward, or the wrong shape).
    """
    held = np.zeros(batch, dtype=np.int64) if pads is None else pads
    full = np.full(batch, new, dtype=np.int64)
    if mask is None:
        return held, full, None
    if mask.ndim != 2 or tuple(mask.shape) != (batch, past + new):
        raise InvalidArgumentError(describe(
            "attention_mask", f"a 2-D mask of shape ({batch}, {past + new}) (rows, cached + new "
            "positions)", f"shape {tuple(mask.shape)}"))
    mask = mask.to(torch.bool)
    fresh = mask[:, past:]
    if past == 0:
        step_up = fresh[:, :-1] & ~fresh[:, 1:]        # a real token followed by a pad
        bad = step_up.any(dim=1) | ~fresh[:, -1]
        if bool(bad.any()):
            b = int(torch.nonzero(bad)[0, 0])
            raise InvalidArgumentError(describe(
                f"attention_mask row {b}", "pads (0) only before the row's tokens (1), and at "
                f"least one token; {_LEFT_ONLY}", fresh[b].int().tolist()))
        counts = fresh.sum(dim=1).cpu().numpy().astype(np.int64)
        pads = new - counts
        if not pads.any():
            return pads, counts, None
        return pads, counts, torch.nonzero(fresh.reshape(-1)).squeeze(1)
    if not bool(fresh.all()):
        b = int(torch.nonzero(~fresh.all(dim=1))[0, 0])
        raise InvalidArgumentError(describe(
            f"attention_mask row {b} (new positions)", f"no pads after the first forward; "
            f"{_LEFT_ONLY}", fresh[b].int().tolist()))
    want = torch.arange(past, device=mask.device)[None, :] >= \
        torch.from_numpy(held).to(mask.device)[:, None]
    if not torch.equal(mask[:, :past], want):
        b = int(torch.nonzero((mask[:, :past] != want).any(dim=1))[0, 0])
        raise InvalidArgumentError(describe(
            f"attention_mask row {b} (cached positions)",
            f"the row's {int(held[b])} left pads then its tokens, as in its first forward",
            mask[b, :past].int().tolist()))
    return held, full, None


def row_indices(name: str, value, n_rows: int) -> list[int]:
    """``value`` (1-D ints: tensor, array or list) as a list of row indices in ``[0, n_rows)``.

    Raises
    ------
    InvalidArgumentError
        Naming ``name``: not 1-D integers, empty, or an index out of range.
    """
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise InvalidArgumentError(describe(f"{name} dtype", "integers", value.dtype))
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.ndim != 1 or arr.size == 0 or (arr.dtype.kind not in "iu"):
        raise InvalidArgumentError(describe(name, "a non-empty 1-D array of row indices",
                                            f"{arr.dtype} of shape {arr.shape}"))
    bad = (arr < 0) | (arr >= n_rows)
    if bad.any():
        raise InvalidArgumentError(describe(f"{name}[{int(np.argmax(bad))}]",
                                            f"a row in [0, {n_rows})", int(arr[bad][0])))
    return [int(i) for i in arr]


def _plan(n_rows: int, src: list[int]):
    """``(keep, copies, dropped)``: old row -> the new row taking its sequence; (new row, old
    row) pairs that get a copy; old rows no new row takes."""
    keep: dict[int, int] = {}
    copies: list[tuple[int, int]] = []
    for i, s in enumerate(src):
        if s in keep:
            copies.append((i, s))
        else:
            keep[s] = i
    return keep, copies, [r for r in range(n_rows) if r not in keep]


def check_room(mgr, n_rows: int, src: list[int]) -> None:
    """Raise :class:`KVCacheCapacityError` (naming ``max_batch_size``) when :func:`regather`
    of ``n_rows`` held rows into ``src`` needs more sequences than ``mgr`` has slots."""
    _, copies, dropped = _plan(n_rows, src)
    if len(copies) - len(dropped) > len(mgr.slots_remaining):
        raise KVCacheCapacityError(
            f"KVTVMCache: {len(src)} rows need {len(src)} sequences, more than the manager's "
            f"max_batch_size={mgr.max_batch_size} ({n_rows} held, "
            f"{len(mgr.slots_remaining)} free): build the cache with max_batch_size>="
            f"{len(src)}")


def regather(mgr, seq_ids: list[int], src: list[int]) -> list[int]:
    """The sequences of new rows ``i`` holding old row ``src[i]``'s tokens.

    ``seq_ids`` are the settled (no fetch in flight) sequences of the old rows; ``src`` is
    valid (:func:`row_indices`). The first new row taking an old sequence keeps it, the others
    get copies; old sequences no new row takes are released (before the copies claim slots).

    Raises
    ------
    KVCacheCapacityError
        The new rows need more sequences than ``mgr.max_batch_size`` (nothing changed).
    """
    check_room(mgr, len(seq_ids), src)
    keep, copies, dropped = _plan(len(seq_ids), src)
    for r in dropped:
        mgr.release(seq_ids[r])
    out = [0] * len(src)
    for s, i in keep.items():
        out[i] = seq_ids[s]
    for i, s in copies:
        out[i] = _copy_sequence(mgr, seq_ids[s])
    return out


def _copy_sequence(mgr, seq_id: int) -> int:
    """A new sequence holding ``seq_id``'s tokens (fork on a paged manager; on a continuous
    one, a block copy committed as that many tokens)."""
    if isinstance(mgr, PagedKVCacheManager):
        return mgr.fork(seq_id)
    from ..ops import copy_pages

    (new,) = mgr.claim(1)
    item = [BatchItem(new, [0] * mgr.cache_length(seq_id))]
    mgr.fetch(item)
    # a continuous manager's sequence s owns block s for its whole life
    src = torch.tensor([seq_id], dtype=torch.int32)
    dst = torch.tensor([new], dtype=torch.int32)
    for blocks in mgr.blocks:
        copy_pages(blocks, src, dst)
    mgr.step(item)
    return new
