"""Host and disk tiers under the paged manager's prefix cache (plain torch, numpy and files).

When the device pool evicts a cached page it is *demoted*: its bytes go to a bounded host tier
(a preallocated pool of pages, pinned when the cache lives on CUDA) and, if a directory was
given, to a bounded disk tier (written through, so a restarted process finds its long system
prompts warm). A fresh sequence whose prefix misses on the device but hits a lower tier gets
those pages *promoted* back (new device pages, registered as cached) before the fetch plans.

Entries are keyed by the page's chained block hash (:mod:`.hashing`) and carry the page's
token ids and an independent 64-bit fingerprint of its whole prefix; a hit must match both
(content-verified: a hash collision or a stale entry is a miss, counted as ``rejected``).

Disk entries: one file per hash, ``<hash>.kvp`` = magic, JSON meta (tokens, fingerprint,
dtype, shape, checksum), raw bytes. Written to a temp name in the same directory (mode 0600)
then ``os.replace``-d, so a process killed mid-write leaves only complete entries visible; the
checksum is verified on every read and a corrupt or truncated entry is a logged miss (and
removed), as is one that is not a regular file (a symlink is never followed; a FIFO or device
never read) or larger than an entry can be. The directory is created 0700; one owned by
someone else, group/other-writable or not writable is refused -- at attach and again before
every read and write (one removed meanwhile is recreated 0700). A ``filelock`` serialises
writers of a shared directory; LRU order is the files' mtimes (touched on a hit), so it
survives restarts too. The disk tier lives in :mod:`.disktier`.
"""

from __future__ import annotations

import os

import numpy as np

from ..errors import InvalidArgumentError, describe
from .args import INT32_MAX, check_seconds
from .disktier import DiskTier, check_private_dir  # noqa: F401 - re-exported
from .hashing import chain_hash, fingerprint
from .hosttier import HostTier

__all__ = ["HostTier", "DiskTier", "TierStore", "TierMixin"]


class TierStore:
    """The lower tiers of one cache: host, then disk (either may be absent)."""

    def __init__(self, host: HostTier | None, disk: DiskTier | None, page_shape, dtype: str):
        self.host, self.disk, self.page_shape, self.dtype = host, disk, tuple(page_shape), dtype

    def put_many(self, items: list, rows_of) -> None:
        """Demote pages together: ``items`` = (hash, fingerprint, token bytes, page), oldest
        first; ``rows_of(pages)`` gives their rows. The host tier takes them in one batch
        (:meth:`HostTier.put_many`); the disk tier queues those it lacks, from the host tier's
        slots (or, for pages the host tier did not keep, one more gather to the host)."""
        placed = self.host.put_many(items, rows_of) if self.host is not None else {}
        if self.disk is None or self.disk.closed:  # closed (close_tiers, exit): the pages
            return                                 # are evicted without a disk copy
        todo = [i for i, it in enumerate(items) if it[0] not in self.disk]
        rest = [i for i in todo if i not in placed]
        rows = rows_of([items[i][3] for i in rest]).cpu() if rest else None
        row_of = {i: r for r, i in enumerate(rest)}
        for i in todo:
            h, fp, toks, _ = items[i]
            if h not in self.disk:  # an earlier page of this batch with the same hash
                data = self.host.slot_view(placed[i]) if i in placed else rows[row_of[i]]
                self.disk.put(h, fp, toks, data)

    def put(self, h, fp, token_bytes, data) -> None:
        """Demote one page ``data`` (``[*page_shape]``)."""
        self.put_many([(h, fp, token_bytes, 0)], lambda pages: data[None])

    def find(self, h, fp, token_bytes, touch: bool = True):
        """A content-verified hit: ``("host", slot)`` or ``("disk", page tensor)``; None on a
        miss in every tier (a promotion is counted by :meth:`promoted`, once it happened).
        ``touch`` False: a look ahead that counts no hit and leaves the LRU order
        (:meth:`touch` the hits used)."""
        if self.host is not None:
            slot = self.host.find(h, fp, token_bytes, touch)
            if slot is not None:
                return "host", slot
        if self.disk is not None:
            hit = self.disk.get(h, fp, token_bytes, self.page_shape, self.dtype, touch)
            if hit is not None:
                return "disk", hit
        return None

    def touch(self, found) -> None:
        """Count and mark most recently used the hits ``[(hash, hit)]`` found with
        ``touch=False``."""
        for h, (tier, _) in found:
            (self.host if tier == "host" else self.disk).touch(h)

    def promoted(self, hits) -> None:
        """Count ``hits`` (from :meth:`find`) as promotions, each in its own tier."""
        for tier, _ in hits:
            (self.host if tier == "host" else self.disk).counters["promotions"] += 1

    def stage(self, hits: list, device) -> list:
        """Rows of ``hits`` (from :meth:`find`) on ``device``, grouped by tier:
        ``[(positions in hits, [n, *page_shape] rows)]``; host hits in slot order, one copy
        per run of slots."""
        import torch

        out = []
        host = sorted((h[1], i) for i, h in enumerate(hits) if h[0] == "host")
        if host:
            out.append(([i for _, i in host], self.host.read([s for s, _ in host], device)))
        disk = [i for i, h in enumerate(hits) if h[0] == "disk"]
        if disk:
            out.append((disk, torch.stack([hits[i][1] for i in disk])))
        return out

    def count_prefix(self, hashes) -> int:
        n = 0
        for h in hashes:
            if not ((self.host is not None and h in self.host)
                    or (self.disk is not None and h in self.disk)):
                break
            n += 1
        return n

    def stats(self) -> dict:
        out = {}
        if self.host is not None:
            out["host"] = self.host.stats()
        if self.disk is not None:
            out["disk"] = self.disk.stats()
        return out


class TierMixin:
    """Demotion and promotion of the paged manager's cached pages (see the module doc)."""

    def attach_tiers(self, host_pages: int = 0, disk_dir=None,
                     disk_bytes: int = 1 << 30) -> TierStore:
        """Give the prefix cache lower tiers (attached again: they replace the tiers it
        had, whose disk tier is flushed and closed).

        Parameters
        ----------
        host_pages : int
            Pages the host tier holds (0: none).
        disk_dir : str or Path, optional
            Directory of the disk tier (none if omitted).
        disk_bytes : int
            Size bound of the disk tier, in bytes (default 1 GiB).

        Returns
        -------
        TierStore
            The new tiers (their counters are in ``stats().tiers``).

        Raises
        ------
        InvalidArgumentError
            Prefix caching is off, a size is negative, or ``disk_dir`` is refused (cannot be
            created or written, another user's, or writable by group/others).
        """
        if not self.prefix_caching:
            raise InvalidArgumentError(describe("attach_tiers: params.enable_prefix_caching",
                                                True, False))
        for name, v in (("host_pages", host_pages), ("disk_bytes", disk_bytes)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise InvalidArgumentError(describe(name, "an int >= 0", repr(v)))
        if host_pages > INT32_MAX:
            raise InvalidArgumentError(describe("host_pages", f"at most {INT32_MAX}", host_pages))
        if disk_dir is not None and not isinstance(disk_dir, (str, os.PathLike)):
            raise InvalidArgumentError(describe("disk_dir", "a path (str or os.PathLike)",
                                                type(disk_dir).__name__))
        if disk_dir is not None and not os.fspath(disk_dir):  # Path("") is the current dir
            raise InvalidArgumentError(describe("disk_dir", "a non-empty path", "''"))
        p = self.params
        shape = (2, self.num_layers, self.page_size, p.n_kv_heads, p.head_dim) \
            if not p.quantized else (p.bytes_per_page(self.num_layers),)
        pin = any(getattr(d, "type", str(d)).startswith("cuda") for d in self.devices)
        disk = DiskTier(disk_dir, disk_bytes) if disk_dir is not None else None
        host = HostTier(host_pages, pin_memory=pin, page_shape=shape, dtype=p.tensor_dtype) \
            if host_pages else None
        tiers = TierStore(host, disk, shape, p.tensor_dtype)
        with self._lock:
            old, self._tiers = self._tiers, tiers
        if old is not None and old.disk is not None:  # attached again: the replaced disk
            old.disk.close()  # tier's writes are flushed and its writer thread stopped
        return tiers

    def _page_rows(self, pages: list):
        """``[n, 2, L, P, n_kv_heads, D]`` (``[n, page_bytes]`` quantized) of ``pages``, all
        devices' heads: a view of the cache when they are consecutive on one device."""
        return self._gather(list(pages), (0, self.params.n_kv_heads))

    def _demote(self, pages: list) -> None:
        """Copy cached ``pages`` (about to be evicted, oldest first) to the tiers together:
        one gather, one copy into the host tier, the disk tier's queue. Raises if a copy fails
        (the device pool and the prefix cache unchanged; see :mod:`.hosttier`)."""
        prefix, items = self._prefix, []
        for page in pages:
            key = prefix.page_key[page]
            chain = self._chain_of(prefix.table[key][0])
            if chain is not None:  # a page whose parent chain is gone is unreachable anyway
                items.append((chain[0], chain[1], key[1], page))
        if items:
            self._tiers.put_many(items, self._page_rows)

    def persist_prefix_cache(self) -> int:
        """Write every cached device page the disk tier lacks (so a restart finds it);
        returns the pages written: whose files are in place when it returns (a write that
        failed -- a full or unwritable disk -- is counted in ``stats().tiers["disk"]
        ["write_errors"]``, not here). 0 without a disk tier; InvalidArgumentError once it
        is closed."""
        with self._lock:
            disk = self._tiers.disk if self._tiers is not None else None
            if disk is None:
                return 0
            if disk.closed:
                raise InvalidArgumentError(describe(
                    "persist_prefix_cache: disk tier", "open",
                    "closed (close_tiers, or a process forked from the tier's)"))
            todo = []
            for key, (kid, page) in sorted(self._prefix.table.items(), key=lambda kv: kv[1][0]):
                chain = self._chain_of(kid)
                if chain is not None and chain[0] not in disk:
                    todo.append((chain[0], chain[1], key[1], page))
            rows = self._page_rows([it[3] for it in todo]).cpu() if todo else None
            queued = [h for i, (h, fp, toks, _) in enumerate(todo)
                      if disk.put(h, fp, toks, rows[i], block=True)]
        disk.flush()  # on disk when this returns (the lock is not held while waiting)
        return sum(disk.on_disk(h) for h in queued)

    def flush_tiers(self, timeout: float | None = None) -> bool:
        """Wait until the disk tier's queued writes are on disk; False on timeout."""
        timeout = check_seconds("timeout", timeout)
        tiers = self._tiers
        return tiers is None or tiers.disk is None or tiers.disk.flush(timeout)

    def close_tiers(self) -> None:
        """Flush the disk tier and stop its writer thread (also done at interpreter exit).
        The cache goes on: evicted pages then skip the disk (the host tier, if any, still
        takes them), hits are still read from it; :meth:`persist_prefix_cache` is refused."""
        tiers = self._tiers
        if tiers is not None and tiers.disk is not None:
            tiers.disk.close()

    def cached_prefix_tokens(self, tokens) -> int:
        """Leading tokens of ``tokens`` (int sequence ``[n]``: the prompt of a fresh
        sequence) that its first fetch would take from the prefix cache instead of computing:
        the full pages of its cached chain in the device pool, then in the lower tiers (by
        hash: "probably"; the fetch checks the tokens). The last token never counts (it is
        always recomputed); 0 without prefix caching. A fetch of only the first ``k`` tokens
        can hit ``(k - 1) // page_size`` pages at most: an engine sizes a prompt's first
        chunk with this so chunked prefill does not recompute what the cache holds.
        InvalidArgumentError unless ``tokens`` is a flat sequence of ints."""
        try:
            toks = None if isinstance(tokens, (str, bytes)) else np.array(
                tokens if isinstance(tokens, list) else list(tokens))
        except (TypeError, ValueError):
            toks = None
        if toks is None or toks.ndim != 1 or (toks.size and toks.dtype.kind not in "iu"):
            raise InvalidArgumentError(describe("tokens", "a flat sequence of int token ids",
                                                repr(tokens)[:80]))
        if not self.prefix_caching:
            return 0
        toks = toks.astype(np.int64, copy=False)
        P = self.page_size
        chunks = [toks[i * P:(i + 1) * P].tobytes() for i in range(max(0, toks.size - 1) // P)]
        with self._lock:
            held, kids = self._prefix.lookup(chunks)
            n = len(held)
            chain = None
            if self._tiers is not None and n < len(chunks):
                chain = self._chain_of(kids[-1]) if kids else self._root_chain()
            if chain is not None:
                h, hashes = chain[0], []
                for chunk in chunks[n:]:
                    h = chain_hash(h, chunk, self.hash_bits)
                    hashes.append(h)
                n += self._tiers.count_prefix(hashes)
        return n * P

    def _tier_hits(self, chunks: list, keep=(), touch: bool = True) -> tuple[list, list, list]:
        """What :meth:`_promote` would bring back, without taking a page: ``(held, kids,
        found)`` with the device's cached chain of ``chunks`` (pages, prefix-tree ids) and
        the content-verified tier hits past it, ``[((chunk, hash, fingerprint), hit)]``, as
        many as free or evictable pages (outside ``keep`` and that chain) can take.
        Only the hits returned (those that fit) are counted and made recently used; none
        with ``touch`` False (a look ahead: ``_promote`` touches them)."""
        prefix, tiers = self._prefix, self._tiers
        held, kids = prefix.lookup(chunks)
        chain = None
        if len(held) < len(chunks):
            chain = self._chain_of(kids[-1]) if kids else self._root_chain()
        if chain is None:
            return held, kids, []
        h, fp = chain
        found = []
        for chunk in chunks[len(held):]:
            h, fp = chain_hash(h, chunk, self.hash_bits), fingerprint(fp, chunk)
            hit = tiers.find(h, fp, chunk, touch=False)
            if hit is None:
                break
            found.append(((chunk, h, fp), hit))
        n = min(len(found), self._available_pages() - sum(p in prefix.lru for p in
                                                          set(keep) | set(held)))
        found = found[:max(n, 0)]
        if touch:
            tiers.touch([(h, hit) for (_, h, _), hit in found])
        return held, kids, found

    def _promote(self, chunks: list, keep=(), hits=None) -> int:
        """Bring back from the tiers the pages of ``chunks`` (token bytes of full pages, from
        page 0) past the device's longest cached chain, as cached device pages; never evicts
        the pages of ``keep`` or of that chain. The pages found move together: their rows
        are staged on the device (one copy per run of host slots) before any page is taken,
        then written with one scatter per tier. Returns the pages promoted. ``hits``: what
        :meth:`_tier_hits` answered for these arguments (under the same lock hold), when
        the caller looked first.

        If the scatter fails, nothing is registered and the pages taken go back to the free
        list (pages that were evicted for them stay evicted: they were demoted first)."""
        prefix, tiers = self._prefix, self._tiers
        held, kids, found = self._tier_hits(chunks, keep, True) if hits is None else hits
        n = len(found)
        if not n:
            return 0
        if hits is not None:  # a look ahead's: counted and made recently used now, before
            tiers.touch([(h, hit) for (_, h, _), hit in found])  # the pages are taken
        device = self._blocks[0].device if self.n_devices == 1 else "cpu"
        slots = [hit[1] for _, hit in found if hit[0] == "host"]
        pins = list(dict.fromkeys(list(keep) + list(held)))
        hold = tiers.host.held if tiers.host is not None else set()
        hold.update(slots)  # a demotion below must not give these slots away
        try:
            groups = tiers.stage([hit for _, hit in found], device)
            self._lease_pages(pins)
            try:
                pages = self._take(n)
            finally:
                self._unlease_pages(pins)
            try:
                for pos, rows in groups:
                    self._scatter([pages[i] for i in pos], rows)
            except BaseException:
                self._free.extend(pages)
                raise
        finally:
            hold.difference_update(slots)
        parent = kids[-1] if kids else prefix.root
        for page, ((chunk, h, fp), _) in zip(pages, found):
            parent = prefix.insert(parent, chunk, page)
            self._chain_memo[parent] = (h, fp)
            if page in prefix.page_key:
                prefix.lru[page] = None
            else:
                self._free.append(page)
        tiers.promoted([hit for _, hit in found])
        return len(pages)
