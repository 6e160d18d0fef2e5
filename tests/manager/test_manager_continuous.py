"""ContinuousBatchingKVCacheManager and the API shared by every manager (seed 002)."""

import numpy as np
import pytest
import torch

from kvtvm import KVCacheParams, ops
from kvtvm.collection import ContinuousBatchingKVCacheCollection
from kvtvm.errors import (DeviceUnavailableError, InvalidArgumentError, KVCacheCapacityError,
                          SequenceStateError, SequenceTooLongError, UnknownSequenceError)
from kvtvm.inputs import (BatchItem, KVCacheInputsSequence, PaddedKVCacheInputs,
                          RaggedKVCacheInputs)
from kvtvm.manager import ContinuousBatchingKVCacheManager, PagedKVCacheManager

H, D, L = 2, 8, 2


def params(**kw):
    return KVCacheParams("float32", H, D, "continuous", **kw)


def make(mb=4, max_seq_len=16, devices=("cpu",)):
    return ContinuousBatchingKVCacheManager(params(), mb, max_seq_len, L, devices)


def items(pairs):
    return [BatchItem(s, list(t)) for s, t in pairs]


def rand_tokens(rng, n):
    return rng.integers(0, 1000, n).tolist()


# -- construction ----------------------------------------------------------------------------

def test_constructor_checks():
    with pytest.raises(InvalidArgumentError, match="cache_strategy"):
        ContinuousBatchingKVCacheManager(
            KVCacheParams("float32", H, D, "paged", page_size=4), 2, 8, 1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="max_batch_size"):
            ContinuousBatchingKVCacheManager(params(), bad, 8, 1)
    with pytest.raises(InvalidArgumentError, match="num_layers"):
        ContinuousBatchingKVCacheManager(params(), 2, 8, 0)
    with pytest.raises(InvalidArgumentError, match="devices"):  # 3 does not divide 2 heads
        ContinuousBatchingKVCacheManager(params(), 2, 8, 1, ("cpu", "cpu", "cpu"))
    with pytest.raises(InvalidArgumentError, match="params"):
        ContinuousBatchingKVCacheManager("float32", 2, 8, 1)
    with pytest.raises(InvalidArgumentError, match="devices"):
        ContinuousBatchingKVCacheManager(params(), 2, 8, 1, ())
    with pytest.raises(InvalidArgumentError, match="devices"):
        ContinuousBatchingKVCacheManager(params(), 2, 8, 1, ("meta",))
    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailableError, match="CUDA is not available"):
            ContinuousBatchingKVCacheManager(params(), 2, 8, 1, ("cuda:0",))


def test_cache_tensor_shape_and_memory_estimate_are_exact():
    mgr = make(mb=3, max_seq_len=10)
    assert tuple(mgr.blocks[0].shape) == (3, 2, L, 10, H, D)
    assert mgr.blocks[0].dtype == torch.float32
    est = ContinuousBatchingKVCacheManager.estimated_memory_size(params(), 3, 10, L)
    assert est == mgr.device_nbytes()
    assert est == 3 * 2 * L * 10 * H * D * 4 + 4 * (3 + 4 + 3)


def test_infer_optimal_batch_size_fits_and_is_maximal():
    p = params()
    for mem in (10_000, 123_456, 1_000_000):
        b = ContinuousBatchingKVCacheManager.infer_optimal_batch_size(p, 32, L, mem)
        assert ContinuousBatchingKVCacheManager.estimated_memory_size(p, b, 32, L) <= mem
        assert ContinuousBatchingKVCacheManager.estimated_memory_size(p, b + 1, 32, L) > mem
    with pytest.raises(InvalidArgumentError):
        ContinuousBatchingKVCacheManager.infer_optimal_batch_size(p, 32, L, 0)


# -- slots -----------------------------------------------------------------------------------

def test_claim_contains_release_slots():
    mgr = make(mb=4)
    assert mgr.slots_remaining == {0, 1, 2, 3}
    assert mgr.claim(2) == [0, 1]
    assert mgr.contains(0) and mgr.contains(1) and not mgr.contains(2)
    assert not mgr.contains(-1) and not mgr.contains(99) and not mgr.contains("0")
    assert mgr.slots_remaining == {2, 3}
    mgr.release(0)
    assert not mgr.contains(0)
    assert mgr.claim(1) == [0]  # lowest free slot
    assert mgr.claim(0) == []


def test_claim_past_capacity_names_asked_and_free():
    mgr = make(mb=4)
    mgr.claim(3)
    with pytest.raises(KVCacheCapacityError, match=r"asked for 2 .* 1 of 4 are free"):
        mgr.claim(2)
    assert mgr.slots_remaining == {3}  # unchanged
    with pytest.raises(InvalidArgumentError):
        mgr.claim(-1)


def test_double_release_and_unknown_release():
    mgr = make()
    (s,) = mgr.claim(1)
    mgr.release(s)
    with pytest.raises(UnknownSequenceError, match="already released"):
        mgr.release(s)
    with pytest.raises(ValueError):  # a ValueError subclass
        mgr.release(3)
    with pytest.raises(UnknownSequenceError):
        mgr.release(100)


def test_external_claim():
    mgr = make(mb=4)
    mgr.external_claim([2, 3])
    assert mgr.contains(2) and mgr.contains(3)
    with pytest.raises(SequenceStateError, match="seq_id 2 is already claimed"):
        mgr.external_claim([1, 2])
    assert not mgr.contains(1)  # atomic: 1 not claimed either
    with pytest.raises(InvalidArgumentError):
        mgr.external_claim([4])
    with pytest.raises(InvalidArgumentError, match="distinct"):
        mgr.external_claim([0, 0])
    assert mgr.claim(2) == [0, 1]


# -- fetch / step ----------------------------------------------------------------------------

def test_fetch_returns_tables_and_step_commits():
    rng = np.random.default_rng(0)
    mgr = make(mb=4, max_seq_len=16)
    a, b = mgr.claim(2)
    ta, tb = rand_tokens(rng, 5), rand_tokens(rng, 3)
    (inp,) = mgr.fetch(items([(b, tb), (a, ta)]))
    assert isinstance(inp, RaggedKVCacheInputs)
    assert inp.cache_lengths.tolist() == [0, 0]
    assert inp.lookup_table.tolist() == [[b], [a]]
    assert inp.qo_indptr.tolist() == [0, 3, 8]
    assert inp.max_lengths.tolist() == [[5, 5]]
    assert inp.seq_ids == (b, a)
    assert inp.blocks is mgr.blocks[0]
    mgr.step(items([(b, tb), (a, ta)]))
    assert mgr.cache_length(a) == 5 and mgr.cache_length(b) == 3
    (inp,) = mgr.fetch(items([(a, [7])]))
    assert inp.cache_lengths.tolist() == [5]
    assert inp.max_lengths.tolist() == [[1, 6]]
    mgr.step(items([(a, [7])]))
    assert mgr.cache_length(a) == 6


def test_fetch_errors_change_nothing():
    mgr = make(mb=4, max_seq_len=8)
    a, b = mgr.claim(2)
    with pytest.raises(UnknownSequenceError, match="seq_id 3"):
        mgr.fetch(items([(a, [1]), (3, [1])]))
    with pytest.raises(SequenceTooLongError, match="max_seq_len=8"):
        mgr.fetch(items([(a, [1]), (b, list(range(9)))]))
    with pytest.raises(SequenceTooLongError):  # room for num_steps - 1 more tokens too
        mgr.fetch(items([(a, list(range(7)))]), num_steps=3)
    with pytest.raises(InvalidArgumentError, match="distinct"):
        mgr.fetch(items([(a, [1]), (a, [2])]))
    with pytest.raises(InvalidArgumentError, match="at least one token"):
        mgr.fetch(items([(a, [])]))
    with pytest.raises(InvalidArgumentError, match="at least one item"):
        mgr.fetch([])
    with pytest.raises(InvalidArgumentError, match="seq_id"):
        mgr.fetch([object()])
    with pytest.raises(InvalidArgumentError, match="num_steps"):
        mgr.fetch(items([(a, [1])]), num_steps=0)
    # nothing was left in flight by the failures
    mgr.fetch(items([(a, [1, 2]), (b, [3])]))
    with pytest.raises(SequenceStateError, match="already has a fetch in flight"):
        mgr.fetch(items([(a, [4])]))
    mgr.step(items([(a, [1, 2]), (b, [3])]))
    assert (mgr.cache_length(a), mgr.cache_length(b)) == (2, 1)


def test_step_errors():
    mgr = make()
    a, b = mgr.claim(2)
    with pytest.raises(SequenceStateError, match="no fetch in flight"):
        mgr.step(items([(a, [1])]))
    mgr.fetch(items([(a, [1, 2, 3]), (b, [4])]))
    with pytest.raises(SequenceStateError, match="the 3 tokens fetched \\(more only after fetch"):
        mgr.step(items([(a, [1, 2])]))
    with pytest.raises(UnknownSequenceError):
        mgr.step(items([(3, [1])]))
    with pytest.raises(SequenceStateError):  # b fetched, a ok, but 2 is not fetched
        mgr.external_claim([2])
        mgr.step(items([(a, [1, 2, 3]), (2, [1])]))
    assert mgr.cache_length(a) == 0  # atomic
    mgr.step(items([(b, [4])]))  # a subset of the fetched batch may be stepped
    assert mgr.cache_length(b) == 1
    mgr.release(a)  # release drops the in-flight fetch
    (a2,) = mgr.claim(1)
    assert a2 == a
    mgr.fetch(items([(a2, [1])]))


def test_multistep_max_lengths_and_increment():
    mgr = make(mb=2, max_seq_len=16)
    (s,) = mgr.claim(1)
    steps = mgr.fetch(items([(s, [1, 2, 3, 4, 5])]), num_steps=3)
    assert steps[0].max_lengths.tolist() == [[5, 5], [1, 6], [1, 7]]
    nxt = mgr.increment_cache_lengths(steps)
    assert nxt[0].cache_lengths.tolist() == [5]
    assert nxt[0].qo_indptr.tolist() == [0, 1]
    assert nxt[0].max_lengths.tolist() == [[1, 6], [1, 7]]
    assert nxt[0].cache_lengths_host.tolist() == [5]
    assert steps[0].cache_lengths.tolist() == [0]  # the previous inputs are not touched
    assert mgr.cache_length(s) == 0  # nor the manager
    last = mgr.increment_cache_lengths(nxt[0], prev_model_inputs=nxt[0].qo_indptr)
    assert last.cache_lengths.tolist() == [6] and last.max_lengths.tolist() == [[1, 7]]
    with pytest.raises(SequenceStateError, match="no steps left"):
        mgr.increment_cache_lengths(last)
    with pytest.raises(InvalidArgumentError, match="shape"):
        mgr.increment_cache_lengths(nxt[0], prev_model_inputs=torch.zeros(5, dtype=torch.int32))

    class ModelInputs:
        input_row_offsets = torch.tensor([0, 1], dtype=torch.int32)

    assert mgr.increment_cache_lengths(nxt, ModelInputs())[0].cache_lengths.tolist() == [6]
    with pytest.raises(SequenceStateError, match="between 5 and 7"):
        mgr.step(items([(s, range(8))]))
    mgr.step(items([(s, [1, 2, 3, 4, 5, 6])]))  # stopped after two of three steps
    assert mgr.cache_length(s) == 6


def test_batch_max_lengths_over_items():
    mgr = make(mb=3, max_seq_len=32)
    a, b = mgr.claim(2)
    mgr.fetch(items([(a, range(10))]))
    mgr.step(items([(a, range(10))]))
    (inp,) = mgr.fetch(items([(a, [1]), (b, range(4))]), num_steps=2)
    assert inp.max_lengths.tolist() == [[4, 11], [1, 12]]


def test_append_through_collection_matches_dense_shadow():
    rng = np.random.default_rng(1)
    mgr = make(mb=3, max_seq_len=12, devices=("cpu", "cpu"))
    assert mgr.device_params.n_kv_heads == 1
    ids = mgr.claim(3)
    shadow = {s: [] for s in ids}  # seq -> list of [L, 2, H, D]
    for step_lens in ([3, 5, 1], [1, 1, 1], [2, 1, 4]):
        batch = [BatchItem(s, rand_tokens(rng, n)) for s, n in zip(ids, step_lens)]
        per_dev = mgr.fetch(batch)
        assert len(per_dev) == 2
        total = sum(step_lens)
        kv = rng.standard_normal((L, 2, total, H, D)).astype(np.float32)
        for dev, inp in enumerate(per_dev):
            c = inp.collection()
            assert isinstance(c, ContinuousBatchingKVCacheCollection)
            for layer in range(L):
                k = torch.tensor(kv[layer, 0][:, dev:dev + 1])  # torch memory: 64-byte aligned
                v = torch.tensor(kv[layer, 1][:, dev:dev + 1])
                ops.append_kv(c.get_key_cache(layer).blocks, c.get_value_cache(layer).blocks,
                              k, v, inp.qo_indptr, inp.cache_lengths, inp.lookup_table)
        off = 0
        for s, n in zip(ids, step_lens):
            shadow[s].extend(kv[:, :, off + i] for i in range(n))
            off += n
        mgr.step(batch)
    for s in ids:
        want = np.stack(shadow[s], axis=2)  # [L, 2, T, H, D]
        got = np.concatenate([b[s].numpy() for b in mgr.blocks], axis=-2)  # heads split
        got = got.transpose(1, 0, 2, 3, 4)  # [2, L, S, H, D] -> [L, 2, S, H, D]
        assert np.array_equal(got[:, :, :len(shadow[s])], want)
    # the accessor reads the same values
    (inp,) = mgr.fetch([BatchItem(ids[1], [1])])[:1]
    kc = inp.collection().get_key_cache(1)
    assert kc.cache_length(0) == len(shadow[ids[1]]) == 7
    assert np.array_equal(kc.load(0, 0, 4).numpy(), shadow[ids[1]][4][1, 0, 0])
    assert kc.row_idx(0, 4) == ids[1] * 12 + 4 and kc.col_idx(0) == 0


def test_collection_accessors_and_layer_checks():
    mgr = make(mb=2, max_seq_len=8)
    a, b = mgr.claim(2)
    (inp,) = mgr.fetch(items([(a, [1, 2]), (b, [3])]))
    c = inp.collection()
    assert c.max_seq_length == 2 and c.max_cache_length == 2
    assert c.cache_length(0) == 0 and c.empty_cache()
    assert c.max_prompt_length() == 2 and c.max_context_length() == 2
    kc = c.get_key_cache(0)
    assert tuple(kc.blocks.shape) == (2, 8, H, D)
    assert kc.blocks.data_ptr() == mgr.blocks[0].data_ptr()  # zero copy
    vc = c.get_value_cache(1)
    assert vc.blocks.data_ptr() == mgr.blocks[0][:, 1, 1].data_ptr()
    assert inp.k_cache(0).data_ptr() == kc.blocks.data_ptr()
    with pytest.raises(InvalidArgumentError, match="layer"):
        c.get_key_cache(L)


def test_input_symbols_and_num_kv_inputs():
    mgr = make(mb=2, max_seq_len=8)
    syms = mgr.input_symbols()
    assert len(syms) == 1 and mgr.num_kv_inputs() == 4
    s = syms[0]
    assert [int(x) for x in s.blocks.shape] == [2, 2, L, 8, H, D]
    assert s.blocks.dtype == "float32" and s.cache_lengths.dtype == "int32"
    assert s.lookup_table.ndim == 2 and int(s.lookup_table.shape[1]) == 1
    assert s.max_lengths.ndim == 2


def test_inputs_containers():
    seq = KVCacheInputsSequence([PaddedKVCacheInputs(1, 2, 3, 4)])
    assert len(seq) == 1 and seq[0].start_pos == 3 and list(seq)[0].null_op == 4


def test_per_step_tables_are_preallocated_buffers():
    mgr = make(mb=3, max_seq_len=8)
    a, b = mgr.claim(2)
    (i1,) = mgr.fetch(items([(a, [1])]))
    mgr.step(items([(a, [1])]))
    (i2,) = mgr.fetch(items([(b, [1]), (a, [2])]))
    assert i1.cache_lengths.data_ptr() == i2.cache_lengths.data_ptr()
    assert i1.lookup_table.data_ptr() == i2.lookup_table.data_ptr()
    assert i2.cache_lengths.tolist() == [0, 1]


def test_paged_manager_rejects_continuous_params():
    with pytest.raises(InvalidArgumentError):
        PagedKVCacheManager(params(), 2, 8, 1)


def test_pop_rolls_back_and_rewrites_from_the_new_length():
    rng = np.random.default_rng(7)
    mgr = make(mb=2, max_seq_len=12)
    a, b = mgr.claim(2)
    kv = torch.tensor(rng.standard_normal((10, H, D)).astype(np.float32))

    def write(seq, rows):
        n = len(rows)
        (inp,) = mgr.fetch([BatchItem(seq, [1] * n)])
        blocks = mgr.blocks[0]
        ops.append_kv(blocks[:, 0, 0], blocks[:, 1, 0], kv[rows], kv[rows] * 2, inp.qo_indptr,
                      inp.cache_lengths, inp.lookup_table)
        mgr.step([BatchItem(seq, [1] * n)])

    write(a, list(range(6)))
    write(b, [9])
    mgr.pop(a, 4)
    assert (mgr.cache_length(a), mgr.cache_length(b)) == (2, 1)
    write(a, [7, 8])                                  # lands at positions 2, 3
    assert torch.equal(mgr.blocks[0][a, 0, 0, :4], kv[[0, 1, 7, 8]])
    assert torch.equal(mgr.blocks[0][a, 1, 0, :4], kv[[0, 1, 7, 8]] * 2)
    assert torch.equal(mgr.blocks[0][b, 0, 0, :1], kv[[9]])
    mgr.pop(a, 0)
    mgr.pop(a, 4)
    assert mgr.cache_length(a) == 0
    write(a, [3])
    assert torch.equal(mgr.blocks[0][a, 0, 0, :1], kv[[3]])


def test_pop_errors_change_nothing():
    mgr = make(mb=2, max_seq_len=12)
    (a,) = mgr.claim(1)
    mgr.fetch([BatchItem(a, [1, 2, 3])])
    with pytest.raises(SequenceStateError, match="in flight"):
        mgr.pop(a, 1)
    mgr.step([BatchItem(a, [1, 2, 3])])
    for bad, err, match in ((4, InvalidArgumentError, "at most its cache length 3"),
                            (-1, InvalidArgumentError, "non-negative"),
                            (True, InvalidArgumentError, "non-negative")):
        with pytest.raises(err, match=match):
            mgr.pop(a, bad)
    with pytest.raises(UnknownSequenceError):
        mgr.pop(1, 1)
    assert mgr.cache_length(a) == 3


def test_seed_000_cache_lengths_dict():
    """Seed 000's ``cache_lengths``: every claimed sequence's committed length (a copy)."""
    from kvtvm.inputs import BatchItem

    params = KVCacheParams("float32", 2, 4, "continuous")
    mgr = ContinuousBatchingKVCacheManager(params, 3, 16, 1)
    a, b = mgr.claim(2)
    mgr.fetch([BatchItem(a, [1, 2, 3])])
    mgr.step([BatchItem(a, [1, 2, 3])])
    lengths = mgr.cache_lengths
    assert lengths == {a: 3, b: 0}
    lengths[a] = 99
    assert mgr.cache_lengths[a] == 3
    mgr.release(b)
    assert mgr.cache_lengths == {a: 3}
