"""The host tier under the paged manager's prefix cache: a bounded pool of pages in host memory
(pinned when the cache lives on CUDA), LRU, moved in batches (see :mod:`.tiers`).

Batches. :meth:`HostTier.put_many` stores the pages one eviction demotes together: it plans
the slots first (LRU bookkeeping exactly as page-by-page puts would do it), asks the manager
for the pages' rows once (one gather on the device: a view when the pages are consecutive),
and copies them straight into the pool's slots (one copy per run of consecutive slots: slots
are handed out in the pages' order, so a run of pages lands in a run of slots).
:meth:`HostTier.read` gives the rows of several slots on a device with one copy per run (a
view of the pool on the host when the slots are one run).

CUDA. Copies between the device and the pinned pool are asynchronous, queued on the current
stream of the device (where every manager page copy and kvtvm op runs, so the device pages a
demotion reads are rewritten, and the staging rows a promotion writes are read, only after
the copy). A CUDA event is recorded after each such copy; :meth:`HostTier.wait` blocks on
them before the host reads or writes the pool (the disk tier's copy, :meth:`HostTier.get`,
a host-side write), and a copy queued on another stream first waits for them on the GPU.

Failures. Nothing changes if the gather fails. If the copy into the pool fails, the entries
whose slots it was overwriting (entries leaving to make room) are dropped; no entry ever
serves partial bytes, and every other entry stays.
"""

from __future__ import annotations

from collections import OrderedDict

from .args import allocate
from .pagelayout import page_runs as runs

__all__ = ["HostTier", "counters"]


def counters(capacity, unit) -> dict:
    """A tier's counters (``stats()``), all zero."""
    return {"capacity": capacity, "unit": unit, "entries": 0, "bytes": 0, "hits": 0,
            "misses": 0, "demotions": 0, "promotions": 0, "rejected": 0, "evictions": 0}


class HostTier:
    """At most ``capacity`` pages in host memory, LRU.

    Parameters
    ----------
    capacity : int
        Pages held (a pool ``[capacity, *page_shape]`` -- ``[2, num_layers, page_size,
        n_kv_heads, head_dim]``, or ``[page_bytes]`` uint8 for a quantized cache -- is
        allocated now when ``page_shape`` is given, else on the first demotion).
    pin_memory : bool
        Pin the pool (for a CUDA cache: asynchronous copies at full bandwidth).
    page_shape : tuple of int, optional
        Shape of one page; with ``dtype`` (a torch dtype name), the pool is allocated at once,
        so a pool too big for the host is a :class:`KVCacheCapacityError` here.
    """

    def __init__(self, capacity: int, pin_memory: bool = False, page_shape=None, dtype=None):
        self.capacity, self.pin_memory = int(capacity), bool(pin_memory)
        self._pool = None
        if page_shape is not None:  # allocated now: too big a pool fails here, not in a fetch
            import torch

            self._pool = allocate("attach_tiers: host_pages", (self.capacity, *page_shape),
                                  getattr(torch, dtype), "cpu", pin_memory=self.pin_memory,
                                  zero=False)
        self._slots: list[int] = list(range(self.capacity - 1, -1, -1))  # pop() -> lowest
        self._index: OrderedDict[int, tuple] = OrderedDict()  # hash -> (slot, tokens, fp)
        self._held: set[int] = set()  # slots a promotion is reading: never given away
        self._events: list = []  # (stream, event) after asynchronous copies of the pool
        self.counters = counters(self.capacity, "pages")

    def __contains__(self, h: int) -> bool:
        return h in self._index

    # -- CUDA ordering ------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until the asynchronous copies into and out of the pool are done."""
        for _, ev in self._events:
            ev.synchronize()
        self._events.clear()

    def _order(self, rows) -> bool:
        """Before a copy between the pool and ``rows``: True if it may be asynchronous (rows
        on CUDA, pool pinned; the copies of other streams are waited for on the GPU);
        otherwise the host waits for every asynchronous copy first."""
        if rows.device.type != "cuda" or not self.pin_memory:
            self.wait()
            return False
        import torch

        stream = torch.cuda.current_stream(rows.device)
        for s, ev in self._events:
            if s != stream:
                stream.wait_event(ev)
        return True

    def _record(self, device) -> None:
        import torch

        stream = torch.cuda.current_stream(device)
        ev = torch.cuda.Event()
        ev.record(stream)
        self._events = [(s, e) for s, e in self._events if s != stream] + [(stream, ev)]

    # -- demotion -----------------------------------------------------------------------------
    def _plan(self, items) -> tuple:
        """The LRU bookkeeping of putting ``items`` one after the other, without changing
        anything (an overlay on the index: O(items), whatever the tier's size): (hashes
        leaving the index, entries joining it in LRU order, free slots used, {item position:
        slot} of the pages that stay, pages stored, evictions)."""
        index, held, free = self._index, self._held, self._slots
        removed, added = set(), OrderedDict()
        oldest = iter(index.items())  # victims: the original entries first, oldest first
        placed, owner, used, stored, evictions = {}, {}, 0, 0, 0
        for i, (h, fp, toks, _page) in enumerate(items):
            old = added.get(h)
            if old is None and h in index and h not in removed:
                old = index[h]
            if old is not None and old[0] in held:
                evictions += 1  # a promotion reads that entry's slot: this page is not kept
                continue
            if old is not None:  # the same hash again: this page replaces it, in its slot
                slot = old[0]
                if added.pop(h, None) is None:
                    removed.add(h)
            elif used < len(free):
                slot = free[len(free) - 1 - used]
                used += 1
            else:  # the least recently used entry that no promotion reads leaves
                victim = next(((k, v) for k, v in oldest if k not in removed
                               and v[0] not in held), None)
                if victim is not None:
                    removed.add(victim[0])
                elif added:
                    victim = added.popitem(last=False)
                else:  # every entry is being promoted: this page is not kept
                    evictions += 1
                    continue
                slot = victim[1][0]
                evictions += 1
            if slot in owner:  # an earlier page of this batch left (replaced or evicted)
                placed.pop(owner[slot], None)
            owner[slot], placed[i] = i, slot
            added[h] = (slot, toks, fp)
            stored += 1
        return removed, added, used, placed, stored, evictions

    def put_many(self, items: list, rows_of) -> dict:
        """Store several pages, as putting them one after the other would (same entries, LRU
        order and counters), with one gather and one copy per run of slots. A page that
        finds no slot (every entry is being promoted, see :attr:`held`) is not kept and
        counts as an eviction.

        Parameters
        ----------
        items : list of (hash, fingerprint, token bytes, page)
            Oldest first: the order they join the LRU list.
        rows_of : callable
            ``rows_of(pages) -> [n, *page_shape]`` tensor of those pages, in that order (on
            the device or the host); called at most once.

        Returns
        -------
        dict
            ``{item position: slot}`` of the pages stored.
        """
        if self.capacity <= 0 or not items:
            return {}
        removed, added, used, placed, stored, evictions = self._plan(items)
        # the slots of this batch, ascending, given to its pages in ascending page order:
        # consecutive pages land in consecutive slots (one copy), and read back in one
        order = sorted(placed, key=lambda i: items[i][3])
        slots = sorted(placed.values())
        for i, slot in zip(order, slots):
            placed[i] = slot
            h, fp, toks, _ = items[i]
            added[h] = (slot, toks, fp)  # same position in the LRU order
        if order:
            rows = rows_of([items[i][3] for i in order])  # may raise: nothing changed
            self._write(slots, rows)
        for h in removed:
            del self._index[h]
        self._index.update(added)
        del self._slots[len(self._slots) - used:]
        self.counters["demotions"] += stored
        self.counters["evictions"] += evictions
        return placed

    def _write(self, slots: list, rows) -> None:
        """Copy ``rows`` into pool ``slots`` (ascending); on failure the entries of those
        slots are dropped (they may hold partial bytes)."""
        import torch

        if self._pool is None:  # made without page_shape: the first rows give it
            self._pool = allocate("host tier", (self.capacity, *rows.shape[1:]), rows.dtype,
                                  "cpu", pin_memory=self.pin_memory, zero=False)
        async_ = False
        try:
            async_ = self._order(rows)
            if not async_ and rows.device.type != "cpu":
                rows = rows.cpu()  # an unpinned pool: one synchronous copy to the host
            spans = runs(slots)
            if not async_ and len(spans) > 1:
                self._pool.index_copy_(0, torch.tensor(slots, dtype=torch.int64), rows)
            else:
                for i, j, s in spans:
                    self._pool[s:s + j - i].copy_(rows[i:j], non_blocking=async_)
            if async_:
                self._record(rows.device)
        except BaseException:
            if async_:  # copies queued before the failure: waited for before the slots are
                self._record(rows.device)  # written again
            gone = set(slots)
            for h in [h for h, v in self._index.items() if v[0] in gone]:
                self._slots.append(self._index.pop(h)[0])
                self.counters["evictions"] += 1
            self._slots.sort(reverse=True)  # pop() -> lowest
            raise

    def put(self, h: int, fp: int, token_bytes: bytes, data) -> None:
        """Store one page ``data`` (``[*page_shape]``) under hash ``h`` (see
        :meth:`put_many`)."""
        self.put_many([(h, fp, token_bytes, 0)], lambda pages: data[None])

    # -- promotion ----------------------------------------------------------------------------
    def find(self, h: int, fp: int, token_bytes: bytes, touch: bool = True):
        """The slot of the page under ``h`` if its tokens and prefix fingerprint match (a hit:
        it becomes the most recently used and is counted, unless ``touch`` is False: a look
        ahead, :meth:`touch` once it is used), else None (a miss)."""
        hit = self._index.get(h)
        if hit is None:
            self.counters["misses"] += 1
            return None
        slot, toks, efp = hit
        if toks != token_bytes or efp != fp:
            self.counters["rejected"] += 1
            self.counters["misses"] += 1
            return None
        if touch:
            self.touch(h)
        return slot

    def touch(self, h: int) -> None:
        """Count a hit on entry ``h`` (found with ``touch=False``) and make it the most
        recently used."""
        if h in self._index:
            self._index.move_to_end(h)
            self.counters["hits"] += 1

    def get(self, h: int, fp: int, token_bytes: bytes):
        """The page under ``h`` (a view of the pool) if it is a hit (:meth:`find`), else
        None."""
        slot = self.find(h, fp, token_bytes)
        return None if slot is None else self.slot_view(slot)

    def slot_view(self, slot: int):
        """The pool's row ``slot`` once the copies into it are done (a view)."""
        self.wait()
        return self._pool[slot]

    def read(self, slots: list, device):
        """``[n, *page_shape]`` rows of pool ``slots`` on ``device``: one copy per run of
        consecutive slots (asynchronous from a pinned pool to CUDA); on the host, a view of
        the pool when the slots are one ascending run. Hold the slots (:attr:`held`) until the
        rows are used when they may be a view."""
        import torch

        spans = runs(slots)
        device = torch.device(device)
        if device.type != "cuda":
            self.wait()
            if len(spans) == 1:
                return self._pool[slots[0]:slots[0] + len(slots)]
            return self._pool.index_select(0, torch.tensor(slots, dtype=torch.int64))
        out = torch.empty((len(slots), *self._pool.shape[1:]), dtype=self._pool.dtype,
                          device=device)
        async_ = self._order(out)
        for i, j, s in spans:
            out[i:j].copy_(self._pool[s:s + j - i], non_blocking=async_)
        if async_:
            self._record(device)
        return out

    @property
    def held(self) -> set:
        """Slots a promotion is reading: a demotion never gives them to another page."""
        return self._held

    def stats(self) -> dict:
        c = dict(self.counters)
        c["entries"] = len(self._index)
        c["bytes"] = 0 if self._pool is None else \
            len(self._index) * self._pool[0].numel() * self._pool.element_size()
        return c
