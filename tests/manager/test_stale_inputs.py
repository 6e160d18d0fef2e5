"""Inputs cannot outlive their fetch; ``step`` commits only the fetched tokens; the threading
contract of docs/managers.md ("Threads"), exercised with threads."""

import threading

import numpy as np
import pytest
import torch

from kvtvm import KVCacheParams, ops, plan
from kvtvm.errors import (InvalidArgumentError, SequenceStateError, StaleInputsError,
                          UnknownSequenceError)
from kvtvm.manager import BatchItem, LinearKVCache, PagedKVCacheManager, TokenBatch

H, D, L, P = 2, 16, 2, 4


def _paged(**kw):
    params = KVCacheParams("float32", H, D, "paged", page_size=P, **kw)
    return PagedKVCacheManager(params, 4, 32, L)


def _append(inp, k):
    ops.append_kv(inp.k_cache(0), inp.v_cache(0), k, k, inp.qo_indptr, inp.cache_lengths,
                  inp.lookup_table)


@pytest.mark.parametrize("supersede", ["fetch", "step", "release"])
def test_inputs_of_a_superseded_fetch_are_refused_and_write_nothing(supersede):
    mgr = _paged()
    a, b = mgr.claim(2)
    (inp_a,) = mgr.fetch([BatchItem(a, [1, 2, 3])])
    if supersede == "fetch":
        mgr.fetch([BatchItem(b, [4, 5])])       # the shared tables now describe b
    elif supersede == "step":
        mgr.step([BatchItem(a, [1, 2, 3])])
    else:
        mgr.release(a)
    cache = mgr.blocks[0].clone()
    with pytest.raises(StaleInputsError, match="superseded"):
        _append(inp_a, torch.randn(3, H, D))
    with pytest.raises(StaleInputsError):
        ops.prefill_attention(torch.randn(3, 2 * H, D), inp_a.k_cache(0), inp_a.v_cache(0),
                              inp_a.qo_indptr, inp_a.cache_lengths, inp_a.lookup_table)
    with pytest.raises(StaleInputsError):
        plan.plan_step(inp_a).append_kv(0, torch.randn(3, H, D), torch.randn(3, H, D))
    with pytest.raises(StaleInputsError):
        inp_a.check_live()
    assert torch.equal(mgr.blocks[0], cache)


def test_a_prepared_launch_is_refused_once_its_fetch_is_superseded():
    mgr = _paged()
    a, b = mgr.claim(2)
    (inp,) = mgr.fetch([BatchItem(a, [1, 2])])
    k = torch.randn(2, H, D)
    launch = ops.prepare_append_kv(inp.k_cache(0), inp.v_cache(0), k, k, inp.qo_indptr,
                                   inp.cache_lengths, inp.lookup_table)
    mgr.fetch([BatchItem(b, [7])])
    cache = mgr.blocks[0].clone()
    with pytest.raises(StaleInputsError):
        launch.run()
    assert torch.equal(mgr.blocks[0], cache)


def test_the_latest_fetch_stays_usable_and_multistep_inputs_inherit_its_token():
    mgr = _paged()
    (a,) = mgr.claim(1)
    (inp,) = mgr.fetch([BatchItem(a, [1, 2])], num_steps=2)
    _append(inp, torch.randn(2, H, D))
    nxt = mgr.increment_cache_lengths(inp)
    _append(nxt, torch.randn(1, H, D))
    mgr.step([BatchItem(a, [1, 2, 9])])
    with pytest.raises(StaleInputsError):
        _append(nxt, torch.randn(1, H, D))


@pytest.mark.parametrize("batch_kind", ["items", "arrays"])
def test_step_refuses_tokens_other_than_fetched_and_changes_nothing(batch_kind):
    mgr = _paged(enable_prefix_caching=True)
    a, b = mgr.claim(2)
    prompt = list(range(10, 10 + 2 * P))
    mgr.fetch([BatchItem(a, prompt), BatchItem(b, [1])])
    wrong = list(prompt)
    wrong[3] += 1
    bad = ([BatchItem(a, wrong), BatchItem(b, [1])] if batch_kind == "items"
           else TokenBatch([a, b], wrong + [1], counts=[len(wrong), 1]))
    state = (mgr.cache_length(a), mgr.stats())
    with pytest.raises(SequenceStateError, match=f"tokens of seq_id {a}"):
        mgr.step(bad)
    assert (mgr.cache_length(a), mgr.stats()) == state
    mgr.step([BatchItem(a, prompt), BatchItem(b, [1])])   # the right tokens still commit
    # the prefix cache learned the fetched tokens: a new sequence with them hits
    (c,) = mgr.claim(1)
    (inp,) = mgr.fetch([BatchItem(c, prompt + [99])])
    assert inp.num_cached_tokens[0] == 2 * P


def test_multistep_step_checks_only_the_fetched_prefix():
    mgr = _paged()
    (a,) = mgr.claim(1)
    mgr.fetch([BatchItem(a, [5, 6])], num_steps=3)
    with pytest.raises(SequenceStateError):
        mgr.step([BatchItem(a, [5, 7, 1])])
    mgr.step([BatchItem(a, [5, 6, 1, 2])])
    assert mgr.cache_length(a) == 4


@pytest.mark.parametrize("bad", [True, False, np.bool_(True)])
def test_bool_seq_ids_are_refused(bad):
    mgr = _paged()
    mgr.claim(2)
    with pytest.raises((InvalidArgumentError, UnknownSequenceError)):
        mgr.fetch([BatchItem(bad, [1])])
    with pytest.raises(InvalidArgumentError):
        TokenBatch([bad, 0], [1, 2])
    with pytest.raises(InvalidArgumentError):
        mgr.release(bad)


def test_linear_evict_is_transactional_under_a_copy_failure():
    calls = []

    def failing(cache, src, dst):  # copies the first move, then fails (a round, a device)
        calls.append(1)
        cache[:, int(dst[0])] = cache[:, int(src[0])]
        raise RuntimeError("copier failed")

    params = KVCacheParams("float32", H, D, "linear")
    cache = LinearKVCache(params, 4, 8, L, slot_copier=failing)
    cache.reset_for_new_sequences([1, 2, 3, 4])
    buf = cache.get_kv_cache_buffer()
    buf.copy_(torch.randn(buf.shape))
    before, lengths = buf.clone(), cache.host_lengths.tolist()
    with pytest.raises(RuntimeError, match="copier failed"):
        cache.evict([1, 3])
    assert calls and torch.equal(buf, before)
    assert cache.host_lengths.tolist() == lengths and cache.active_batch_size == 4


def test_threads_that_serialise_fetch_to_step_get_exact_results():
    """The contract: ``fetch .. ops .. step`` of one manager is one critical section. Four
    threads, each its own sequence, under one engine lock: every sequence's cache holds
    exactly its own rows (a dense shadow per sequence)."""
    mgr = _paged()
    ids = mgr.claim(4)
    engine = threading.Lock()
    shadow = {s: [] for s in ids}
    errors = []

    def worker(seq, seed):
        gen = torch.Generator().manual_seed(seed)
        try:
            for step in range(12):
                n = 3 if step == 0 else 1
                k = torch.randn(n, H, D, generator=gen)
                with engine:
                    (inp,) = mgr.fetch([BatchItem(seq, list(range(n)))])
                    _append(inp, k)
                    mgr.step([BatchItem(seq, list(range(n)))])
                shadow[seq].append(k)
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(s, i)) for i, s in enumerate(ids)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    kc = mgr.blocks[0][:, 0, 0]  # [pages, P, H, D] of layer 0's K
    for seq in ids:
        rows = torch.cat(shadow[seq])
        pages = mgr.pages_of(seq)
        got = torch.cat([kc[p] for p in pages])[:rows.shape[0]]
        assert torch.equal(got, rows)


def test_threads_that_do_not_serialise_are_refused_never_corrupted():
    """Without the engine lock, a thread whose fetch was superseded gets StaleInputsError
    from the op (no write); a thread whose step lost its fetch gets SequenceStateError. What
    was committed is exact: every appended row that was stepped is where the shadow says."""
    mgr = _paged()
    ids = mgr.claim(4)
    refused, done, errors = [], [], []
    shadow = {s: [] for s in ids}

    def worker(seq, seed):
        try:
            run(seq, seed)
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    def run(seq, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(30):
            k = torch.randn(1, H, D, generator=gen)
            try:
                (inp,) = mgr.fetch([BatchItem(seq, [1])])
            except SequenceStateError:
                refused.append("fetch")
                continue
            try:
                _append(inp, k)
            except StaleInputsError:
                refused.append("op")
                _drop(seq)
                continue
            mgr.step([BatchItem(seq, [1])])
            shadow[seq].append(k)
            done.append(seq)

    def _drop(seq):  # give the fetch back: commit it with the rows appended by nobody
        mgr.step([BatchItem(seq, [1])])
        shadow[seq].append(None)

    threads = [threading.Thread(target=worker, args=(s, i)) for i, s in enumerate(ids)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and done
    kc = mgr.blocks[0][:, 0, 0]
    for seq in ids:
        pages = mgr.pages_of(seq)
        rows = torch.cat([kc[p] for p in pages])
        for i, k in enumerate(shadow[seq]):
            if k is not None:
                assert torch.equal(rows[i:i + 1], k), (seq, i)


def _linear():
    params = KVCacheParams("float32", H, D, "linear")
    cache = LinearKVCache(params, 3, 16, L)
    cache.reset_for_new_sequences([2, 0, 5])
    return cache


def _append_linear(inp, rows):
    k = torch.randn(rows, H, D)
    ops.append_kv(inp.k_cache(0), inp.v_cache(0), k, k, inp.qo_indptr, inp.cache_lengths,
                  inp.lookup_table, layout="hnd")


@pytest.mark.parametrize("supersede", ["step_inputs", "commit", "reset", "set_active", "evict"])
def test_linear_step_inputs_die_like_a_fetch_and_write_nothing(supersede):
    cache = _linear()
    (inp,) = cache.step_inputs(1)
    _append_linear(inp, 3)                      # live: accepted
    if supersede == "step_inputs":
        cache.step_inputs([2, 0, 1])
    elif supersede == "commit":
        cache.commit_sequence_length(1)
    elif supersede == "reset":
        cache.reset_for_new_sequences([1, 1, 1])
    elif supersede == "set_active":
        cache.set_active_batch_size(2)
    else:
        cache.evict([0, 2])
    before = cache.get_kv_cache_buffer().clone()
    with pytest.raises(StaleInputsError, match="superseded|changed"):
        _append_linear(inp, 3)
    with pytest.raises(StaleInputsError):
        plan.plan_step(inp).append_kv(0, torch.randn(3, H, D), torch.randn(3, H, D))
    with pytest.raises(StaleInputsError):
        inp.check_live()
    assert torch.equal(cache.get_kv_cache_buffer(), before)


def test_linear_step_inputs_refuse_bool_and_negative_counts_and_change_nothing():
    cache = _linear()
    (live,) = cache.step_inputs(1)
    for bad in (True, [1, -1, 1], [True, False, True], [1.0, 1.0, 1.0]):
        with pytest.raises(InvalidArgumentError, match="new_tokens"):
            cache.step_inputs(bad)
    live.check_live()                            # a refused call kills nothing
    np.testing.assert_array_equal(cache.host_lengths, [2, 0, 5])
