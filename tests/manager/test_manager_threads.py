"""Several threads claim / fetch / step / fork / pop / release on one manager at once.

Each thread owns the sequences it claimed; their lengths must be exactly what that thread
committed, the page bookkeeping must stay consistent while the threads run (a checker thread
calls ``check_invariants`` concurrently), and everything must be free at the end.
"""

import random
import threading

import pytest

from kvtvm import KVCacheParams
from kvtvm.errors import KVCacheCapacityError
from kvtvm.inputs import BatchItem, TokenBatch
from kvtvm.manager import ContinuousBatchingKVCacheManager, PagedKVCacheManager

N_THREADS, ROUNDS = 6, 60


def worker(mgr, seed, errors, paged):
    rng = random.Random(seed)
    mine = {}  # seq -> committed length
    try:
        for _ in range(ROUNDS):
            op = rng.random()
            if op < 0.25 or not mine:
                try:
                    (s,) = mgr.claim(1)
                except KVCacheCapacityError:
                    continue
                mine[s] = 0
            elif op < 0.35:
                s = rng.choice(sorted(mine))
                mgr.release(s)
                del mine[s]
            elif paged and op < 0.42:
                s = rng.choice(sorted(mine))
                try:
                    f = mgr.fork(s)
                except KVCacheCapacityError:
                    continue
                mine[f] = mine[s]
            elif paged and op < 0.5:
                s = rng.choice(sorted(mine))
                n = rng.randint(0, mine[s])
                mgr.pop(s, n)
                mine[s] -= n
            else:
                chosen = rng.sample(sorted(mine), k=min(len(mine), rng.randint(1, 3)))
                batch = [BatchItem(s, [rng.randrange(4) for _ in range(rng.randint(1, 5))])
                         for s in chosen]
                if any(mine[s] + len(b.tokens) + 1 > mgr.max_seq_len
                       for s, b in zip(chosen, batch)):
                    continue
                if rng.random() < 0.5:  # the same batch as arrays
                    batch = TokenBatch.from_items(batch)
                try:
                    inputs = mgr.fetch(batch, num_steps=2)
                except KVCacheCapacityError:
                    continue
                inp = inputs[0]  # host copies are this call's own, whatever other threads do
                assert inp.seq_ids == tuple(chosen)
                for b, s in enumerate(chosen):
                    assert inp.cache_lengths_host[b] == mine[s] + inp.num_cached_tokens[b]
                mgr.step(batch)
                for s, b in zip(chosen, batch):
                    mine[s] += len(b.tokens)
            for s, n in mine.items():
                assert mgr.cache_length(s) == n, (s, n)
        for s in list(mine):
            mgr.release(s)
    except BaseException as err:  # noqa: BLE001 - reported by the main thread
        errors.append(err)


def run_threads(mgr, paged):
    errors, stop = [], threading.Event()

    def checker():
        while not stop.is_set():
            try:
                if paged:
                    mgr.check_invariants()
            except BaseException as err:  # noqa: BLE001
                errors.append(err)
                return

    threads = [threading.Thread(target=worker, args=(mgr, i, errors, paged))
               for i in range(N_THREADS)]
    chk = threading.Thread(target=checker)
    chk.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    stop.set()
    chk.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    assert mgr.slots_remaining == set(range(mgr.max_batch_size))


@pytest.mark.parametrize("prefix", [False, True])
def test_paged_manager_under_threads(prefix):
    mgr = PagedKVCacheManager(
        KVCacheParams("float16", 2, 8, "paged", page_size=4, enable_prefix_caching=prefix),
        12, 48, 1, num_pages=40)
    run_threads(mgr, paged=True)
    mgr.check_invariants()
    st = mgr.stats()
    assert st.pages_used == 0 and st.pages_free + st.pages_cached == 40
    assert prefix or st.pages_cached == 0


def test_continuous_manager_under_threads():
    mgr = ContinuousBatchingKVCacheManager(KVCacheParams("float16", 2, 8, "continuous"),
                                           8, 64, 1)
    run_threads(mgr, paged=False)


@pytest.mark.parametrize("access", ["store", "load", "row_idx"])
def test_collection_access_holds_the_fetch_against_a_concurrent_fetch(monkeypatch, access):
    """A fetch on another thread between an accessor's liveness check and its table read used
    to rewrite the (shared, on a CPU) lookup table under it: ``store`` wrote into the other
    sequence's page. The accessor now holds the manager's lock from the check through the
    access, so the other fetch waits and the access lands on the fetch's own page."""
    import torch

    from kvtvm.collection import LayerKVCache

    params = KVCacheParams("float32", n_kv_heads=1, head_dim=4, cache_strategy="paged",
                           page_size=2)
    mgr = PagedKVCacheManager(params, 2, 8, 1, num_pages=8)
    a, b = mgr.claim(2)
    mgr.fetch([BatchItem(b, [5, 6, 7])])
    mgr.step([BatchItem(b, [5, 6, 7])])
    (inp,) = mgr.fetch([BatchItem(a, [1])])
    kc = inp.collection().get_key_cache(0)
    page_of_a = mgr.pages_of(a)[0]
    mgr.blocks[0][mgr.pages_of(b)[0], 0, 0, 0] = 9.0   # b's first row, to tell a read apart

    other = threading.Thread(target=lambda: mgr.fetch([BatchItem(b, [8])]))
    checked = LayerKVCache._position

    def position_then_race(self, *args):
        out = checked(self, *args)
        if not other.is_alive() and other.ident is None:
            other.start()              # b's fetch puts b's pages in batch entry 0 ...
            other.join(0.3)            # ... unless this access holds the manager's lock
        return out

    monkeypatch.setattr(LayerKVCache, "_position", position_then_race)
    if access == "store":
        kc.store(0, 0, 0, slice(None), torch.full((4,), 3.0))
    elif access == "load":
        got = kc.load(0, 0, 0)
        assert torch.equal(got, mgr.blocks[0][page_of_a, 0, 0, 0, 0]), got
    else:
        assert kc.row_idx(0, 0) == page_of_a * 2
    other.join()
    if access == "store":
        assert torch.equal(mgr.blocks[0][page_of_a, 0, 0, 0, 0], torch.full((4,), 3.0))
        assert float(mgr.blocks[0][mgr.pages_of(b)[0], 0, 0, 0, 0, 0]) == 9.0
    mgr.check_invariants()


@pytest.mark.parametrize("kind", ["continuous", "paged"])
def test_increment_cache_lengths_is_not_torn_by_a_fetch_on_another_thread(kind):
    """Was: increment_cache_lengths checked its inputs live, then read the shared table
    buffer without the manager's lock; another thread's fetch in between made it return the
    other fetch's lengths (43 for 3 here) without a StaleInputsError. Now it holds the lock:
    the other fetch waits until it has read the tables."""
    import torch

    if kind == "paged":
        m = PagedKVCacheManager(KVCacheParams("float32", 1, 2, "paged", page_size=4), 4, 64, 1)
    else:
        m = ContinuousBatchingKVCacheManager(KVCacheParams("float32", 1, 2, "continuous"),
                                             4, 64, 1)
    a, b = m.claim(2)
    m.fetch([BatchItem(b, list(range(40)))])
    m.step([BatchItem(b, list(range(40)))])
    (inp,) = m.fetch([BatchItem(a, [1, 2, 3])], num_steps=3)
    other = []

    class Prev:  # read by increment_cache_lengths between its checks and its table reads
        @property
        def qo_indptr(self):
            if not other:
                other.append(threading.Thread(target=lambda: m.fetch([BatchItem(b, [7])])))
                other[0].start()
                other[0].join(0.5)  # time enough to fetch, unless the lock holds it back
            return torch.tensor([0, 3], dtype=torch.int32)

    out = m.increment_cache_lengths(inp, Prev())
    other[0].join(30)
    assert not other[0].is_alive()
    assert out.cache_lengths.tolist() == [3] and out.cache_lengths_host.tolist() == [3]
