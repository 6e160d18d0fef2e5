"""Paged manager (seed 003): a pool of pages with a free list, refcounts and a prefix cache.

Cache tensor per device: ``[num_pages, 2, num_layers, page_size, n_kv_heads, head_dim]``.
Sequence ``b`` of a batch owns pages ``lookup_table[b, :]``; its token ``t`` lives in page
``lookup_table[b, t // page_size]`` at slot ``t % page_size``.

Choices written down here:

- ``fetch`` allocates only the pages the new tokens (plus ``num_steps - 1``) need; pages a
  sequence holds past its length (reserved by a multistep fetch that ended early) are kept for
  its next fetch and returned by ``release`` or ``pop``.
- Prefix caching (``params.enable_prefix_caching``): at ``step`` every newly full page is cached
  under a chained key of its tokens (:mod:`.prefix_cache`). A *new* sequence (no tokens cached)
  reuses the longest cached chain of full pages of its ``tokens`` at its first ``fetch``, but
  never the page holding its last token: at least one token is always computed, so the model
  has a query to produce logits from. ``RaggedKVCacheInputs.num_cached_tokens[b]`` tells the
  caller how many leading tokens it skips; ``cache_lengths[b]`` starts there.
- ``fork`` shares every page of the parent (refcounts up). A write into a page that is shared
  (refcount > 1) copies it first (copy-on-write, through the manager's ``page_copier``:
  :func:`kvtvm.ops.copy_pages` unless another was handed in); a write
  into a cached page no one else holds just uncaches it. Only the partial last page can be hit,
  since writes start at the sequence's length.
- ``pop(seq_id, n)`` drops the last ``n`` tokens (speculative decoding); pages past the new
  length are released, full pages keep their cache entries.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np

from ..errors import (InvalidArgumentError, KVCacheCapacityError, KVCacheError,
                      SequenceStateError, describe)
from ..params import KVCacheParams, KVCacheStrategy
from .args import (INT32_MAX, check_host_bytes, check_size, check_size_kwargs, check_sizes,
                   pop_length)
from .base import KVCacheManager, check_positive_int, parse_devices
from .copier import PageCopier, copy_view, resolve_copier
from .pageio import PageIOMixin
from .prefix_cache import PagedCacheStats, PrefixCache
from .tables import StepTables, table_elems
from .tiers import TierMixin

__all__ = ["PagedKVCacheManager", "PagedCacheStats"]


def _resolve_num_pages(params: KVCacheParams, max_batch_size: int, max_seq_len: int,
                       num_layers: int, n_devices: int, num_pages=None,
                       available_cache_memory=None) -> int:
    width = params.pages_for_tokens(max_seq_len)
    if num_pages is not None and available_cache_memory is not None:
        raise InvalidArgumentError(describe(  # which would win? (num_pages ignored the budget)
            "num_pages / available_cache_memory", "one of them", "both"))
    if num_pages is not None:
        return check_size("num_pages", num_pages)
    if available_cache_memory is not None:
        available_cache_memory = check_positive_int("available_cache_memory",
                                                    available_cache_memory)
        table_bytes = 4 * table_elems(max_batch_size, width)
        pages = (available_cache_memory - table_bytes) // params.bytes_per_page(num_layers,
                                                                                  n_devices)
        if pages < 1:
            raise KVCacheCapacityError(
                f"available_cache_memory={available_cache_memory} bytes holds no page: one page "
                f"is {params.bytes_per_page(num_layers, n_devices)} bytes and the tables "
                f"{table_bytes} bytes")
        return min(int(pages), INT32_MAX)  # page ids are int32 table entries
    return check_size("num_pages (max_batch_size x pages per sequence)", max_batch_size * width)


class PagedKVCacheManager(PageIOMixin, TierMixin, KVCacheManager):
    """Paged KV cache with refcounted pages, prefix caching, fork and rollback.

    Parameters
    ----------
    params : KVCacheParams
        ``cache_strategy`` PAGED; ``page_size`` tokens per page; ``enable_prefix_caching``.
    max_batch_size, max_seq_len, num_layers : int
        Sequences at once, tokens per sequence, decoder layers.
    devices : sequence of str
        The KV heads are split evenly across them (every device holds every page).
    num_pages : int, optional
        Pages in the pool. Default: from ``available_cache_memory`` if given, else enough for
        every sequence to reach ``max_seq_len`` (``max_batch_size * ceil(max_seq_len /
        page_size)``).
    available_cache_memory : int, optional
        Bytes per device for the cache and its tables; sets ``num_pages`` (give one of them).
    page_copier : PageCopier, optional
        ``page_copier(blocks, src, dst)`` copies whole pages of one device's cache tensor,
        ``src`` and ``dst`` int32 ``[n]`` host tensors (see :mod:`kvtvm.manager.copier`);
        used by copy-on-write after :meth:`fork`. Default: the copier registered by
        :mod:`kvtvm` (:func:`kvtvm.ops.copy_pages`).
    """

    strategy = KVCacheStrategy.PAGED

    def __init__(self, params: KVCacheParams, max_batch_size: int, max_seq_len: int,
                 num_layers: int, devices=("cpu",), num_pages: int | None = None,
                 available_cache_memory: int | None = None,
                 page_copier: PageCopier | None = None):
        super().__init__(params, max_batch_size, max_seq_len, num_layers, devices)
        #: Copies pages for copy-on-write: ``page_copier(blocks, src, dst)``.
        self.page_copier = resolve_copier(page_copier, "page", "page_copier")
        self.page_size = params.page_size
        self.max_pages_per_seq = params.pages_for_tokens(self.max_seq_len)
        self.num_pages = _resolve_num_pages(params, self.max_batch_size, self.max_seq_len,
                                            self.num_layers, self.n_devices, num_pages,
                                            available_cache_memory)
        shape = self.params.cache_shape(self.num_layers, self.max_batch_size, self.max_seq_len,
                                        num_pages=self.num_pages, n_devices=self.n_devices)
        W, mb = self.max_pages_per_seq, self.max_batch_size
        # the host tables, before anything is allocated (they were numpy's MemoryError)
        check_host_bytes("page and step tables (and the prefix cache's token table)", 8 * mb * W + (
            8 * mb * self.max_seq_len if params.enable_prefix_caching else 0))
        self._blocks = self._allocate_blocks(shape)
        self._tables = StepTables(mb, W, self.devices)
        self._page_table = np.zeros((mb, W), dtype=np.int32)
        self._npages = np.zeros(mb, dtype=np.int64)
        self._refcount = np.zeros(self.num_pages, dtype=np.int32)
        self._n_shared = 0  # pages with refcount > 1
        self._tail_check = np.zeros(mb, dtype=bool)  # last page may be shared or cached
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))  # pop() -> lowest page
        self._lookup_ids = np.zeros(mb, dtype=np.int64)  # batch of the last lookup fill
        self._lookup_n = -1
        self.prefix_caching = bool(params.enable_prefix_caching)
        self._prefix = PrefixCache(root=params.storage_key(self.num_layers))
        if self.prefix_caching:
            self._tokens = np.zeros((mb, self.max_seq_len), dtype=np.int64)
            self._keys: list[list[int]] = [[] for _ in range(mb)]
            self._page_offsets = np.arange(self.page_size, dtype=np.int64)[None, :]
        self._init_pageio()  # leases, export/import (.pageio)
        self._tiers = None   # host/disk tiers of the prefix cache (.tiers, attach_tiers)

    # -- Sizes -----------------------------------------------------------------------------

    @classmethod
    def estimated_memory_size(cls, params, max_batch_size, max_seq_len, num_layers,
                              available_cache_memory=None, devices=("cpu",), num_pages=None,
                              **kwargs) -> int:
        """Bytes allocated on each device: the page pool plus the per-step int32 tables
        (``num_pages`` resolved as in the constructor)."""
        check_sizes(params, cls.strategy, max_batch_size=max_batch_size,
                    max_seq_len=max_seq_len, num_layers=num_layers)
        check_size_kwargs("estimated_memory_size", kwargs, ("page_copier",))
        n = len(parse_devices(devices))
        pages = _resolve_num_pages(params, max_batch_size, max_seq_len, num_layers, n,
                                   num_pages, available_cache_memory)
        return (params.cache_bytes(num_layers, max_batch_size, max_seq_len, num_pages=pages,
                                   n_devices=n)
                + 4 * table_elems(max_batch_size, params.pages_for_tokens(max_seq_len)))

    @classmethod
    def infer_optimal_batch_size(cls, params, max_seq_len, num_layers, available_cache_memory,
                                 devices=("cpu",), **kwargs) -> int:
        """Most sequences that can all reach ``max_seq_len`` at once in
        ``available_cache_memory`` bytes per device (pages plus tables); at least 1, at most
        what the int32 tables index (``num_pages``, which fixes the pool, is refused)."""
        check_sizes(params, cls.strategy, max_seq_len=max_seq_len, num_layers=num_layers)
        check_size_kwargs("infer_optimal_batch_size", kwargs, ("page_copier",))
        available_cache_memory = check_positive_int("available_cache_memory",
                                                    available_cache_memory)
        n = len(parse_devices(devices))
        width = params.pages_for_tokens(max_seq_len)
        per_seq = width * params.bytes_per_page(num_layers, n) + 4 * (2 + width)
        # at most as many as the int32 tables index (their default pool: batch x width pages)
        return max(1, min(INT32_MAX // width, (available_cache_memory - 4) // per_seq))

    # -- Page pool -------------------------------------------------------------------------

    def _available_pages(self) -> int:
        return len(self._free) + len(self._prefix.lru)

    def _take(self, k: int) -> list[int]:
        """``k`` pages from the free list, evicting LRU cached pages when it runs out."""
        free = self._free
        if k <= len(free):
            pages = free[len(free) - k:]
            del free[len(free) - k:]
            return pages[::-1]
        victims = list(itertools.islice(self._prefix.lru, k - len(free)))
        if self._tiers is not None:  # down a tier first, together (if it fails: unchanged)
            self._demote(victims)
        pages = free[::-1]
        free.clear()
        pages.extend(self._prefix.evict_one() for _ in victims)
        pages.sort()  # evicted deepest first: ascending runs keep transfers zero-copy
        return pages

    def _drop_refs(self, pages) -> None:
        """One reference less on each page, deepest first; unreferenced pages go to the free
        list, or to the LRU list if cached."""
        rc, cached, lru = self._refcount, self._prefix.page_key, self._prefix.lru
        for p in reversed([int(p) for p in pages]):
            rc[p] -= 1
            if rc[p] == 1:
                self._n_shared -= 1
            elif rc[p] == 0 and not self._leased[p]:  # a leased page waits for its lease
                if p in cached:
                    lru[p] = None
                else:
                    self._free.append(p)

    def _release_slot(self, seq_id: int) -> None:
        self._invalidate_lookup()
        for lease in self._leases.values():  # an import still in flight for it: its pages
            if lease.seq_id == seq_id:       # go to the prefix cache only, never to the
                lease.seq_id = None          # next sequence that claims this slot
        k = int(self._npages[seq_id])
        self._drop_refs(self._page_table[seq_id, :k])
        self._page_table[seq_id, :k] = 0
        self._npages[seq_id] = 0
        self._tail_check[seq_id] = False
        if self.prefix_caching:
            self._keys[seq_id] = []

    # -- fetch / step ----------------------------------------------------------------------

    def _fetch_plan_apply(self, tokens, ids, counts, num_steps, lengths, total, dry=False):
        P = self.page_size
        n = ids.size
        npages = self._npages[ids]
        hits = None  # no prefix hits
        hit_plan = []  # (b, pages, key ids)
        prefix = self._prefix
        if self.prefix_caching and not lengths.all():
            fresh = np.flatnonzero((lengths == 0) & (npages == 0))
            if fresh.size:
                hits = np.zeros(n, dtype=np.int64)
            if fresh.size and self._tiers is not None and not dry:
                # room first, with the device's hits only: a page promoted from a tier costs
                # the page it saves, so the answer is the same, and a fetch that cannot fit
                # fails before any page moves up (atomic); raises, or returns nothing
                self._fetch_plan_apply(tokens, ids, counts, num_steps, lengths, total, True)
            for b in fresh:
                toks = tokens.tokens_of(b)
                full = (toks.size - 1) // P  # the last token is always recomputed
                chunks = [toks[i * P:(i + 1) * P].tobytes() for i in range(full)]
                if self._tiers is not None and not dry:  # lower-tier hits come back cached
                    self._promote(chunks, keep=[p for _, ps, _, _ in hit_plan for p in ps])
                pages, kids = prefix.lookup(chunks)
                hit_plan.append((int(b), pages, kids, toks.size))
                hits[b] = len(pages) * P
        if hit_plan:
            start, have = lengths + hits, npages + hits // P
        else:
            start, have = lengths, npages
        # sequences whose pages cannot hold ``total`` tokens, and how many pages each needs
        short = (total > have * P).nonzero()[0]
        have_short = have[short]
        alloc = (total[short] - have_short * P + (P - 1)) // P
        # copy-on-write: the page the writes start in, when it is already held and shared
        cow, uncache = [], []
        # Only a sequence flagged by fork or pop can start writing into a page that is shared
        # or cached (a page is cached only once full, and writes start at the length).
        flagged = self._tail_check[ids]
        any_flagged = np.count_nonzero(flagged) > 0
        partial = (flagged & (start % P != 0)).nonzero()[0] if any_flagged else ()
        if len(partial):
            pages = self._page_table[ids[partial], start[partial] // P]
            rc = self._refcount[pages] + self._leased[pages]  # a leased page is copied too
            # prefix hits of this same batch hold the pages they hit too: a page another item
            # is about to share must be copied, never written in place (nor uncached)
            hit_refs: dict[int, int] = {}
            for _, hit_pages, _, _ in hit_plan:
                for p in hit_pages:
                    hit_refs[p] = hit_refs.get(p, 0) + 1
            left = {}  # page -> holders not yet moved off it by an earlier item's copy
            for b, page, r in zip(partial.tolist(), pages.tolist(), rc.tolist()):
                r = left.get(page, r + hit_refs.get(page, 0))
                if r > 1:  # shared: this item writes into a copy
                    cow.append((b, page))
                    left[page] = r - 1
                elif page in prefix.page_key and page not in uncache:
                    uncache.append(page)  # held by this item alone: write in place, uncached
        n_alloc = int(alloc.sum())
        n_new = n_alloc + len(cow)
        pinned = {p for _, pages, _, _ in hit_plan for p in pages if p in prefix.lru}
        available = self._available_pages() - len(pinned)
        if n_new > available:
            raise KVCacheCapacityError(
                f"fetch: needs {n_new} new pages of {P} tokens ({n_alloc} for new "
                f"tokens, {len(cow)} copy-on-write), {available} are free or evictable "
                f"(pool of {self.num_pages} pages)")
        if dry:
            return None
        # -- apply (only a failing page copy can raise from here; then everything is undone) --
        evicts = self._tiers is not None and n_new > len(self._free)  # a demotion may fail
        snap = self._snapshot() if cow or evicts else None
        try:
            self._apply_fetch(ids, hit_plan, uncache, cow, short, alloc, have_short, start)
        except BaseException:
            if snap is not None:
                self._restore(snap)
            raise
        if any_flagged:
            self._tail_check[ids] = False  # every write page of the batch is now exclusive
        changed = short
        if hit_plan or cow:
            changed = np.concatenate([short, [b for b, *_ in hit_plan], [b for b, _ in cow]])
        self._fill_lookup(ids, changed)
        return start, hits

    def _row_capacity(self, ids):  # (FetchToken.capacity: the tokens of each row's pages)
        return self._npages[ids] * self.page_size

    def _fill_lookup(self, ids, changed) -> None:
        """Rows of the per-step lookup table. A decode loop fetches the same batch step after
        step: then only the rows of items whose pages this fetch changed are rewritten (any
        other change of a page list -- release, fork, pop, an undone fetch -- invalidates the
        table and the next fetch rewrites every row)."""
        n = ids.size
        lookup = self._tables.lookup
        if n == self._lookup_n and not np.count_nonzero(ids != self._lookup_ids[:n]):
            if len(changed):
                changed = np.asarray(changed, dtype=np.int64)
                lookup[changed] = self._page_table[ids[changed]]
        else:
            np.take(self._page_table, ids, axis=0, out=lookup[:n])
            self._lookup_ids[:n] = ids
            self._lookup_n = n

    def _invalidate_lookup(self) -> None:
        self._lookup_n = -1

    def _apply_fetch(self, ids, hit_plan, uncache, cow, short, alloc, have_short, start):
        P = self.page_size
        rc, pt, prefix = self._refcount, self._page_table, self._prefix
        for b, pages, kids, ntok in hit_plan:
            sid = int(ids[b])
            prefix.queries += 1
            prefix.query_tokens += ntok
            prefix.hit_tokens += len(pages) * P
            for p in pages:
                if rc[p] == 0:
                    prefix.lru.pop(p, None)  # absent when leased
                rc[p] += 1
                if rc[p] == 2:
                    self._n_shared += 1
            pt[sid, :len(pages)] = pages
            self._npages[sid] = len(pages)
            self._keys[sid] = list(kids)
        for page in uncache:
            prefix.unregister(page)
        src, dst = [], []
        if cow:
            new_pages = self._take(len(cow))
            for (b, old), new in zip(cow, new_pages):
                sid = int(ids[b])
                rc[old] -= 1
                if rc[old] == 1:
                    self._n_shared -= 1
                rc[new] = 1
                pt[sid, int(start[b]) // P] = new
                src.append(old)
                dst.append(new)
        if short.size:
            pages = np.array(self._take(int(alloc.sum())), dtype=np.int32)
            rc[pages] = 1
            sids = ids[short]
            if (alloc == 1).all():  # decode: one new page per sequence that needs one
                pt[sids, have_short] = pages
            else:
                off = 0
                for sid, k, h in zip(sids.tolist(), alloc.tolist(), have_short.tolist()):
                    pt[sid, h:h + k] = pages[off:off + k]
                    off += k
            self._npages[sids] = have_short + alloc
        if src:
            self._copy_pages(src, dst)

    def _copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages ``src[i] -> dst[i]`` on every device (through the page copier)."""
        import torch

        copier = self.page_copier
        if copier is None:
            raise KVCacheError("fork: copy-on-write needs a page copier; none was handed in "
                               "and none is registered (kvtvm.manager.copier)")
        src_t = torch.tensor(src, dtype=torch.int32)
        dst_t = torch.tensor(dst, dtype=torch.int32)
        for blocks in self._blocks:  # fresh destinations: always one round of copies
            copier(copy_view(blocks, 0), src_t, dst_t)

    def _commit(self, tokens, ids, counts):
        if not self.prefix_caching:
            return
        flat = tokens.tokens  # may raise (not ints): before anything changes
        P = self.page_size
        lengths = self._lengths[ids]
        toks = self._tokens
        if flat.size == ids.size:  # one token each
            toks[ids, lengths] = flat
        else:
            rows = np.repeat(ids, counts)
            starts = np.cumsum(counts) - counts
            cols = np.arange(flat.size) - np.repeat(starts - lengths, counts)
            toks[rows, cols] = flat
        full = (lengths + counts) // P
        prefix, pt, keys_of = self._prefix, self._page_table, self._keys
        # a sequence's keys cover its full pages (or, fresh, its prefix hits): only those
        # that complete a page this step have pages to cache
        cand = (full > lengths // P).nonzero()[0]
        if not cand.size:
            return
        if counts[cand].max() < P and lengths[cand].min() > 0:
            # decode-like: each candidate completes exactly one page, page full[b] - 1;
            # gather all their tokens in one numpy call
            sids, last = ids[cand], full[cand] - 1
            chunks = toks[sids[:, None], (last * P)[:, None] + self._page_offsets]
            data, width = chunks.tobytes(), P * toks.itemsize
            pages = pt[sids, last].tolist()
            insert = prefix.insert
            for j, sid in enumerate(sids.tolist()):
                keys = keys_of[sid]
                keys.append(insert(keys[-1] if keys else prefix.root,
                                   data[j * width:(j + 1) * width], pages[j]))
            return
        for b in cand:
            sid = int(ids[b])
            keys = keys_of[sid]
            row = toks[sid]
            for i in range(len(keys), int(full[b])):
                parent = keys[i - 1] if i else prefix.root
                keys.append(prefix.insert(parent, row[i * P:(i + 1) * P].tobytes(),
                                          int(pt[sid, i])))

    # -- fork / pop / stats ----------------------------------------------------------------

    def fork(self, seq_id: int) -> int:
        """A new sequence with the same tokens as ``seq_id``, sharing its pages.

        The partial last page is copied on the first write of either sequence
        (copy-on-write). Returns the new ``seq_id`` (the lowest free slot).

        Raises
        ------
        UnknownSequenceError
            ``seq_id`` is not claimed.
        SequenceStateError
            ``seq_id`` has a fetch in flight.
        KVCacheCapacityError
            No free sequence slot.
        """
        with self._lock:
            sid = self._check_settled(seq_id, "fork")
            free = np.flatnonzero(~self._claimed)
            if free.size == 0:
                raise KVCacheCapacityError(
                    f"fork: asked for 1 sequence slot, 0 of {self.max_batch_size} are free")
            new = int(free[0])
            self._invalidate_lookup()
            L = int(self._lengths[sid])
            k = -(-L // self.page_size)
            pages = self._page_table[sid, :k]
            self._refcount[pages] += 1
            self._n_shared += int((self._refcount[pages] == 2).sum())
            self._claim_ids(np.array([new]))
            self._page_table[new, :k] = pages
            self._npages[new] = k
            self._lengths[new] = L
            self._tail_check[[sid, new]] = True
            if self.prefix_caching:
                self._tokens[new, :L] = self._tokens[sid, :L]
                self._keys[new] = list(self._keys[sid])
            return new

    def pop(self, seq_id: int, n: int) -> None:
        """Roll back the last ``n`` committed tokens of ``seq_id`` (speculative decoding).

        Pages past the new length are released; the next fetch writes from the new length.

        Raises
        ------
        UnknownSequenceError
            ``seq_id`` is not claimed.
        SequenceStateError
            ``seq_id`` has a fetch in flight.
        InvalidArgumentError
            ``n`` is negative or more than the sequence's length.
        """
        with self._lock:
            sid = self._check_settled(seq_id, "pop")
            new_len = pop_length(sid, n, int(self._lengths[sid]))
            self._invalidate_lookup()
            keep = -(-new_len // self.page_size)
            k = int(self._npages[sid])
            if k > keep:
                self._drop_refs(self._page_table[sid, keep:k])
                self._page_table[sid, keep:k] = 0
                self._npages[sid] = keep
            self._lengths[sid] = new_len
            self._tail_check[sid] = True
            if self.prefix_caching:
                del self._keys[sid][new_len // self.page_size:]

    def _repr_geometry(self) -> str:
        with self._lock:
            free, cached = len(self._free), len(self._prefix.lru)
        prefix = f", prefix cache ({cached} cached)" if self.prefix_caching else ""
        return (f", page_size={self.page_size}, pages={self.num_pages} ({free} free)"
                f"{prefix}")

    def stats(self) -> PagedCacheStats:
        """Pages used / free / cached / shared / leased, the prefix-cache hit rate and the
        lower tiers' counters (``free + used + cached + leased == total``)."""
        with self._lock:
            p = self._prefix
            leased = self._leased > 0
            return PagedCacheStats(
                pages_total=self.num_pages,
                pages_used=int(((self._refcount > 0) & ~leased).sum()),
                pages_free=len(self._free), pages_cached=len(p.lru),
                pages_shared=int((self._refcount > 1).sum()),
                prefix_queries=p.queries, prefix_query_tokens=p.query_tokens,
                prefix_hit_tokens=p.hit_tokens,
                prefix_hit_rate=p.hit_tokens / p.query_tokens if p.query_tokens else 0.0,
                evictions=p.evictions,
                pages_leased=int(leased.sum()),
                tiers=self._tiers.stats() if self._tiers is not None else {})

    def pages_of(self, seq_id: int) -> list[int]:
        """The pages ``seq_id`` holds, in token order (including pages reserved past its
        length by a multistep fetch)."""
        with self._lock:
            sid = self._check_known(seq_id, "pages_of")
            return self._page_table[sid, :int(self._npages[sid])].tolist()

    # -- Transactions and invariants -------------------------------------------------------

    def _snapshot(self):
        keys = [list(k) for k in self._keys] if self.prefix_caching else None
        return (self._page_table.copy(), self._npages.copy(), self._refcount.copy(),
                list(self._free), keys, self._prefix.snapshot(), self._tail_check.copy())

    def _restore(self, snap) -> None:
        pt, npages, rc, free, keys, prefix, tail = snap
        self._tail_check[...] = tail
        self._invalidate_lookup()
        self._page_table[...] = pt
        self._npages[...] = npages
        self._refcount[...] = rc
        self._n_shared = int((rc > 1).sum())
        self._free[:] = free
        if keys is not None:
            self._keys = keys
        self._prefix.restore(prefix)

    def check_invariants(self) -> None:
        """Raise AssertionError if the page bookkeeping is inconsistent (for tests).

        Every page is exactly one of: referenced (refcount = number of sequences holding it),
        free (unreferenced, uncached) or cached-unreferenced (on the LRU list); cached pages
        and prefix-table entries correspond one to one.
        """
        with self._lock:
            owners = np.zeros(self.num_pages, dtype=np.int64)
            for sid in np.flatnonzero(self._claimed):
                k = int(self._npages[sid])
                assert k >= -(-int(self._lengths[sid]) // self.page_size), f"seq {sid} short"
                row = self._page_table[sid, :k]
                assert len(set(row.tolist())) == k, f"seq {sid} holds a page twice"
                np.add.at(owners, row, 1)
                assert not self._page_table[sid, k:].any(), f"seq {sid} stale table entries"
            for sid in np.flatnonzero(~self._claimed):
                assert self._npages[sid] == 0 and not self._page_table[sid].any()
            assert (owners == self._refcount).all(), "refcounts differ from owners"
            assert self._n_shared == int((owners > 1).sum()), "shared-page count is off"
            for sid in np.flatnonzero(self._claimed & ~self._tail_check):
                L = int(self._lengths[sid])
                if L % self.page_size and self._pending[sid] < 0:
                    tail = int(self._page_table[sid, L // self.page_size])
                    assert owners[tail] == 1 and tail not in self._prefix.page_key, \
                        f"seq {sid}: unflagged last page {tail} is shared or cached"
            free = set(self._free)
            assert len(free) == len(self._free), "page on the free list twice"
            lru = set(self._prefix.lru)
            leased = set(np.flatnonzero(self._leased).tolist())
            assert (self._leased >= 0).all(), "negative lease count"
            held = Counter(p for ls in self._leases.values() for p in ls.pages)
            assert all(self._leased[p] == held.get(p, 0) for p in range(self.num_pages)), \
                "lease counts differ from the open leases"
            used = set(np.flatnonzero(owners).tolist()) - leased
            assert not (free & lru) and not (free & used) and not (lru & used)
            assert not (leased & (free | lru)), "a leased page is free or evictable"
            assert len(free) + len(lru) + len(used) + len(leased) == self.num_pages, \
                "page leaked"
            p = self._prefix
            assert all(q in p.page_key and self._refcount[q] == 0 for q in lru)
            assert not any(q in p.page_key for q in free)
            assert {page for _, page in p.table.values()} == set(p.page_key)
            if self.prefix_caching:
                for sid in np.flatnonzero(self._claimed):
                    assert len(self._keys[sid]) == int(self._lengths[sid]) // self.page_size \
                        or self._pending[sid] >= 0
