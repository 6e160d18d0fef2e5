"""TokenBatch: the batch as arrays. Its checks, and that every manager treats it exactly as the
same batch given as a list of BatchItem (tables, lengths, prefix hits, pages)."""

import numpy as np
import pytest
import torch

from kvtvm import KVCacheParams
from kvtvm.errors import InvalidArgumentError, SequenceStateError, UnknownSequenceError
from kvtvm.inputs import BatchItem, TokenBatch
from kvtvm.manager import ContinuousBatchingKVCacheManager, PagedKVCacheManager


def test_layout_offsets_and_items():
    tb = TokenBatch(np.array([3, 7, 1]), [11, 12, 13, 14, 15, 16], counts=[2, 3, 1])
    assert tb.offsets.tolist() == [0, 2, 5, 6]
    assert tb.tokens_of(1).tolist() == [13, 14, 15]
    assert len(tb) == 3
    assert tb[-1] == BatchItem(1, [16])
    assert list(tb) == [BatchItem(3, [11, 12]), BatchItem(7, [13, 14, 15]), BatchItem(1, [16])]
    back = TokenBatch.from_items(list(tb))
    assert back.seq_ids.tolist() == [3, 7, 1] and back.counts.tolist() == [2, 3, 1]
    assert back.tokens.tolist() == tb.tokens.tolist()
    with pytest.raises(IndexError):
        tb[3]


def test_decode_default_and_host_tensors():
    tb = TokenBatch(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([5, 6]))
    assert tb.counts.tolist() == [1, 1]
    assert tb.seq_ids.dtype == np.int64 and tb.tokens.dtype == np.int64


@pytest.mark.parametrize("args, match", [
    (([0, 1], [5]), "2 tokens"),
    (([0, 1], [5, 6, 7], [1, 1]), "sum\\(counts\\) = 2"),
    (([0, 1], [5, 6], [3, -1]), "non-negative"),
    (([0, 1], [5, 6], [2]), "counts: expected 2 values"),
    (([[0, 1]], [5, 6]), "rank"),
    (([0.5, 1], [5, 6]), "integers"),
    (([0, 1], [5.0, 6.0]), "integers"),
    (([0, 1], ["a", "b"]), "integers"),
    (([[0, 1], [2]], [5, 6]), "seq_ids"),  # ragged: was numpy's raw ValueError
    (([0, 1], [[5], [6, 7]]), "tokens"),
])
def test_bad_arrays_are_refused(args, match):
    with pytest.raises(InvalidArgumentError, match=match):
        TokenBatch(*args)


def _paged(prefix=True):
    return PagedKVCacheManager(KVCacheParams("float32", 1, 4, "paged", page_size=4,
                                             enable_prefix_caching=prefix), 6, 64, 1)


def _continuous():
    return ContinuousBatchingKVCacheManager(KVCacheParams("float32", 1, 4, "continuous"),
                                            6, 64, 1)


def _state(mgr, inp):
    tables = (inp.cache_lengths.tolist(), inp.qo_indptr.tolist(), inp.lookup_table.tolist(),
              inp.max_lengths.tolist(), inp.seq_ids, inp.num_cached_tokens)
    pages = ([mgr.pages_of(s) for s in sorted(set(range(6)) - mgr.slots_remaining)]
             if isinstance(mgr, PagedKVCacheManager) else None)
    stats = mgr.stats() if isinstance(mgr, PagedKVCacheManager) else None
    return tables, pages, stats


@pytest.mark.parametrize("make", [_paged, lambda: _paged(False), _continuous])
def test_same_results_as_batch_items(make):
    rng = np.random.default_rng(7)
    system = rng.integers(0, 50, 9).tolist()  # a shared prefix: prefix hits on both paths
    lists, arrays = make(), make()
    for mgr in (lists, arrays):
        mgr.claim(4)
    live = {0: [], 1: [], 2: [], 3: []}
    for step in range(30):
        chosen = sorted(rng.choice(sorted(live), size=int(rng.integers(1, len(live) + 1)),
                                   replace=False).tolist())
        pairs = []
        for s in chosen:
            n = int(rng.integers(1, 7)) if not live[s] else int(rng.integers(1, 3))
            toks = rng.integers(0, 50, n).tolist()
            pairs.append((s, system + toks if not live[s] else toks))
        num_steps = int(rng.integers(1, 3))
        got = []
        for mgr, form in ((lists, "items"), (arrays, "arrays")):
            batch = ([BatchItem(s, t) for s, t in pairs] if form == "items" else
                     TokenBatch([s for s, _ in pairs], [x for _, t in pairs for x in t],
                                [len(t) for _, t in pairs]))
            (inp,) = mgr.fetch(batch, num_steps=num_steps)
            got.append(_state(mgr, inp))
            mgr.step(batch)
        assert got[0] == got[1], f"step {step}"
        for s, t in pairs:
            live[s] = live[s] + t
        if step % 7 == 6:  # release one and claim it again: fresh prompts, prefix hits
            s = chosen[0]
            for mgr in (lists, arrays):
                mgr.release(s)
                mgr.external_claim([s])
            live[s] = []
    for s in live:
        assert lists.cache_length(s) == arrays.cache_length(s) == len(live[s])
    if isinstance(lists, PagedKVCacheManager) and lists.prefix_caching:
        assert lists.stats().prefix_hit_tokens > 0


def test_errors_name_the_sequence_and_change_nothing():
    mgr = _paged()
    a, b = mgr.claim(2)
    with pytest.raises(UnknownSequenceError, match="seq_id 5"):
        mgr.fetch(TokenBatch([a, 5], [1, 2]))
    with pytest.raises(InvalidArgumentError, match="distinct"):
        mgr.fetch(TokenBatch([a, a], [1, 2]))
    with pytest.raises(InvalidArgumentError, match=f"tokens of seq_id {b}: .*at least one"):
        mgr.fetch(TokenBatch([a, b], [1, 2], counts=[2, 0]))
    with pytest.raises(InvalidArgumentError, match="at least one item"):
        mgr.fetch(TokenBatch([], []))
    with pytest.raises(InvalidArgumentError, match="a list of batch items or a TokenBatch"):
        mgr.fetch({a: [1]})
    mgr.fetch(TokenBatch([a, b], [1, 2, 3], counts=[2, 1]))
    with pytest.raises(SequenceStateError, match="the 2 tokens fetched \\(more only after fetch"):
        mgr.step(TokenBatch([a, b], [1, 2]))
    mgr.step(TokenBatch([a, b], [1, 2, 3], counts=[2, 1]))
    assert (mgr.cache_length(a), mgr.cache_length(b)) == (2, 1)


def test_step_with_tokens_that_are_not_ints_changes_nothing():
    """With prefix caching step stores the tokens: a float token is refused before anything
    is committed, on both batch forms."""
    mgr = _paged()
    (a,) = mgr.claim(1)
    mgr.fetch([BatchItem(a, [1, 2, 3, 4, 5])])
    for bad in ([BatchItem(a, [1, 2, 3, 4.5, 5])], [BatchItem(a, [1, 2, [3], 4, 5])]):
        with pytest.raises(InvalidArgumentError, match="tokens"):
            mgr.step(bad)
        assert mgr.cache_length(a) == 0
    mgr.step([BatchItem(a, [1, 2, 3, 4, 5])])
    assert mgr.cache_length(a) == 5 and mgr.stats().pages_used == 2
