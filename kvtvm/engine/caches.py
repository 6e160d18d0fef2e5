"""The engine's cache backends: one small adapter per kvtvm manager.

Each adapter turns the engine's verbs (can this request be admitted, add it, fetch this step's
inputs, commit the step, release finished requests, how many bytes are live) into its manager's
own verbs: seed 002's claim / fetch / step / release for the CONTINUOUS and PAGED managers, seed
004's active batch size / step_inputs / commit / evict for the LINEAR cache.
"""

from __future__ import annotations

import numpy as np

from ..manager import (BatchItem, ContinuousBatchingKVCacheManager, LinearKVCache,
                       PagedKVCacheManager, TokenBatch)

__all__ = ["CACHE_CHOICES", "make_cache"]

CACHE_CHOICES = ("paged", "continuous", "linear")


def make_cache(cache: str, params, max_batch_size: int, max_seq_len: int, num_layers: int,
               device, num_pages: int | None):
    """The adapter of ``cache`` (one of :data:`CACHE_CHOICES`) over a new manager."""
    if cache == "linear":
        return _LinearCache(params, max_batch_size, max_seq_len, num_layers, device)
    return _TableCache(cache, params, max_batch_size, max_seq_len, num_layers, device, num_pages)


class _TableCache:
    """CONTINUOUS and PAGED: the seed-002 verbs claim / fetch / step / release."""

    def __init__(self, cache: str, params, max_batch_size, max_seq_len, num_layers, device,
                 num_pages):
        self.paged = cache == "paged"
        if self.paged:
            self.mgr = PagedKVCacheManager(params, max_batch_size, max_seq_len, num_layers,
                                           devices=(device,), num_pages=num_pages)
        else:
            self.mgr = ContinuousBatchingKVCacheManager(params, max_batch_size, max_seq_len,
                                                        num_layers, devices=(device,))
        self.params, self.num_layers = params, num_layers
        self.page_size = params.page_size if self.paged else max_seq_len

    def pages(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def never_fits(self, req) -> str:
        if self.paged and self.pages(req.length) > self.mgr.num_pages:
            return (f"needs {self.pages(req.length)} pages of {self.page_size} tokens, the "
                    f"whole pool holds {self.mgr.num_pages}")
        return ""

    def cached_prefix(self, req) -> int:
        """Prompt tokens of the fresh ``req`` its first fetch takes from the prefix cache."""
        if not self.params.enable_prefix_caching:
            return 0
        return self.mgr.cached_prefix_tokens(req.prompt)

    def can_admit(self, req, running) -> bool:
        """A free slot, and (paged) enough free or evictable pages for the request to reach
        its final length on top of what the running requests may still need."""
        if not self.mgr.slots_remaining:
            return False
        if not self.paged:
            return True
        st = self.mgr.stats()
        reserved = sum(self.pages(r.length) - len(self.mgr.pages_of(r.seq_id))
                       if r.seq_id >= 0 else self.pages(r.length) for r in running)
        return st.pages_free + st.pages_cached - reserved >= self.pages(req.length)

    def add(self, req) -> None:
        (req.seq_id,) = self.mgr.claim(1)

    def remove(self, new) -> None:
        """Undo :meth:`add` of requests that were never fetched."""
        for r in new:
            self.mgr.release(r.seq_id)

    @staticmethod
    def _batch(reqs, tokens):
        """The batch in the form a manager takes: a decode step (one token each) as a
        ``TokenBatch`` of arrays -- no Python object per sequence --, others as seed 002's
        list of ``BatchItem``."""
        if all(len(t) == 1 for t in tokens):
            return TokenBatch([r.seq_id for r in reqs], [t[0] for t in tokens])
        return [BatchItem(r.seq_id, t) for r, t in zip(reqs, tokens)]

    def fetch(self, reqs, tokens):
        return self.mgr.fetch(self._batch(reqs, tokens))[0]

    def commit(self, reqs, tokens):
        self.mgr.step(self._batch(reqs, tokens))

    def finish(self, reqs, finished) -> None:
        for r in finished:  # (those an interrupted finish released already are skipped)
            if self.mgr.contains(r.seq_id):
                self.mgr.release(r.seq_id)

    def live_bytes(self, running) -> int:
        if self.paged:
            return self.mgr.stats().pages_used * self.params.bytes_per_page(self.num_layers)
        return (sum(self.mgr.cache_length(r.seq_id) for r in running if r.seq_id >= 0)
                * self.params.bytes_per_token(self.num_layers))

    def allocated_bytes(self) -> int:
        return self.mgr.device_nbytes()


class _LinearCache:
    """LINEAR (seed 004): batch slot b holds the b-th running request.

    A new request takes the next slot (``set_active_batch_size``); finished requests are
    removed by ``evict``, which moves the kept ones to the front with the copy kernel, so the
    running list and the slots stay in the same order.
    """

    def __init__(self, params, max_batch_size, max_seq_len, num_layers, device):
        self.mgr = LinearKVCache(params, max_batch_size, max_seq_len, num_layers,
                                 devices=(device,))
        self.params, self.num_layers = params, num_layers
        self.mgr.reset_for_new_sequences([])

    def never_fits(self, req) -> str:
        return ""

    def cached_prefix(self, req) -> int:
        return 0

    def can_admit(self, req, running) -> bool:
        return self.mgr.active_batch_size < self.mgr.max_batch_size

    def add(self, req) -> None:
        req.seq_id = self.mgr.active_batch_size
        self.mgr.set_active_batch_size(req.seq_id + 1)

    def remove(self, new) -> None:
        """Undo :meth:`add` of the last requests (never fetched)."""
        self.mgr.set_active_batch_size(self.mgr.active_batch_size - len(new))

    def fetch(self, reqs, tokens):
        assert [r.seq_id for r in reqs] == list(range(len(reqs))), "slots out of order"
        return self.mgr.step_inputs([len(t) for t in tokens])[0]

    def commit(self, reqs, tokens):
        self.mgr.commit_sequence_length(np.array([len(t) for t in tokens], dtype=np.int64))

    def finish(self, reqs, finished) -> None:
        if not finished:
            return
        gone = {id(r) for r in finished}
        keep = [b for b, r in enumerate(reqs) if id(r) not in gone]
        self.mgr.evict(keep)
        for b, r in enumerate(r for r in reqs if id(r) not in gone):
            r.seq_id = b

    def live_bytes(self, running) -> int:
        return int(self.mgr.host_lengths.sum()) * self.params.bytes_per_token(self.num_layers)

    def allocated_bytes(self) -> int:
        return self.mgr.device_nbytes()

