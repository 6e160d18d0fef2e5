"""LinearKVCache (seed 004 verbs + evict)."""

import numpy as np
import pytest
import torch

from kvtvm import KVCacheParams, ops
from kvtvm.collection import LinearKVCacheCollection
from kvtvm.errors import InvalidArgumentError, SequenceTooLongError
from kvtvm.manager import LinearKVCache

H, D, L, S = 2, 8, 2, 16


def params():
    return KVCacheParams("float32", H, D, "linear")


def make(mb=4, devices=("cpu",)):
    c = LinearKVCache(params(), mb, S, L, devices)
    for buf in c._cache:
        buf.copy_(torch.randn(buf.shape))
    return c


def write(cache, new, rng, shadow):
    """append_kv (hnd) of ``new[b]`` random rows per active sequence; mirror in ``shadow``."""
    per_dev = cache.step_inputs(new)
    b = cache.active_batch_size
    new = [new] * b if isinstance(new, int) else list(new)
    kv = rng.standard_normal((L, 2, sum(new), H, D)).astype(np.float32)
    for dev, inp in enumerate(per_dev):
        c = inp.collection()
        assert isinstance(c, LinearKVCacheCollection) and inp.layout == "hnd"
        hs = slice(dev * H // len(per_dev), (dev + 1) * H // len(per_dev))
        for layer in range(L):
            ops.append_kv(c.get_key_cache(layer).blocks, c.get_value_cache(layer).blocks,
                          torch.tensor(kv[layer, 0][:, hs]), torch.tensor(kv[layer, 1][:, hs]),
                          inp.qo_indptr, inp.cache_lengths, inp.lookup_table, layout="hnd")
    off = 0
    for i, n in enumerate(new):
        shadow[i].extend(kv[:, :, off + j] for j in range(n))
        off += n
    cache.commit_sequence_length(torch.tensor(new, dtype=torch.int32))


def check(cache, shadow):
    lengths = cache.host_lengths
    assert lengths.tolist() == [len(s) for s in shadow]
    assert cache.kv_cache_lengths.tolist() == lengths.tolist()
    for b, rows in enumerate(shadow):
        if not rows:
            continue
        want = np.stack(rows, axis=2)  # [L, 2, T, H, D]
        got = np.concatenate([c[:, b].numpy() for c in cache._cache], axis=2)  # [L,2,H,S,D]
        assert np.array_equal(got[:, :, :, :len(rows)].transpose(0, 1, 3, 2, 4), want)


def test_shape_config_and_memory():
    c = make(mb=3)
    assert tuple(c.get_kv_cache_buffer().shape) == (L, 3, 2, H, S, D)
    assert tuple(c.get_kv_cache_for_decoder_layer(1).shape) == (3, 2, H, S, D)
    assert c.get_kv_cache_for_decoder_layer(1).data_ptr() == c.get_kv_cache_buffer()[1].data_ptr()
    with pytest.raises(InvalidArgumentError, match="layer"):
        c.get_kv_cache_for_decoder_layer(L)
    cfg = c.config
    assert (cfg.num_layers, cfg.max_batch_size, cfg.max_seq_len, cfg.n_kv_heads,
            cfg.head_dim, cfg.dtype) == (L, 3, S, H, D, "float32")
    assert LinearKVCache.estimated_memory_size(params(), 3, S, L) == c.device_nbytes()
    b = LinearKVCache.infer_optimal_batch_size(params(), S, L, 100_000)
    assert LinearKVCache.estimated_memory_size(params(), b, S, L) <= 100_000
    assert LinearKVCache.estimated_memory_size(params(), b + 1, S, L) > 100_000
    with pytest.raises(InvalidArgumentError):
        LinearKVCache(KVCacheParams("float32", H, D, "continuous"), 2, S, L)


def test_reset_commit_and_lengths():
    c = make(mb=4)
    assert c.active_batch_size == 0 and c.kv_cache_all_empty
    c.reset_for_new_sequences([0, 0, 0])
    assert c.active_batch_size == 3 and c.kv_cache_all_empty
    c.commit_sequence_length(torch.tensor([5, 2, 7], dtype=torch.int32))
    assert c.kv_cache_lengths.tolist() == [5, 2, 7] and not c.kv_cache_all_empty
    assert c.kv_cache_lengths.dtype == torch.int32
    c.commit_sequence_length(1)
    assert c.kv_cache_lengths.tolist() == [6, 3, 8]
    c.reset_for_new_sequences(np.array([4, 0]))
    assert c.kv_cache_lengths.tolist() == [4, 0] and c.active_batch_size == 2


def test_errors_change_nothing():
    c = make(mb=3)
    c.reset_for_new_sequences([3, 10])
    with pytest.raises(SequenceTooLongError, match="max_seq_len=16"):
        c.commit_sequence_length(7)
    with pytest.raises(SequenceTooLongError):
        c.commit_sequence_length([0, 7])
    with pytest.raises(InvalidArgumentError, match="active_batch_size=2"):
        c.commit_sequence_length([1, 1, 1])
    with pytest.raises(InvalidArgumentError, match=">= 0"):
        c.commit_sequence_length([-1, 0])
    with pytest.raises(InvalidArgumentError):
        c.commit_sequence_length([1.5, 2.0])
    assert c.kv_cache_lengths.tolist() == [3, 10]
    with pytest.raises(InvalidArgumentError, match="max_batch_size=3"):
        c.reset_for_new_sequences([0] * 4)
    with pytest.raises(SequenceTooLongError):
        c.reset_for_new_sequences([0, 17])
    with pytest.raises(InvalidArgumentError):
        c.set_active_batch_size(4)
    with pytest.raises(SequenceTooLongError):
        c.step_inputs([14, 0])
    # ragged nesting, bools and uint64 past int64 were a raw numpy error, taken as 1, and
    # reported as "got -1"
    with pytest.raises(InvalidArgumentError, match="host_reuse_kv_cache_lengths"):
        c.reset_for_new_sequences([[1, 2], [3]])
    with pytest.raises(InvalidArgumentError, match="keep"):
        c.evict([[1], [0, 1]])
    with pytest.raises(InvalidArgumentError, match="bool"):
        c.reset_for_new_sequences([1, True])
    with pytest.raises(InvalidArgumentError, match=str(2 ** 63)):
        c.reset_for_new_sequences(np.array([2 ** 63, 0], dtype=np.uint64))
    assert c.kv_cache_lengths.tolist() == [3, 10] and c.active_batch_size == 2


def test_set_active_batch_size():
    c = make(mb=4)
    c.reset_for_new_sequences([1, 2, 3])
    c.set_active_batch_size(2)
    assert c.kv_cache_lengths.tolist() == [1, 2]
    c.set_active_batch_size(4)  # slots that become active start empty
    assert c.kv_cache_lengths.tolist() == [1, 2, 0, 0]
    c.set_active_batch_size(0)
    assert c.kv_cache_all_empty and c.active_batch_size == 0


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu")])
def test_append_through_step_inputs_matches_shadow(devices):
    rng = np.random.default_rng(0)
    c = make(mb=3, devices=devices)
    c.reset_for_new_sequences([0, 0, 0])
    shadow = [[], [], []]
    write(c, [4, 1, 6], rng, shadow)
    write(c, 1, rng, shadow)
    write(c, [2, 3, 1], rng, shadow)
    check(c, shadow)
    inp = c.step_inputs(1)[0]
    assert inp.lookup_table.tolist() == [[0], [1], [2]]
    assert inp.max_lengths.tolist() == [[1, 9]]  # lengths 7, 5, 8 plus one
    assert inp.collection().get_key_cache(0).cache_length(2) == 8


@pytest.mark.parametrize("keep", [[1, 2, 3], [0, 2], [3], [2, 0, 4], [], [0, 1, 2, 3, 4]])
def test_evict_compacts_with_copy_kernel(keep):
    rng = np.random.default_rng(1)
    c = make(mb=5, devices=("cpu", "cpu"))
    c.reset_for_new_sequences([0] * 5)
    shadow = [[] for _ in range(5)]
    write(c, [3, 1, 4, 1, 5], rng, shadow)
    write(c, 1, rng, shadow)
    c.evict(keep)
    kept = [shadow[i] for i in sorted(keep)]
    assert c.active_batch_size == len(keep)
    check(c, kept)
    if kept:  # the batch goes on
        write(c, 2, rng, kept)
        check(c, kept)


def test_evict_errors():
    c = make(mb=4)
    c.reset_for_new_sequences([1, 2, 3])
    with pytest.raises(InvalidArgumentError, match="active_batch_size=3"):
        c.evict([0, 3])
    with pytest.raises(InvalidArgumentError, match="distinct"):
        c.evict([1, 1])
    assert c.kv_cache_lengths.tolist() == [1, 2, 3]


@pytest.mark.parametrize("verb", ["commit_sequence_length", "step_inputs"])
@pytest.mark.parametrize("count", [2**63, np.uint64(2**63), 2**64, 2**63 - 1,
                                   [2**63 - 1, 1], np.array([2**63, 0], dtype=np.uint64), 33])
def test_counts_past_int64_or_max_seq_len_are_too_long_and_change_nothing(verb, count):
    """Counts that do not fit int64 raised an untyped OverflowError, and one that fit but
    overflowed the sum wrapped to 'expected >= 0, got -9223372036854775808'."""
    lin = LinearKVCache(KVCacheParams("float32", 2, 16, "linear"), 4, 32, 1)
    lin.reset_for_new_sequences([1, 2])
    with pytest.raises(SequenceTooLongError, match="max_seq_len=32"):
        getattr(lin, verb)(count)
    assert lin.host_lengths.tolist() == [1, 2]
    (inp,) = lin.step_inputs([30, 29])   # the largest that fit
    assert inp.cache_lengths.tolist() == [1, 2]


def test_seed_004_names_getters_and_stream():
    """An engine written from TensorRT-Edge-LLM's LinearKVCache (seed 004): its getters as
    methods, its argument names, and its stream argument (None: the current stream; a CPU
    cache takes None only)."""
    from kvtvm.errors import InvalidArgumentError
    from kvtvm.inputs import ContinuousBatchingKVCacheInputSymbols

    c = LinearKVCache(KVCacheParams("float32", 2, 4, "linear"), 3, 16, 2)
    c.reset_for_new_sequences(host_reuse_kv_cache_lengths=[2, 0], stream=None)
    c.commit_sequence_length(new_context_lengths=[1, 3], stream=None)
    c.commit_sequence_length(1, None)
    assert c.get_kv_cache_lengths().tolist() == [4, 4] == c.kv_cache_lengths.tolist()
    assert c.get_active_batch_size() == 2 and not c.get_kv_cache_all_empty()
    assert c.get_config() == c.config
    layer = c.get_kv_cache_for_decoder_layer(decoder_layer_idx=1)
    assert layer.shape == (3, 2, 2, 16, 4)
    c.set_active_batch_size(new_active_batch_size=1)
    assert c.get_kv_cache_lengths().tolist() == [4]
    with pytest.raises(InvalidArgumentError, match="stream"):
        c.commit_sequence_length(1, stream="default")
    assert c.get_kv_cache_lengths().tolist() == [4]     # nothing changed
    syms = c.input_symbols()[0] if hasattr(c, "input_symbols") else None
    if syms is not None:
        assert syms.kv_blocks is syms.blocks and len(list(syms)) == 4 and syms[0] is syms.blocks
    cb = ContinuousBatchingKVCacheInputSymbols(kv_blocks=1, cache_lengths=2, lookup_table=3,
                                               max_lengths=4)  # seed 002's field names
    assert list(cb) == [1, 2, 3, 4] and cb.kv_blocks == 1 and cb.blocks == 1
    with pytest.raises(InvalidArgumentError, match="kv_blocks"):
        ContinuousBatchingKVCacheInputSymbols(kv_blocks=1, blocks=1)
    c.commit_sequence_length(increment=2)  # seed 004's name of the int
    assert c.get_kv_cache_lengths().tolist() == [6]
    with pytest.raises(InvalidArgumentError, match="new_context_lengths / increment"):
        c.commit_sequence_length(1, increment=1)
    assert c.get_kv_cache_lengths().tolist() == [6]
