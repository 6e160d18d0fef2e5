"""Chained hashes of the paged manager's cached pages: how a peer or a lower tier names them.

Inside the process the prefix cache keys a page by its parent's key id and its tokens
(:mod:`.prefix_cache`); across processes and tiers a page is named by its chained block hash
(:mod:`.hashing`). This mixin keeps the two in step for
:class:`~kvtvm.manager.PagedKVCacheManager`: the hash (and fingerprint) of a cached key,
memoized per key id (:meth:`PrefixHashMixin._chain_of`), and the index a peer's lookup by
hashes walks (:meth:`PrefixHashMixin._hash_index`), kept up to date as pages are cached and
evicted rather than rebuilt per lookup.
"""

from __future__ import annotations

from ..errors import InvalidArgumentError, describe
from .args import check_hashes
from .hashing import DEFAULT_HASH_BITS, HASH_SEED, chain_hash, fingerprint
from .hashing import block_hashes as _block_hashes

__all__ = ["PrefixHashMixin"]


class PrefixHashMixin:
    """Hashes of cached pages and the peer-facing lookup by hashes (needs ``_prefix``,
    ``params``, ``num_layers``, ``num_pages``, ``_lock`` and, optionally, ``_tiers``)."""

    #: Width of the chained block hashes this cache names its pages by (a test narrows it).
    hash_bits: int = DEFAULT_HASH_BITS

    def _init_prefix_hashes(self) -> None:
        self._chain_memo: dict[int, tuple[int, int]] = {}  # key id -> (hash, fingerprint)
        self._memo_bits = self.hash_bits

    def _root_chain(self) -> tuple[int, int]:
        """(hash, fingerprint) of the empty prefix: seeded by the storage format, so pages of
        two formats never share a name (in a shared disk tier, say)."""
        key = self.params.storage_key(self.num_layers).encode()
        return chain_hash(HASH_SEED, key, self.hash_bits), fingerprint(HASH_SEED, key)

    def _chain_of(self, kid: int):
        """(hash, fingerprint) of prefix-cache key ``kid``, or None if its chain is gone."""
        memo = self._chain_memo
        if self._memo_bits != self.hash_bits:
            memo.clear()
            self._memo_bits = self.hash_bits
        root = self._prefix.root
        if kid == root:
            return self._root_chain()
        hit = memo.get(kid)
        if hit is not None:
            return hit
        by_id = self._prefix.by_id
        chain = []
        while kid != root and kid not in memo:
            key = by_id.get(kid)
            if key is None:
                return None
            chain.append((kid, key[1]))
            kid = key[0]
        h, fp = memo[kid] if kid != root else self._root_chain()
        for k, chunk in reversed(chain):
            h, fp = chain_hash(h, chunk, self.hash_bits), fingerprint(fp, chunk)
            memo[k] = (h, fp)
        if len(memo) > 4 * self.num_pages + 64:  # forget keys no longer cached
            for k in [k for k in memo if k not in by_id]:
                del memo[k]
        return h, fp

    def _hash_index(self) -> dict:
        """``{(parent key id, hash): (key id, page, token bytes)}``: the cached pages by the
        key id of their parent (the root for page 0) and their chained hash (with a narrow
        hash, of two siblings sharing one the newest is kept: the other is a miss).

        Kept up to date, not rebuilt per lookup: a call indexes the keys inserted since the
        last one (key ids only grow and ``by_id`` holds them in order, so a parent comes
        before its children); an entry whose key was evicted since is dropped when a lookup
        meets it (:meth:`_child_by_hash`). It is built again from scratch when it remembers
        twice as many keys as are cached (amortized: one eviction is one stale entry), when
        the hash width changed or a transaction restored the cache."""
        p = self._prefix
        state = getattr(self, "_index_cache", None)
        by_id, bits = p.by_id, self.hash_bits
        if state is None or state[0] is not by_id or state[1] != bits \
                or len(state[4]) > 2 * len(by_id) + 64:
            index, hashes, new = {}, {}, list(by_id)
        else:
            index, hashes, new, seen = state[3], state[4], [], state[2]
            for kid in reversed(by_id):
                if kid < seen:
                    break
                new.append(kid)
            new.reverse()
        table, root, root_hash = p.table, p.root, self._root_chain()[0]
        for kid in new:
            key = by_id[kid]
            parent_hash = root_hash if key[0] == root else hashes.get(key[0])
            if parent_hash is None:  # its parent is gone: unreachable
                continue
            h = hashes[kid] = chain_hash(parent_hash, key[1], bits)
            index[(key[0], h)] = (kid, table[key][1], key[1])
        self._index_cache = (by_id, bits, p.next_id, index, hashes)
        return index

    def _child_by_hash(self, index: dict, parent, h: int):
        """The cached page chained to ``parent`` (a key id, or the root) whose hash is ``h``:
        ``(key id, page, token bytes)``, or None."""
        hit = index.get((parent, h))
        if hit is not None and hit[0] not in self._prefix.by_id:  # evicted since indexed
            del index[(parent, h)]
            return None
        return hit

    def held_prefix_pages(self, block_hashes) -> int:
        """How many leading pages of ``block_hashes`` this cache holds (device pool, then the
        lower tiers): what a peer asks before sending. A hash answers only "probably": the
        import checks tokens, so a collision costs a resend, never wrong KV."""
        block_hashes = check_hashes("block_hashes", block_hashes)
        with self._lock:
            index = self._hash_index()
            parent, n = self._prefix.root, 0
            for h in block_hashes:
                hit = self._child_by_hash(index, parent, int(h))
                if hit is None:
                    break
                parent, n = hit[0], n + 1
            tiers = getattr(self, "_tiers", None)
            if tiers is not None:
                n += tiers.count_prefix([int(h) for h in block_hashes[n:]])
            return n

    def block_hashes_of(self, seq_id: int) -> list[int]:
        """Chained hashes of the full pages of ``seq_id`` (prefix caching on): what a peer is
        asked about before sending."""
        with self._lock:
            sid = self._check_known(seq_id, "block_hashes_of")
            if not self.prefix_caching:
                raise InvalidArgumentError(describe(
                    "block_hashes_of: params.enable_prefix_caching", True, False))
            toks = self._tokens[sid, :int(self._lengths[sid])]
            return _block_hashes(toks, self.page_size, self.hash_bits, self._root_chain()[0])
