"""PagedKVCacheManager: page allocation, prefix caching, LRU eviction, fork/copy-on-write, pop."""

import numpy as np
import pytest
import torch

from kvtvm import KVCacheParams, ops
from kvtvm.collection import PagedKVCacheCollection
from kvtvm.errors import (InvalidArgumentError, KVCacheCapacityError, SequenceStateError,
                          UnknownSequenceError)
from kvtvm.inputs import BatchItem
from kvtvm.manager import PagedKVCacheManager

H, D, L, P = 2, 8, 2, 4


def params(prefix=False, page_size=P):
    return KVCacheParams("float32", H, D, "paged", page_size=page_size,
                         enable_prefix_caching=prefix)


def make(mb=4, max_seq_len=32, num_pages=None, prefix=False, devices=("cpu",)):
    mgr = PagedKVCacheManager(params(prefix), mb, max_seq_len, L, devices, num_pages=num_pages)
    for b in mgr.blocks:  # random garbage, so a missed write or copy cannot pass as zeros
        b.copy_(torch.randn(b.shape))
    return mgr


class Writer:
    """Runs fetch -> append_kv (real kernel) -> step and keeps a dense shadow of K/V.

    K/V of a token are a function of the whole prefix up to it, as in a real model, so a
    prefix-cache hit must find exactly the values this sequence would have written.
    """

    def __init__(self, mgr):
        self.mgr = mgr
        self.tokens = {}  # seq -> committed token list

    @staticmethod
    def kv_of(prefix):
        rng = np.random.default_rng(abs(hash(tuple(prefix))) % (2 ** 32))
        return rng.standard_normal((L, 2, H, D)).astype(np.float32)

    def run(self, batch_tokens, num_steps=1):
        """batch_tokens: list of (seq, new tokens). Returns the fetched inputs (device 0)."""
        for s, _ in batch_tokens:
            if self.mgr.cache_length(s) == 0:  # new (or reclaimed, or popped to empty)
                self.tokens[s] = []
        batch = [BatchItem(s, list(t)) for s, t in batch_tokens]
        per_dev = self.mgr.fetch(batch, num_steps=num_steps)
        inp = per_dev[0]
        rows = []
        for b, (s, toks) in enumerate(batch_tokens):
            prev = self.tokens.get(s, [])
            skip = inp.num_cached_tokens[b]
            full = prev + list(toks)
            for i in range(skip, len(toks)):
                rows.append(self.kv_of(full[:len(prev) + i + 1]))
        kv = np.stack(rows, axis=2)  # [L, 2, T, H, D]
        for dev, di in enumerate(per_dev):
            c = di.collection()
            hs = slice(dev * H // len(per_dev), (dev + 1) * H // len(per_dev))
            for layer in range(L):
                ops.append_kv(c.get_key_cache(layer).blocks, c.get_value_cache(layer).blocks,
                              torch.tensor(kv[layer, 0][:, hs]), torch.tensor(kv[layer, 1][:, hs]),
                              di.qo_indptr, di.cache_lengths, di.lookup_table)
        self.mgr.step(batch)
        for s, toks in batch_tokens:
            self.tokens[s] = self.tokens.get(s, []) + list(toks)
        return inp

    def check(self, seq):
        """K/V read back through the page table equal the shadow."""
        toks = self.tokens[seq]
        assert self.mgr.cache_length(seq) == len(toks)
        pages = self.mgr.pages_of(seq)
        for t in range(len(toks)):
            want = self.kv_of(toks[:t + 1])
            page, slot = pages[t // P], t % P
            got = np.concatenate([b[page, :, :, slot].numpy() for b in self.mgr.blocks],
                                 axis=-2)  # [2, L, H, D]
            assert np.array_equal(got.transpose(1, 0, 2, 3), want), (seq, t)

    def pop(self, seq, n):
        self.mgr.pop(seq, n)
        self.tokens[seq] = self.tokens[seq][:len(self.tokens[seq]) - n]

    def fork(self, seq):
        new = self.mgr.fork(seq)
        self.tokens[new] = list(self.tokens[seq])
        return new


# -- sizes -----------------------------------------------------------------------------------

def test_shape_num_pages_and_memory_estimate():
    mgr = make(mb=3, max_seq_len=10)  # ceil(10 / 4) = 3 pages per sequence
    assert mgr.num_pages == 9 and mgr.max_pages_per_seq == 3
    assert tuple(mgr.blocks[0].shape) == (9, 2, L, P, H, D)
    est = PagedKVCacheManager.estimated_memory_size(params(), 3, 10, L)
    assert est == mgr.device_nbytes() == 9 * 2 * L * P * H * D * 4 + 4 * (3 + 4 + 9)
    mem = 50_000
    est = PagedKVCacheManager.estimated_memory_size(params(), 3, 10, L,
                                                    available_cache_memory=mem)
    m2 = PagedKVCacheManager(params(), 3, 10, L, available_cache_memory=mem)
    assert est == m2.device_nbytes() <= mem
    assert est + 2 * L * P * H * D * 4 > mem  # one more page would not fit
    with pytest.raises(KVCacheCapacityError, match="holds no page"):
        PagedKVCacheManager(params(), 3, 10, L, available_cache_memory=100)
    b = PagedKVCacheManager.infer_optimal_batch_size(params(), 10, L, mem)
    assert PagedKVCacheManager.estimated_memory_size(params(), b, 10, L) <= mem
    assert PagedKVCacheManager.estimated_memory_size(params(), b + 1, 10, L) > mem


# -- allocation ------------------------------------------------------------------------------

def test_fetch_allocates_only_needed_pages_and_writes_land():
    mgr = make(mb=3, max_seq_len=32)
    w = Writer(mgr)
    a, b = mgr.claim(2)
    rng = np.random.default_rng(0)
    inp = w.run([(a, rng.integers(0, 50, 5).tolist()), (b, [1])])
    assert isinstance(inp.collection(), PagedKVCacheCollection)
    assert len(mgr.pages_of(a)) == 2 and len(mgr.pages_of(b)) == 1
    assert inp.lookup_table.shape == (2, 8)
    assert inp.lookup_table[0, :2].tolist() == mgr.pages_of(a)
    assert mgr.stats().pages_used == 3
    for _ in range(4):
        w.run([(a, [7]), (b, [8])])
    assert len(mgr.pages_of(a)) == 3 and len(mgr.pages_of(b)) == 2  # 9 and 5 tokens
    w.check(a)
    w.check(b)
    # a multistep fetch reserves pages for every step
    inp = mgr.fetch([BatchItem(b, [1])], num_steps=4)[0]
    assert len(mgr.pages_of(b)) == 3  # room for 5 + 1 + 3 = 9 tokens
    mgr.step([BatchItem(b, [1])])  # stopped after one step; the reserved page is kept
    assert len(mgr.pages_of(b)) == 3
    mgr.check_invariants()
    mgr.release(a)
    mgr.release(b)
    assert mgr.stats().pages_free == mgr.num_pages
    mgr.check_invariants()


def test_capacity_error_is_atomic_and_names_numbers():
    mgr = make(mb=3, max_seq_len=32, num_pages=5)
    a, b = mgr.claim(2)
    mgr.fetch([BatchItem(a, range(9))])  # 3 pages
    mgr.step([BatchItem(a, range(9))])
    before = (mgr.pages_of(a), mgr.stats())
    with pytest.raises(KVCacheCapacityError, match=r"needs 3 new pages .* 2 are free"):
        mgr.fetch([BatchItem(a, [1]), BatchItem(b, range(9))])
    assert (mgr.pages_of(a), mgr.stats()) == before
    assert mgr.pages_of(b) == []
    mgr.fetch([BatchItem(a, [1]), BatchItem(b, range(4))])  # 0 + 1 pages: fits
    mgr.check_invariants()


def test_lookup_table_width_and_zero_padding():
    mgr = make(mb=2, max_seq_len=16)
    (a,) = mgr.claim(1)
    inp = mgr.fetch([BatchItem(a, range(6))])[0]
    row = inp.lookup_table[0].tolist()
    assert len(row) == 4 and row[2:] == [0, 0] and len(set(row[:2])) == 2


# -- prefix caching --------------------------------------------------------------------------

def test_prefix_hit_skips_full_pages_and_recomputes_last_token():
    mgr = make(mb=4, max_seq_len=32, prefix=True)
    w = Writer(mgr)
    prompt = list(range(100, 111))  # 11 tokens: 2 full pages + 3
    a, b, c = mgr.claim(3)
    inp = w.run([(a, prompt)])
    assert inp.num_cached_tokens == (0,)
    # same prompt plus more: the 2 full pages are reused
    inp = w.run([(b, prompt + [5, 6])])
    assert inp.num_cached_tokens == (8,)
    assert inp.cache_lengths.tolist() == [8] and inp.qo_indptr.tolist() == [0, 5]
    assert inp.max_lengths.tolist() == [[5, 13]]
    assert mgr.pages_of(b)[:2] == mgr.pages_of(a)[:2]
    assert mgr.pages_of(b)[2] != mgr.pages_of(a)[2]
    w.check(a)
    w.check(b)
    # a prompt of exactly 2 full pages: the page with the last token is recomputed
    inp = w.run([(c, prompt[:8])])
    assert inp.num_cached_tokens == (4,) and inp.qo_indptr.tolist() == [0, 4]
    w.check(c)
    st = mgr.stats()
    assert st.prefix_queries == 3 and st.prefix_hit_tokens == 12
    assert st.prefix_query_tokens == 11 + 13 + 8
    assert st.prefix_hit_rate == pytest.approx(12 / 32)
    assert st.pages_shared == 2
    mgr.check_invariants()


def test_prefix_miss_on_different_earlier_page():
    mgr = make(mb=3, max_seq_len=32, prefix=True)
    w = Writer(mgr)
    a, b = mgr.claim(2)
    w.run([(a, list(range(12)))])
    # page 1 identical, page 0 differs: the chain breaks at page 0, nothing is reused
    other = [99, 1, 2, 3] + list(range(4, 12))
    inp = w.run([(b, other)])
    assert inp.num_cached_tokens == (0,)
    assert not set(mgr.pages_of(a)) & set(mgr.pages_of(b))
    w.check(b)


def test_released_prefix_is_cached_then_reused():
    mgr = make(mb=3, max_seq_len=32, prefix=True)
    w = Writer(mgr)
    (a,) = mgr.claim(1)
    prompt = list(range(50, 63))  # 13 tokens: 3 full pages
    w.run([(a, prompt)])
    w.run([(a, [1])])
    pages = mgr.pages_of(a)
    mgr.release(a)
    st = mgr.stats()
    assert st.pages_cached == 3 and st.pages_used == 0  # 3 full pages kept, partial freed
    (b,) = mgr.claim(1)
    w.tokens.pop(a)
    inp = w.run([(b, prompt + [7, 7, 7])])
    assert inp.num_cached_tokens == (12,)
    assert mgr.pages_of(b)[:3] == pages[:3]
    w.check(b)
    assert mgr.stats().pages_cached == 0
    mgr.check_invariants()


def test_lru_eviction_only_when_free_runs_out_and_oldest_first():
    mgr = make(mb=4, max_seq_len=16, num_pages=6, prefix=True)
    w = Writer(mgr)
    x, y = mgr.claim(2)
    w.run([(x, list(range(0, 8)) + [99])])    # pages x0 x1 (full), x2 (partial)
    w.run([(y, list(range(20, 28)) + [99])])  # pages y0 y1 (full), y2
    px, py = mgr.pages_of(x), mgr.pages_of(y)
    mgr.release(x)  # x0, x1 cached (older), x2 freed
    mgr.release(y)  # y0, y1 cached (newer), y2 freed
    assert mgr.stats().pages_cached == 4 and mgr.stats().pages_free == 2
    (z,) = mgr.claim(1)
    w.run([(z, [5, 5, 5, 5, 5, 5, 5])])  # 2 pages: taken from the free list, no eviction
    assert mgr.stats().evictions == 0 and mgr.stats().pages_cached == 4
    w.run([(z, [5, 5])])  # a 3rd page: evict the LRU page, x's tail page x1 first
    assert mgr.stats().evictions == 1
    assert px[1] in mgr.pages_of(z)
    w.run([(z, [5] * 4)])  # 4th page: x0 next
    assert px[0] in mgr.pages_of(z)
    assert mgr.stats().evictions == 2 and mgr.stats().pages_cached == 2
    w.check(z)
    mgr.release(z)  # its 3 full pages are cached, its partial page freed
    # y's pages are still cached and reusable
    (u,) = mgr.claim(1)
    inp = w.run([(u, list(range(20, 28)) + [1, 2])])
    assert inp.num_cached_tokens == (8,) and mgr.pages_of(u)[:2] == py[:2]
    assert mgr.stats().evictions == 2  # the 3rd page came from the free list
    w.check(u)
    mgr.check_invariants()


def test_hit_pages_pinned_against_eviction_in_same_fetch():
    mgr = make(mb=3, max_seq_len=16, num_pages=3, prefix=True)
    w = Writer(mgr)
    (a,) = mgr.claim(1)
    w.run([(a, list(range(9)))])  # 3 pages: 2 full cached, 1 partial
    mgr.release(a)
    (b,) = mgr.claim(1)
    w.tokens.clear()
    inp = w.run([(b, list(range(8)) + [42])])  # hits 2 pages, needs 1 more: the free one
    assert inp.num_cached_tokens == (8,)
    w.check(b)
    (c,) = mgr.claim(1)
    with pytest.raises(KVCacheCapacityError, match="0 are free or evictable"):
        mgr.fetch([BatchItem(c, [1])])
    mgr.check_invariants()


def test_write_into_cached_partial_page_after_pop_uncaches_it():
    mgr = make(mb=3, max_seq_len=32, prefix=True)
    w = Writer(mgr)
    (a,) = mgr.claim(1)
    w.run([(a, list(range(10)))])  # pages 0,1 cached
    w.pop(a, 3)  # length 7: page 1 is partial again, still cached, held by a alone
    assert mgr.stats().pages_shared == 0
    page1 = mgr.pages_of(a)[1]
    w.run([(a, [77, 78])])
    assert mgr.pages_of(a)[1] == page1  # written in place (no copy)
    w.check(a)
    (b,) = mgr.claim(1)
    inp = w.run([(b, list(range(10)))])
    assert inp.num_cached_tokens == (4,)  # page 1 no longer matches the old tokens
    w.check(b)
    mgr.check_invariants()


def test_same_batch_hit_on_a_page_another_item_writes_gets_a_copy():
    """Found by a long soak of the state machine: a prompt hits a cached page that another
    item of the same batch, after a pop, is about to write into. The writer must get a copy;
    the hit keeps the cached page and its contents."""
    mgr = make(mb=3, max_seq_len=32, prefix=True)
    w = Writer(mgr)
    a, b = mgr.claim(2)
    w.run([(a, [100, 101, 102, 103])])  # one full page, cached
    w.pop(a, 1)  # a holds 3 tokens: its page is partial again, still cached
    page = mgr.pages_of(a)[0]
    inp = w.run([(a, [7]), (b, [100, 101, 102, 103, 104])])
    assert inp.num_cached_tokens == (0, 4)
    assert mgr.pages_of(b)[0] == page and mgr.pages_of(a)[0] != page
    w.check(a)
    w.check(b)
    mgr.check_invariants()


# -- fork / copy-on-write --------------------------------------------------------------------

@pytest.mark.parametrize("prefix", [False, True])
def test_fork_shares_pages_and_copies_partial_page_on_write(prefix):
    mgr = make(mb=4, max_seq_len=32, prefix=prefix)
    w = Writer(mgr)
    (a,) = mgr.claim(1)
    w.run([(a, list(range(6)))])  # page 0 full, page 1 has 2 tokens
    f = w.fork(a)
    assert mgr.pages_of(f) == mgr.pages_of(a) and mgr.cache_length(f) == 6
    assert mgr.stats().pages_shared == 2
    mgr.check_invariants()
    shared_partial = mgr.pages_of(a)[1]
    w.run([(f, [40])])  # child writes first: it gets a copy of the partial page
    assert mgr.pages_of(f)[0] == mgr.pages_of(a)[0]
    assert mgr.pages_of(f)[1] != shared_partial and mgr.pages_of(a)[1] == shared_partial
    w.run([(a, [50])])  # the parent now holds its page alone: written in place
    assert mgr.pages_of(a)[1] == shared_partial
    w.check(a)
    w.check(f)
    g = w.fork(f)  # fork of a fork
    assert mgr.pages_of(g) == mgr.pages_of(f)
    f_partial = mgr.pages_of(f)[1]
    w.run([(g, [60]), (f, [61])])  # both write the shared partial page in one batch
    assert mgr.pages_of(g)[1] != f_partial and mgr.pages_of(f)[1] == f_partial  # one copy
    for s in (a, f, g):
        w.check(s)
    mgr.check_invariants()
    for s in (a, f, g):
        mgr.release(s)
    assert mgr.stats().pages_used == 0
    mgr.check_invariants()


def test_fork_on_page_boundary_needs_no_copy():
    mgr = make(mb=3, max_seq_len=32)
    w = Writer(mgr)
    (a,) = mgr.claim(1)
    w.run([(a, list(range(8)))])
    f = w.fork(a)
    w.run([(f, [1]), (a, [2])])
    assert mgr.pages_of(f)[:2] == mgr.pages_of(a)[:2]
    assert mgr.pages_of(f)[2] != mgr.pages_of(a)[2]
    w.check(a)
    w.check(f)


def test_fork_errors():
    mgr = make(mb=2, max_seq_len=16)
    (a,) = mgr.claim(1)
    with pytest.raises(UnknownSequenceError):
        mgr.fork(1)
    mgr.fetch([BatchItem(a, [1, 2])])
    with pytest.raises(SequenceStateError, match="in flight"):
        mgr.fork(a)
    mgr.step([BatchItem(a, [1, 2])])
    mgr.fork(a)
    with pytest.raises(KVCacheCapacityError, match="0 of 2 are free"):
        mgr.fork(a)
    mgr.check_invariants()


def test_cow_capacity_is_checked_before_anything_changes():
    mgr = make(mb=3, max_seq_len=16, num_pages=2)
    w = Writer(mgr)
    (a,) = mgr.claim(1)
    w.run([(a, list(range(6)))])  # both pages
    f = mgr.fork(a)
    before = (mgr.pages_of(a), mgr.pages_of(f), mgr.stats())
    with pytest.raises(KVCacheCapacityError, match="1 copy-on-write"):
        mgr.fetch([BatchItem(f, [1])])
    assert (mgr.pages_of(a), mgr.pages_of(f), mgr.stats()) == before
    mgr.check_invariants()


# -- pop -------------------------------------------------------------------------------------

def test_pop_rolls_back_and_frees_pages():
    mgr = make(mb=2, max_seq_len=32)
    w = Writer(mgr)
    (a,) = mgr.claim(1)
    w.run([(a, list(range(10)))])
    w.pop(a, 5)
    assert mgr.cache_length(a) == 5 and len(mgr.pages_of(a)) == 2
    assert mgr.stats().pages_used == 2
    w.run([(a, [9, 9, 9])])  # rewrite over the rolled-back positions
    w.check(a)
    w.pop(a, 0)
    w.pop(a, 8)
    assert mgr.cache_length(a) == 0 and mgr.pages_of(a) == []
    w.run([(a, [3, 4])])
    w.check(a)
    mgr.check_invariants()


def test_pop_errors():
    mgr = make(mb=2, max_seq_len=32)
    (a,) = mgr.claim(1)
    mgr.fetch([BatchItem(a, [1, 2, 3])])
    with pytest.raises(SequenceStateError, match="in flight"):
        mgr.pop(a, 1)
    mgr.step([BatchItem(a, [1, 2, 3])])
    with pytest.raises(InvalidArgumentError, match="at most its cache length 3"):
        mgr.pop(a, 4)  # pop past zero
    with pytest.raises(InvalidArgumentError):
        mgr.pop(a, -1)
    with pytest.raises(UnknownSequenceError):
        mgr.pop(1, 1)
    assert mgr.cache_length(a) == 3


def test_pop_shared_page_then_write_copies():
    mgr = make(mb=3, max_seq_len=32)
    w = Writer(mgr)
    (a,) = mgr.claim(1)
    w.run([(a, list(range(8)))])
    f = w.fork(a)
    w.pop(f, 2)  # f's page 1 is now partial and still shared with a
    w.run([(f, [70, 71, 72])])
    assert mgr.pages_of(f)[1] != mgr.pages_of(a)[1]
    w.check(a)
    w.check(f)
    mgr.check_invariants()


# -- devices ---------------------------------------------------------------------------------

def test_two_devices_split_heads_and_copy_on_both():
    mgr = make(mb=3, max_seq_len=16, devices=("cpu", "cpu"))
    assert tuple(mgr.blocks[0].shape) == (mgr.num_pages, 2, L, P, 1, D)
    assert mgr.blocks[0].data_ptr() != mgr.blocks[1].data_ptr()
    w = Writer(mgr)
    (a,) = mgr.claim(1)
    w.run([(a, list(range(6)))])
    f = w.fork(a)
    w.run([(f, [9])])
    w.check(a)
    w.check(f)
    assert len(mgr.input_symbols()) == 2


def test_collection_accessors_follow_the_page_table():
    mgr = make(mb=2, max_seq_len=16)
    w = Writer(mgr)
    (a,) = mgr.claim(1)
    w.run([(a, list(range(6)))])
    inp = mgr.fetch([BatchItem(a, [1])])[0]
    c = inp.collection()
    kc = c.get_key_cache(1)
    pages = mgr.pages_of(a)
    assert kc.cache_length(0) == 6 and not kc.empty_cache()
    assert kc.row_idx(0, 5) == pages[1] * P + 1
    assert kc.col_idx(1) == D
    assert kc.max_prompt_length() == 1 and kc.max_context_length() == 7
    want = Writer.kv_of(list(range(6)))[1, 0, 1]
    assert np.array_equal(kc.load(0, 1, 5).numpy(), want)
    kc.store(0, 1, 5, slice(None), torch.zeros(D))
    assert not mgr.blocks[0][pages[1], 0, 1, 1, 1].any()


def test_lookup_rows_track_pages_over_repeated_decode_batches():
    """The lookup table is refreshed incrementally when the same batch is fetched again;
    it must still equal every sequence's pages, across page crossings, copies, pops and
    release + reclaim of the same ids."""
    mgr = make(mb=4, max_seq_len=64, num_pages=40)
    ids = mgr.claim(3)
    rng = np.random.default_rng(5)
    for s, n in zip(ids, (3, 7, 10)):
        mgr.fetch([BatchItem(s, range(n))])
        mgr.step([BatchItem(s, range(n))])
    batch = [BatchItem(s, [1]) for s in ids]
    for step in range(40):
        if step == 10:
            f = mgr.fork(ids[1])  # ids[1]'s next write copies its last page
            mgr.release(f)
            mgr.fork(ids[1])
        if step == 20:
            mgr.pop(ids[2], 6)
        if step == 30:
            mgr.release(ids[0])
            mgr.external_claim([ids[0]])
        inp = mgr.fetch(batch, num_steps=int(rng.integers(1, 3)))[0]
        for b, s in enumerate(ids):
            pages = mgr.pages_of(s)
            assert inp.lookup_table[b, :len(pages)].tolist() == pages, (step, s)
            assert inp.cache_lengths[b] == mgr.cache_length(s)
        mgr.step(batch)
        mgr.check_invariants()


def test_host_memory_past_the_machine_is_a_capacity_error_before_anything_is_allocated(
        monkeypatch):
    """max_batch_size = 2**31 - 1 passed the int32 check, then its per-slot arrays got the
    process OOM-killed; step tables past memory were torch's raw RuntimeError."""
    from kvtvm.manager import ContinuousBatchingKVCacheManager, LinearKVCache, args

    monkeypatch.setattr(args, "host_memory_bytes", lambda: 1 << 20)
    p = KVCacheParams("float32", 1, 4, "paged", page_size=4)
    with pytest.raises(KVCacheCapacityError, match="max_batch_size=100000"):
        PagedKVCacheManager(p, 100000, 64, 1, num_pages=1)
    with pytest.raises(KVCacheCapacityError, match="max_batch_size=100000"):
        ContinuousBatchingKVCacheManager(KVCacheParams("float32", 1, 4, "continuous"),
                                         100000, 4, 1)
    with pytest.raises(KVCacheCapacityError, match="max_batch_size=100000"):
        LinearKVCache(KVCacheParams("float32", 1, 4, "linear"), 100000, 4, 1)
    with pytest.raises(KVCacheCapacityError, match="step tables"):  # 1000 x 2**20 pages wide
        PagedKVCacheManager(KVCacheParams("float32", 1, 4, "paged", page_size=1), 1000,
                            1 << 20, 1, num_pages=1)
    # the prefix cache's token table (max_batch_size x max_seq_len int64) was numpy's
    # MemoryError (found by a helper: Engine(max_seq_len=2**31 - 1, num_pages=64))
    with pytest.raises(KVCacheCapacityError, match="token table"):
        PagedKVCacheManager(KVCacheParams("float32", 1, 4, "paged", page_size=1024,
                                          enable_prefix_caching=True), 4, 1 << 20, 1,
                            num_pages=1)


def test_seed_001_003_members_of_the_views():
    """Seed 001's collection members and seed 003's simple accessor members, as an engine
    written from MAX's documents reads them."""
    import torch

    from kvtvm.errors import InvalidArgumentError
    from kvtvm.inputs import BatchItem

    params = KVCacheParams("float32", 2, 8, "paged", page_size=4)
    mgr = PagedKVCacheManager(params, 2, 32, 2, num_pages=8)
    (s,) = mgr.claim(1)
    (inp,) = mgr.fetch([BatchItem(s, [1, 2, 3, 4, 5])])
    c = inp.collection()
    assert c.name_str == "paged" and c.kv_params == params and c.scale_dtype is None
    assert c.dtype == torch.float32
    k = c.get_key_cache(layer_idx=1)
    assert c.kv_cache_dynamic_shape == tuple(k.blocks.shape) == (8, 4, 2, 8)
    assert c.kv_cache_dynamic_strides == tuple(k.blocks.stride())
    assert k.page_size_ == 4 and k.cache_lengths_nd() is inp.cache_lengths
    k.store(0, 1, 4, slice(None), torch.arange(8.0))
    assert k.load(0, 1, 4, 2, width=3).tolist() == [2.0, 3.0, 4.0]
    for bad in ((7, 2), (-1, 1), (2, 0), (2, 9)):  # (head_dim_idx, width) off the head
        with pytest.raises(InvalidArgumentError, match="head_dim_idx|width"):
            k.load(0, 1, 4, *bad[:1], width=bad[1])
    from kvtvm.manager import ContinuousBatchingKVCacheManager

    q8 = KVCacheParams("float32", 2, 8, "continuous", cache_dtype="int8")
    m8 = ContinuousBatchingKVCacheManager(q8, 1, 16, 1)
    (t,) = m8.claim(1)
    (i8,) = m8.fetch([BatchItem(t, [1])])
    assert i8.collection().scale_dtype == "float32"
    assert i8.collection().name_str == "continuous_batching"
    assert i8.collection().dtype == torch.int8
