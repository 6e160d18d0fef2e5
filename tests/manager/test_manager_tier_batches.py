"""The host tier moves pages in batches (issue 17 items 5, 7): an allocation that evicts k cached
pages demotes them with one gather and one copy, a prefix hit promotes the pages it finds with
one copy and one scatter; the bytes come back equal and in order (float and quantized caches),
batched puts keep the LRU order and counters of page-by-page puts, the slots a promotion reads
are never given away meanwhile, and a failure mid-way changes nothing (or, for the host pool,
drops only the entries whose slots were being overwritten)."""

import random
from collections import OrderedDict

import numpy as np
import pytest
import torch

from kvtvm import KVCacheParams
from kvtvm.manager import BatchItem, PagedKVCacheManager
from kvtvm.manager.hosttier import HostTier

H, D, L, P = 2, 4, 2, 4
SYS = list(range(500, 516))  # 4 full pages
OTHER = list(range(900, 916))


def make(pages, quantized=False):
    kw = dict(cache_dtype="int8") if quantized else {}
    mgr = PagedKVCacheManager(
        KVCacheParams("float16" if quantized else "float32", H, 16 if quantized else D,
                      "paged", page_size=P, enable_prefix_caching=True, **kw),
        2, 32, L, num_pages=pages)
    return mgr


def fill(mgr, pages):
    """Fresh random bytes in ``pages`` (every page distinct, so an order mix-up shows)."""
    b = mgr.blocks[0]
    for p in pages:
        if b.dtype == torch.uint8:
            b[p].copy_(torch.randint(0, 256, b[p].shape, dtype=torch.uint8))
        else:
            b[p].copy_(torch.randn(b[p].shape))


def serve(mgr, toks):
    """Prefill ``toks`` (random K/V in the pages it computes), release; (hit tokens, the K/V
    of its full pages in sequence order)."""
    (s,) = mgr.claim(1)
    inp = mgr.fetch([BatchItem(s, toks)])[0]
    hit = int(inp.num_cached_tokens[0])
    fill(mgr, mgr.pages_of(s)[hit // P:])
    mgr.step([BatchItem(s, toks)])
    kv = mgr.blocks[0][mgr.pages_of(s)[:len(toks) // P]].clone()
    mgr.release(s)
    mgr.check_invariants()
    return hit, kv


class Spy:
    """Counts the gathers of demotions and the copies in and out of the host pool."""

    def __init__(self, mgr, monkeypatch):
        self.rows, self.writes, self.reads, self.scatters = [], [], [], []
        for obj, name, log in ((mgr, "_page_rows", self.rows), (mgr, "_scatter", self.scatters),
                               (HostTier, "_write", self.writes), (HostTier, "read", self.reads)):
            real = getattr(obj, name)

            def spy(*a, _real=real, _log=log, **k):
                _log.append(a)
                return _real(*a, **k)
            monkeypatch.setattr(obj, name, spy)


@pytest.mark.parametrize("quantized", [False, True])
def test_eviction_demotes_together_and_a_hit_promotes_the_same_bytes_in_order(quantized,
                                                                             monkeypatch):
    mgr = make(5, quantized)
    mgr.attach_tiers(host_pages=8)
    _, want = serve(mgr, SYS + [1])  # 4 cached pages (the 5th, partial, freed)
    spy = Spy(mgr, monkeypatch)
    serve(mgr, OTHER + [1])  # needs 5 pages, 1 free: the 4 cached pages go down together
    assert len(spy.rows) == 1 and len(spy.rows[0][0]) == 4  # one gather of the 4 pages
    assert len(spy.writes) == 1 and spy.writes[0][1] == [0, 1, 2, 3]  # one run of slots
    host = mgr.stats().tiers["host"]
    assert (host["demotions"], host["entries"], host["evictions"]) == (4, 4, 0)
    spy.scatters.clear()
    hit, got = serve(mgr, SYS + [2])  # the 4 pages come back: one read, one scatter
    assert hit == 16 and torch.equal(got, want)
    assert len(spy.reads) == 1 and len(spy.reads[0][1]) == 4
    assert sum(len(a[1]) for a in spy.scatters) == 4 and len(spy.scatters) == 1
    host = mgr.stats().tiers["host"]
    # misses: the first page of each of the first two prompts
    assert (host["hits"], host["promotions"], host["misses"], host["rejected"]) == (4, 4, 2, 0)
    assert host["bytes"] == host["entries"] * mgr.params.bytes_per_page(L)


def reference_puts(capacity, batches):
    """Page-by-page puts into a plain LRU dict: {hash: data} in LRU order, and counters."""
    index, dem, ev = OrderedDict(), 0, 0
    for batch in batches:
        for h, data in batch:
            if h in index:
                del index[h]
            elif len(index) == capacity:
                index.popitem(last=False)
                ev += 1
            index[h] = data
            dem += 1
    return index, dem, ev


@pytest.mark.parametrize("seed", range(4))
def test_batched_puts_keep_the_lru_order_and_counters_of_page_by_page_puts(seed):
    rng = random.Random(seed)
    cap = rng.randint(1, 6)
    tier = HostTier(cap)
    batches, page = [], 0
    for _ in range(8):  # batches larger than the tier, repeated hashes, fresh bytes each time
        batch = []
        for _ in range(rng.randint(1, 2 * cap + 1)):
            batch.append((rng.randint(0, 9), torch.randn(3, 2)))
        batches.append(batch)
        rows = torch.stack([d for _, d in batch])
        pages = list(range(page, page + len(batch)))[::rng.choice([1, -1])]  # any page order
        page += len(batch)
        by_page = dict(zip(pages, rows))
        items = [(h, h * 7, bytes([h]), p) for (h, _), p in zip(batch, pages)]
        tier.put_many(items, lambda ps: torch.stack([by_page[p] for p in ps]))
    want, dem, ev = reference_puts(cap, batches)
    assert list(tier._index) == list(want)  # same entries, same LRU order
    st = tier.stats()
    assert (st["entries"], st["demotions"], st["evictions"]) == (len(want), dem, ev)
    for h, data in want.items():
        assert torch.equal(tier.get(h, h * 7, bytes([h])), data)
    assert sorted(tier._slots + [v[0] for v in tier._index.values()]) == list(range(cap))


def test_full_host_tier_evicts_the_least_recently_used_pages():
    mgr = make(5)
    mgr.attach_tiers(host_pages=4)
    _, want = serve(mgr, SYS + [1])
    serve(mgr, OTHER + [1])  # SYS's 4 pages go down, deepest first: host S3 S2 S1 S0
    # SYS's first 2 pages come back (S0, S1 most recent); the 2 pages this takes evict
    # OTHER's oldest cached pages, whose demotion pushes S3 then S2 out of the host tier
    assert serve(mgr, SYS[:8] + [3])[0] == 8
    # 4 more evictions in one batch (OTHER's last 2, then S1, S0): page by page, each push
    # out the oldest entry, so the host tier ends with OTHER's O1 O0 and SYS's S1 S0
    serve(mgr, list(range(700, 716)) + [1])
    host = mgr.stats().tiers["host"]
    assert (host["demotions"], host["evictions"], host["entries"]) == (10, 6, 4)
    hit, got = serve(mgr, SYS + [4])  # S0 S1 from the host tier, S2 gone
    assert hit == 8 and torch.equal(got[:2], want[:2])


def test_slots_a_promotion_reads_are_not_given_to_its_own_evictions():
    mgr = make(4)  # 4 pages: serving one prompt evicts everything the other left
    mgr.attach_tiers(host_pages=3)
    _, want = serve(mgr, SYS[:12] + [1])  # 3 cached pages
    serve(mgr, OTHER[:12] + [1])  # SYS's 3 pages down: the host tier is full
    # the promotion takes 3 pages, evicting OTHER's cached pages: their demotion must not
    # overwrite the 3 slots being promoted (the host tier keeps them instead)
    hit, got = serve(mgr, SYS[:12] + [2])
    assert hit == 12 and torch.equal(got, want)
    assert mgr.stats().tiers["host"]["evictions"] >= 2


def state(mgr):
    """Everything a failed fetch must leave as it was (the host tier's lookups -- the miss
    of the new prompt's first page -- do count)."""
    st = mgr.stats()
    host = mgr._tiers.host
    counters = {k: v for k, v in host.stats().items() if k != "misses"}
    return (mgr._page_table.tolist(), list(mgr._free), dict(mgr._prefix.table),
            list(mgr._prefix.lru), mgr._refcount.tolist(), st.pages_cached, st.evictions,
            list(host._index.items()), sorted(host._slots), counters)


@pytest.mark.parametrize("prompt,evicted", [(OTHER + [1], 4),  # evicts all of SYS
                                           (SYS[:8] + OTHER[:8] + [1], 2)])  # hits 2 first
def test_failed_gather_during_a_batched_demote_changes_nothing(prompt, evicted, monkeypatch):
    mgr = make(5)
    mgr.attach_tiers(host_pages=8)
    serve(mgr, SYS + [1])
    (s,) = mgr.claim(1)
    before = state(mgr)

    def broken(pages):
        raise RuntimeError("device gone")
    monkeypatch.setattr(mgr, "_page_rows", broken)
    with pytest.raises(RuntimeError, match="device gone"):
        mgr.fetch([BatchItem(s, prompt)])
    assert state(mgr) == before  # the prefix hits taken before the eviction are undone too
    mgr.check_invariants()
    monkeypatch.undo()
    mgr.fetch([BatchItem(s, prompt)])  # works once the device is back
    mgr.check_invariants()
    assert mgr.stats().tiers["host"]["demotions"] == evicted


def test_failed_copy_into_the_pool_drops_only_the_slots_it_overwrote():
    tier = HostTier(4)
    data = {h: torch.randn(2, 3) for h in range(6)}
    tier.put_many([(h, h, b"t", h) for h in range(4)], lambda ps: torch.stack(
        [data[p] for p in ps]))
    before = dict(tier._index)
    with pytest.raises(RuntimeError):  # rows of the wrong shape: the copy fails
        tier.put_many([(h, h, b"t", h) for h in (4, 5)], lambda ps: torch.zeros(2, 5))
    st = tier.stats()
    assert st["entries"] == 2 and st["demotions"] == 4 and st["evictions"] == 2
    assert 4 not in tier and 5 not in tier  # never stored
    for h in (2, 3):  # the entries not being overwritten stay, whole
        assert tier._index[h] == before[h] and torch.equal(tier.get(h, h, b"t"), data[h])
    assert tier.get(0, 0, b"t") is None and tier.get(1, 1, b"t") is None
    tier.put_many([(h, h, b"t", h) for h in (4, 5)], lambda ps: torch.stack(
        [data[p] for p in ps]))  # the dropped slots are free again
    assert all(torch.equal(tier.get(h, h, b"t"), data[h]) for h in (2, 3, 4, 5))


def test_failed_copy_into_the_pool_leaves_the_manager_unchanged(monkeypatch):
    mgr = make(5)
    mgr.attach_tiers(host_pages=8)
    serve(mgr, SYS + [1])
    serve(mgr, OTHER + [1])  # SYS down a tier (the pool exists), OTHER's pages cached
    (s,) = mgr.claim(1)
    before = state(mgr)
    real = mgr._page_rows
    monkeypatch.setattr(mgr, "_page_rows", lambda pages: real(pages)[..., :-1])  # bad shape
    with pytest.raises(RuntimeError):
        mgr.fetch([BatchItem(s, list(range(700, 716)) + [1])])
    assert state(mgr) == before  # OTHER's pages were going to free slots: nothing dropped
    mgr.check_invariants()


@pytest.mark.parametrize("where", ["read", "scatter"])
def test_failed_batched_promote_registers_nothing_and_leaks_nothing(where, monkeypatch):
    mgr = make(5)
    mgr.attach_tiers(host_pages=8)
    _, want = serve(mgr, SYS + [1])
    serve(mgr, OTHER + [1])  # SYS down a tier
    (s,) = mgr.claim(1)
    table, cached = dict(mgr._prefix.table), mgr.stats().pages_cached

    def broken(*a, **k):
        raise RuntimeError(f"{where} failed")
    if where == "read":
        monkeypatch.setattr(HostTier, "read", broken)
    else:
        monkeypatch.setattr(mgr, "_scatter", broken)
    with pytest.raises(RuntimeError, match="failed"):
        mgr.fetch([BatchItem(s, SYS + [2])])
    mgr.check_invariants()
    assert mgr.contains(s) and mgr.pages_of(s) == []
    assert set(mgr._prefix.table) <= set(table)  # nothing registered
    if where == "read":  # failed before any page was taken: the device side as it was
        assert mgr._prefix.table == table and mgr.stats().pages_cached == cached
    assert not mgr._tiers.host.held
    monkeypatch.undo()
    inp = mgr.fetch([BatchItem(s, SYS + [2])])[0]  # the host tier still holds the pages
    assert int(inp.num_cached_tokens[0]) == 16
    assert torch.equal(mgr.blocks[0][mgr.pages_of(s)[:4]], want)
    mgr.check_invariants()


def test_persist_writes_every_page_from_one_gather(tmp_path, monkeypatch):
    mgr = make(6)
    mgr.attach_tiers(disk_dir=tmp_path, disk_bytes=1 << 20)
    _, want = serve(mgr, SYS + [1])
    spy = Spy(mgr, monkeypatch)
    assert mgr.persist_prefix_cache() == 4 and len(spy.rows) == 1
    fresh = make(6)
    fresh.attach_tiers(disk_dir=tmp_path, disk_bytes=1 << 20)
    hit, got = serve(fresh, SYS + [2])
    assert hit == 16 and torch.equal(got, want)
    mgr.close_tiers(), fresh.close_tiers()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quantized", [False, True])
def test_cuda_round_trip_through_the_pinned_pool(quantized):
    kw = dict(cache_dtype="int8") if quantized else {}
    mgr = PagedKVCacheManager(
        KVCacheParams("float16", H, 16, "paged", page_size=P, enable_prefix_caching=True,
                      **kw), 2, 32, L, devices=("cuda",), num_pages=5)
    mgr.attach_tiers(host_pages=8)
    _, want = serve(mgr, SYS + [1])
    serve(mgr, OTHER + [1])
    assert mgr._tiers.host._pool.is_pinned()
    mgr.blocks[0].zero_()  # the device copies are gone: only the pinned pool holds SYS
    hit, got = serve(mgr, SYS + [2])
    torch.cuda.synchronize()
    assert hit == 16 and torch.equal(got.cpu(), want.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_demote_on_a_side_stream_then_promote_on_the_default_one():
    mgr = PagedKVCacheManager(
        KVCacheParams("float16", H, 16, "paged", page_size=P, enable_prefix_caching=True),
        2, 32, L, devices=("cuda",), num_pages=5)
    mgr.attach_tiers(host_pages=8)
    _, want = serve(mgr, SYS + [1])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        serve(mgr, OTHER + [1])  # SYS demoted asynchronously on the side stream
    # the promotion's copies wait for the side stream's event on the GPU; its scatter
    # rewrites SYS's old pages only after the demotion has read them
    hit, got = serve(mgr, SYS + [2])
    torch.cuda.synchronize()
    assert hit == 16 and torch.equal(got.cpu(), want.cpu())
    assert torch.equal(mgr._tiers.host.get(*entry_of(mgr, SYS[:P])).cpu(), want[0].cpu())


def entry_of(mgr, chunk):
    """(hash, fingerprint, token bytes) of a prompt's first page."""
    from kvtvm.manager.hashing import chain_hash, fingerprint

    toks = np.asarray(chunk, np.int64).tobytes()
    h, fp = mgr._root_chain()
    return chain_hash(h, toks, mgr.hash_bits), fingerprint(fp, toks), toks
