"""Prefix cache of the paged manager: full pages keyed by a chained key of their tokens.

The key of a sequence's page ``i`` is ``(key id of page i-1, bytes of the page's tokens)``
(for page 0, the cache's ``root``: its storage format, ``KVCacheParams.storage_key``, so pages
of two formats -- storage types, skipped layers -- never alias): a chained hash where the dict's equality check compares the tokens exactly,
so two prompts share a page only if they agree on *every* token up to the page's end (no hash
collision can alias two prefixes). Each key gets a fresh integer id when it is inserted; ids are
never reused, so a child whose parent was evicted can no longer be reached.

Pages are refcounted by the manager (one reference per sequence whose page list holds the page).
A cached page whose refcount drops to 0 stays cached and joins an LRU list; it is evicted (its
key dropped, the page reused) only when the free list is empty. A sequence's pages join the LRU
list deepest page first, so a released prompt loses its tail before its root.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

__all__ = ["PrefixCache", "PagedCacheStats"]


@dataclass(frozen=True)
class PagedCacheStats:
    """Pages and prefix-cache counters of a :class:`PagedKVCacheManager`.

    Attributes
    ----------
    pages_total : int
        Pages in the pool.
    pages_used : int
        Pages referenced by at least one sequence.
    pages_free : int
        Pages on the free list (hold nothing).
    pages_cached : int
        Pages referenced by no sequence but kept for the prefix cache (evictable, LRU).
    pages_shared : int
        Pages referenced by more than one sequence (prefix hits, forks).
    prefix_queries : int
        New sequences looked up in the prefix cache.
    prefix_query_tokens, prefix_hit_tokens : int
        Prompt tokens looked up, and tokens served from the cache (skipped by the model).
    prefix_hit_rate : float
        ``prefix_hit_tokens / prefix_query_tokens`` (0 when nothing was looked up).
    evictions : int
        Cached pages evicted to make room.
    pages_leased : int
        Pages held by an export or import lease (not freeable, evictable or writable);
        ``pages_free + pages_used + pages_cached + pages_leased == pages_total``.
    tiers : dict
        Per lower tier (``"host"``, ``"disk"``): capacity, entries, bytes, hits, misses,
        demotions, promotions, rejected (failed content or checksum checks).
    """

    pages_total: int
    pages_used: int
    pages_free: int
    pages_cached: int
    pages_shared: int
    prefix_queries: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float
    evictions: int
    pages_leased: int = 0
    tiers: dict = field(default_factory=dict)


class PrefixCache:
    """Key -> page map of full pages, with the LRU list of unreferenced cached pages."""

    def __init__(self, root="-"):
        #: Parent key of every sequence's page 0: the cache's storage format.
        self.root = root
        self.table: dict[tuple, tuple[int, int]] = {}    # key -> (key id, page)
        self.page_key: dict[int, tuple] = {}               # cached page -> its key
        self.by_id: dict[int, tuple] = {}                  # key id -> key, ids ascending
        self.lru: OrderedDict[int, None] = OrderedDict()   # refcount-0 cached pages, oldest first
        self.next_id = 0
        self.queries = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0

    # -- lookups ------------------------------------------------------------------------------
    def lookup(self, token_bytes: list[bytes]) -> tuple[list[int], list[int]]:
        """Longest cached chain of the given full pages: (pages, key ids)."""
        pages, ids = [], []
        parent = self.root
        table = self.table
        for chunk in token_bytes:
            hit = table.get((parent, chunk))
            if hit is None:
                break
            parent, page = hit
            ids.append(parent)
            pages.append(page)
        return pages, ids

    def insert(self, parent, chunk: bytes, page: int) -> int:
        """Register ``page`` under ``(parent, chunk)``; if the key is cached already (by
        another page with the same content), keep that one. Returns the key id."""
        key = (parent, chunk)
        hit = self.table.get(key)
        if hit is not None:
            return hit[0]
        kid = self.next_id
        self.next_id = kid + 1
        if page in self.page_key:  # the page is cached under another key (defensive)
            return kid  # a fresh id nobody holds: this page's children are never reached
        self.table[key] = (kid, page)
        self.page_key[page] = key
        self.by_id[kid] = key
        return kid

    def unregister(self, page: int) -> None:
        """Drop ``page``'s key (it is about to be overwritten or reused)."""
        key = self.page_key.pop(page)
        del self.by_id[self.table.pop(key)[0]]
        self.lru.pop(page, None)

    def evict_one(self) -> int:
        """Evict the least recently used unreferenced cached page; returns it."""
        page, _ = self.lru.popitem(last=False)
        key = self.page_key.pop(page)
        del self.by_id[self.table.pop(key)[0]]
        self.evictions += 1
        return page

    # -- transactions -------------------------------------------------------------------------
    def snapshot(self):
        return (dict(self.table), dict(self.page_key), OrderedDict(self.lru), dict(self.by_id),
                self.queries, self.query_tokens, self.hit_tokens, self.evictions)

    def restore(self, snap) -> None:
        """Back to ``snap``; ``next_id`` is not rolled back: an id handed out once (and
        memoized with its hash) never names another key."""
        (self.table, self.page_key, self.lru, self.by_id, self.queries,
         self.query_tokens, self.hit_tokens, self.evictions) = snap
