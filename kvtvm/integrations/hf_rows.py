"""Rows of a transformers batch as kvtvm sequences: left padding and beam reordering.

transformers runs ``generate`` on a rectangular batch ``[B, T]``; kvtvm keeps one sequence per
row holding only the row's real tokens. Two pieces map one onto the other for
:class:`kvtvm.integrations.hf.KVTVMCache`:

* :func:`step_rows` reads the 2-D ``attention_mask`` of a forward (``[B, past + T]``, what
  transformers hands the mask function) and says how many of the ``T`` new positions of each
  row are real tokens, and which flat positions of the ``[B * T]`` step they are. A row's new
  positions must end with a token or be pads before the row's first token (a chunk of its
  left padding under chunked prefill); pads before its last token (left padding, or pads
  between a chat's turns) are never appended, and the cache remembers where they are; right
  padding is refused (and, with a sliding window, pads after a row's first token).
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

__all__ = ["NEEDS_KVTVM_CACHE", "PaddingMask", "step_rows", "row_indices", "check_room", "regather",
           "copy_sequences"]

_LEFT_ONLY = "kvtvm supports left padding only (tokenizer(..., padding_side='left'))"

#: Why a forward on kvtvm attention without a KVTVMCache is refused.
NEEDS_KVTVM_CACHE = (
    "kvtvm attention needs a KVTVMCache: generate(..., cache=KVTVMCache(model, max_seq_len)) "
    "(past_key_values= in older code); use_cache=False, cache_implementation= and options "
    "that run the model on a cache of their own (guidance_scale) are not supported on kvtvm "
    "attention: model.set_attn_implementation('sdpa') for them")


class PaddingMask:
    """What the ``"kvtvm"`` mask function hands the attention: the forward's 2-D mask.

    ``mask``: bool ``[B, past + T]``, True at real tokens (transformers' ``attention_mask``).
    """

    __slots__ = ("mask",)

    def __init__(self, mask: torch.Tensor):
        self.mask = mask

    @property
    def ndim(self):
        """Never a tensor: transformers asks a mask it built ahead of a forward for its rank,
        which only happens for a cache of its own (``cache_implementation="static"``, a
        ``StaticCache``): refused as kvtvm attention refuses any forward without a
        KVTVMCache."""
        raise InvalidArgumentError(NEEDS_KVTVM_CACHE)


def step_rows(mask: torch.Tensor | None, past: int, token_mask: torch.Tensor | None,
              batch: int, new: int, sliding_window: int | None = None):
    """Real tokens of each row in one forward.

    Every forward's new positions of a row end with a token (1), or are all pads while the row
    holds no token yet (a chunk of its left padding under ``prefill_chunk_size``, a row of
    pads only: sdpa's output there is zero, as kvtvm's); pads (0) may come anywhere before a
    row's last token: left pads, or pads between a chat's turns (holes the cache remembers;
    the outputs at them, never read by generate, are zero). The rows'
    sequences hold only their real tokens; transformers numbers positions by counting tokens
    (``position_ids`` from the mask), so attention over the real tokens is exact. With a
    sliding window a pad may not follow a token of its row: transformers' window counts pad
    positions, kvtvm's counts tokens.

    Parameters
    ----------
    mask : bool Tensor ``[batch, past + new]`` or None
        The forward's 2-D attention mask (None: every new position is a real token).
    past : int
        Positions (pads included) the rows already hold.
    token_mask : bool Tensor ``[batch, past]`` or None
        Which held positions of each row are real tokens (None: all of them, or no rows).
    batch, new : int
        Rows, and new positions per row, of this forward.
    sliding_window : int or None
        The model's window (None: none); with one, pads after a row's first token are refused.

    Returns
    -------
    token_mask : bool Tensor ``[batch, past + new]`` or None
        Which positions are real after this forward (None: all of them).
    counts : int64 ndarray ``[batch]``
        Real new tokens of each row (0 for a row of left pads only).
    rows : int64 Tensor ``[sum(counts)]`` or None
        Flat indices into the ``[batch * new]`` positions of the real tokens, in order (None:
        every position is real).

    Raises
    ------
    InvalidArgumentError
        ``attention_mask`` is not a mask of this batch whose rows end with a token or hold
        left pads only (right padding, pads after a row's tokens, the wrong shape), its cached
        part is not
        ``token_mask``, or (with a sliding window) a pad follows a token of its row.
    """
    full = np.full(batch, new, dtype=np.int64)
    if mask is None:
        if token_mask is not None:
            token_mask = torch.cat([token_mask, token_mask.new_ones(batch, new)], dim=1)
        return token_mask, full, None
    if mask.ndim != 2 or tuple(mask.shape) != (batch, past + new):
        raise InvalidArgumentError(describe(
            "attention_mask", f"a 2-D mask of shape ({batch}, {past + new}) (rows, cached + new "
            "positions)", f"shape {tuple(mask.shape)}"))
    mask = mask.to(torch.bool)
    if past:
        cached = mask[:, :past]
        want = None if token_mask is None else token_mask.to(mask.device)
        if not (bool(cached.all()) if want is None else torch.equal(cached, want)):
            want = torch.ones_like(cached) if want is None else want
            b = int(torch.nonzero((cached != want).any(dim=1))[0, 0])
            raise InvalidArgumentError(describe(
                f"attention_mask row {b} (cached positions)",
                "the row's positions as the cache holds them (1: a token it holds, 0: a pad)",
                f"{cached[b].int().tolist()}, the cache holds {want[b].int().tolist()}"))
    fresh = mask[:, past:]
    if bool(fresh.all()):                               # the usual decode step: one sync
        if token_mask is not None:
            token_mask = torch.cat([token_mask.to(mask.device), fresh], dim=1)
        return token_mask, full, None
    where = "" if past == 0 else " (new positions)"
    # a row's new positions end with a token, or are pads while the row holds no token yet
    # (sdpa's output at a pad is zero only while nothing before it is a token: left pads)
    held = (token_mask.to(mask.device).any(dim=1) if token_mask is not None
            else torch.full((batch,), past > 0, device=mask.device))
    right = ~fresh[:, -1] & (fresh.any(dim=1) | held)  # tokens, then a pad: right padding
    if bool(right.any()):
        b = int(torch.nonzero(right)[0, 0])
        raise InvalidArgumentError(describe(
            f"attention_mask row {b}{where}", "a token (1) last: pads (0) only before the "
            f"row's tokens; {_LEFT_ONLY}; a hole inside the tokens is fine unless a forward "
            "ends in it (generate(prefill_chunk_size=n) whose chunk ends inside a hole: take "
            "an n that does not)", fresh[b].int().tolist()))
    if sliding_window is not None:
        seen = fresh.cummax(dim=1).values               # a token of the row at or before
        if past:
            seen = seen | (True if token_mask is None else
                           token_mask.to(mask.device).any(dim=1, keepdim=True))
        hole = (seen & ~fresh).any(dim=1)
        if bool(hole.any()):
            b = int(torch.nonzero(hole)[0, 0])
            raise InvalidArgumentError(describe(
                f"attention_mask row {b}{where}", f"no pad after a token of the row with a "
                f"sliding window ({sliding_window}): transformers counts pad positions in the "
                "window, kvtvm counts tokens", fresh[b].int().tolist()))
    counts = fresh.sum(dim=1).cpu().numpy().astype(np.int64)
    before = mask.new_ones(batch, past) if token_mask is None else token_mask.to(mask.device)
    return (torch.cat([before, fresh], dim=1), counts,
            torch.nonzero(fresh.reshape(-1)).squeeze(1))


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
    valid (:func:`row_indices`) and fits (:func:`check_room`, which the caller runs before it
    changes anything). The first new row taking an old sequence keeps it, the others get
    copies; old sequences no new row takes are released (before the copies claim slots).
    """
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
    one, a block copy committed as that many tokens; none while it holds none -- a row of
    pads only)."""
    if isinstance(mgr, PagedKVCacheManager):
        return mgr.fork(seq_id)
    from ..ops import copy_pages

    held = mgr.cache_length(seq_id)
    (new,) = mgr.claim(1)
    if not held:                    # nothing to copy (a fetch of no tokens is refused)
        return new
    item = [BatchItem(new, [0] * held)]
    mgr.fetch(item)
    # a continuous manager's sequence s owns block s for its whole life
    src = torch.tensor([seq_id], dtype=torch.int32)
    dst = torch.tensor([new], dtype=torch.int32)
    for blocks in mgr.blocks:
        copy_pages(blocks, src, dst)
    mgr.step(item)
    return new


def copy_sequences(src, seq_ids: list[int], dst) -> list[int]:
    """Sequences of ``dst`` (a manager of the same class and params as ``src``, with free
    slots) holding what ``src``'s settled sequences ``seq_ids`` hold: claimed, fetched for
    their lengths, their pages (a continuous manager: blocks) copied byte for byte on every
    device, and committed. Returns the new ids, in the order of ``seq_ids``."""
    new = list(dst.claim(len(seq_ids)))
    items = [BatchItem(n, [0] * src.cache_length(s)) for s, n in zip(seq_ids, new)]
    held = [(s, item) for s, item in zip(seq_ids, items) if item.tokens]
    if not held:
        return new
    dst.fetch([item for _, item in held])
    src_pages, dst_pages = [], []
    for s, item in held:
        if isinstance(src, PagedKVCacheManager):
            pages = dst.pages_of(item.seq_id)
            src_pages += src.pages_of(s)[:len(pages)]
            dst_pages += pages
        else:                       # a continuous manager's sequence s owns block s
            src_pages.append(s)
            dst_pages.append(item.seq_id)
    for a, b in zip(src.blocks, dst.blocks):
        b.index_copy_(0, torch.tensor(dst_pages, device=b.device),
                      a.index_select(0, torch.tensor(src_pages, device=a.device)))
    dst.step([item for _, item in held])
    return new
