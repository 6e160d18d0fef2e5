"""Names and shapes an engine written from the seeds' documents reaches for (found by a helper
reading every member the seeds list): seed 002's input classes in ``kvtvm.manager`` (MAX's
``max.nn.kv_cache.manager``), inputs that unpack into their four tensors as MAX's do, MAX's
uint32 row offsets, and seed 003's per-layer ``dtype`` / ``kv_params`` and vector ``store``."""

import numpy as np
import pytest
import torch

import kvtvm
from kvtvm import KVCacheParams
from kvtvm.errors import InvalidArgumentError
from kvtvm.manager import BatchItem, ContinuousBatchingKVCacheManager, PagedKVCacheManager


def test_seed_002_members_load_from_the_manager_module():
    import kvtvm.inputs as inputs
    import kvtvm.manager as manager

    for name in ("KVCacheInputs", "RaggedKVCacheInputs", "PaddedKVCacheInputs",
                 "KVCacheInputsSequence", "KVCacheInputSymbols", "RaggedKVCacheInputSymbols",
                 "ContinuousBatchingKVCacheInputSymbols"):
        assert getattr(manager, name) is getattr(inputs, name) is getattr(kvtvm, name), name


@pytest.mark.parametrize("cls,kw", [(ContinuousBatchingKVCacheManager, {}),
                                    (PagedKVCacheManager, {"page_size": 4})])
def test_inputs_unpack_into_their_four_tensors(cls, kw):
    strategy = "continuous" if cls is ContinuousBatchingKVCacheManager else "paged"
    m = cls(KVCacheParams("float32", 2, 8, strategy, **kw), 2, 16, 1)
    (s,) = m.claim(1)
    (inp,) = m.fetch([BatchItem(s, [1, 2, 3])])
    assert len(inp) == 4 == m.num_kv_inputs()
    blocks, cache_lengths, lookup_table, max_lengths = inp
    assert blocks is inp.blocks and cache_lengths is inp.cache_lengths
    assert lookup_table is inp.lookup_table and max_lengths is inp.max_lengths
    assert inp[3] is inp.max_lengths and inp[-4] is inp.blocks
    padded = kvtvm.PaddedKVCacheInputs(1, 2, 3, 4)
    assert list(padded) == [1, 2, 3, 4] and len(padded) == 4


@pytest.mark.skipif(not hasattr(torch, "uint32"), reason="this torch has no uint32")
def test_increment_cache_lengths_takes_max_uint32_row_offsets():
    m = ContinuousBatchingKVCacheManager(KVCacheParams("float32", 2, 8, "continuous"), 2, 16, 1)
    a, b = m.claim(2)
    (inp,) = m.fetch([BatchItem(a, [1, 2, 3]), BatchItem(b, [4])], num_steps=2)
    offsets = torch.tensor([0, 3, 4], dtype=torch.int32).to(torch.uint32)
    nxt = m.increment_cache_lengths(inp, offsets)
    assert nxt.cache_lengths.tolist() == [3, 1]


def test_layer_view_seed_003_members_and_vector_store():
    m = PagedKVCacheManager(KVCacheParams("float32", 2, 8, "paged", page_size=4), 2, 16, 1)
    (s,) = m.claim(1)
    (inp,) = m.fetch([BatchItem(s, [1, 2, 3, 4, 5])])
    k = inp.collection().get_key_cache(0)
    assert k.dtype == torch.float32 and k.kv_params == m.params
    before = k.blocks.clone()
    val = torch.arange(3, dtype=torch.float32) + 1
    k.store(0, 1, 4, 2, val)  # seed 003: store(bs, head_idx, tok_idx, head_dim_idx, SIMD[3])
    assert k.load(0, 1, 4, 2, width=3).tolist() == [1.0, 2.0, 3.0]
    k.store(0, 1, 4, -1, 9.0)  # a scalar at an int index: one element (as torch indexes)
    assert k.load(0, 1, 4, 7).item() == 9.0
    changed = (k.blocks != before).nonzero().tolist()
    page, slot = k.page_and_slot(0, 4)
    assert sorted(changed) == [[page, slot, 1, d] for d in (2, 3, 4, 7)]
    snapshot = k.blocks.clone()
    for bad_idx, bad_val in ((6, val), (slice(0, 2), val), (0, torch.zeros(2, 2, 3))):
        with pytest.raises(InvalidArgumentError, match="val"):
            k.store(0, 1, 4, bad_idx, bad_val)
    assert torch.equal(k.blocks, snapshot)
    assert np.array_equal(k.load(0, 1, 4, slice(2, 5)).numpy(), [1, 2, 3])
