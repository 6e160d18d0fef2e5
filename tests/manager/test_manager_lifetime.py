"""A manager's lifetime and identity:

- the tables of a fetch die with their manager's memory: a new manager may be given it, and its
  views used with the old tables wrote into its sequences (the views matched the dead
  manager's by address); now a StaleInputsError, nothing written. Inputs kept whole keep the
  memory, and stay usable after the manager object is gone;
- copy.copy of a manager shared its page tables, free list and lock but not its fetch token (a
  fetch through the copy rewrote tables the original's inputs called live); copy, deepcopy and
  pickle are typed errors now (deepcopy and pickle raised a bare TypeError on the lock).
"""

import copy
import gc
import pickle

import pytest
import torch

from kvtvm import KVCacheParams, ops
from kvtvm.errors import InvalidArgumentError, StaleInputsError
from kvtvm.inputs import token_of
from kvtvm.manager import (BatchItem, ContinuousBatchingKVCacheManager, LinearKVCache,
                           PagedKVCacheManager)

H, D = 2, 16


def _paged():
    return PagedKVCacheManager(KVCacheParams("float32", H, D, "paged", page_size=4), 2, 64, 1)


def _managers():
    return [_paged(),
            ContinuousBatchingKVCacheManager(KVCacheParams("float32", H, D, "continuous"),
                                             2, 64, 1),
            LinearKVCache(KVCacheParams("float32", H, D, "linear"), 2, 64, 1)]


def _fetch(mgr, n=6):
    (seq,) = mgr.claim(1)
    (inp,) = mgr.fetch([BatchItem(seq, list(range(n)))])
    return inp


@pytest.mark.parametrize("make", [_paged, lambda: _managers()[1]], ids=["paged", "continuous"])
def test_the_tables_of_a_collected_manager_are_stale(make):
    a = make()
    inp = _fetch(a)
    tables = (inp.qo_indptr, inp.cache_lengths, inp.lookup_table)
    del a, inp
    gc.collect()
    assert not token_of(tables[0]).live
    b = make()
    views = _fetch(b)
    blocks = [t.clone() for t in b.blocks]
    k = torch.randn(6, H, D)
    with pytest.raises(StaleInputsError, match="memory was freed"):
        ops.append_kv(views.k_cache(0), views.v_cache(0), k, k, *tables)
    assert all(torch.equal(x, y) for x, y in zip(blocks, b.blocks))


def test_inputs_kept_whole_outlive_their_manager_object():
    a = _paged()
    inp = _fetch(a)
    del a
    gc.collect()
    k = torch.randn(6, H, D)
    ops.append_kv(inp.k_cache(0), inp.v_cache(0), k, k, inp.qo_indptr, inp.cache_lengths,
                  inp.lookup_table)
    assert torch.equal(inp.k_cache(0)[int(inp.lookup_table[0, 0]), 0], k[0])


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_managers_refuse_copies(how):
    for mgr in _managers():
        name = type(mgr).__name__
        with pytest.raises(InvalidArgumentError, match=name):
            if how == "copy":
                copy.copy(mgr)
            elif how == "deepcopy":
                copy.deepcopy(mgr)
            else:
                pickle.dumps(mgr)


def test_store_writes_values_not_autograd_history():
    """``store`` of a tensor that requires grad drew the manager's whole cache into its graph:
    every later append and copy on the manager was refused."""
    mgr = _paged()
    inp = _fetch(mgr)
    w = torch.randn(D, requires_grad=True)
    inp.collection().get_key_cache(0).store(0, 0, 0, slice(None), w * 2)
    assert not mgr.blocks[0].requires_grad
    k = torch.randn(6, H, D)
    ops.append_kv(inp.k_cache(0), inp.v_cache(0), k, k, inp.qo_indptr, inp.cache_lengths,
                  inp.lookup_table)


def test_cache_length_of_stale_inputs_is_refused():
    mgr = _paged()
    inp = _fetch(mgr)
    coll = inp.collection()
    layer = coll.get_key_cache(0)
    mgr.step([BatchItem(inp.seq_ids[0], list(range(6)))])
    for call in (lambda: coll.cache_length(0), lambda: layer.cache_length(0)):
        with pytest.raises(StaleInputsError):
            call()
