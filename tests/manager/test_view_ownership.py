"""With a fetch's tables the ops take only that manager's per-layer views -- K as K, V as V, of
one layer -- and a plan's rebound launches check what the op checks. Each case was accepted
before and wrote or read other positions of the same cache tensor (found by an off-grid sweep,
2026-11-27). Nothing may be written when a call is refused."""

import pytest
import torch

from kvtvm import KVCacheParams, ops
from kvtvm.errors import InvalidArgumentError
from kvtvm.manager import (BatchItem, ContinuousBatchingKVCacheManager, LinearKVCache,
                           PagedKVCacheManager)
from kvtvm.ops.decode import SplitWorkspace
from kvtvm.plan import plan_step

H, G, D, LAYERS = 2, 2, 16, 3


def _fetch(kind, cache_dtype=None):
    """(inputs of a 2-sequence step, the cache tensor) of a fresh ``kind`` manager."""
    if kind == "linear":
        mgr = LinearKVCache(KVCacheParams("float32", H, D, "linear", cache_dtype=cache_dtype),
                            3, 12, LAYERS)
        mgr.reset_for_new_sequences([0, 1])
        (inp,) = mgr.step_inputs([3, 2])
        return inp, mgr.get_kv_cache_buffer()
    if kind == "continuous":
        params = KVCacheParams("float32", H, D, "continuous", cache_dtype=cache_dtype)
        mgr = ContinuousBatchingKVCacheManager(params, 3, 12, LAYERS)
    else:
        params = KVCacheParams("float32", H, D, "paged", page_size=2, cache_dtype=cache_dtype)
        mgr = PagedKVCacheManager(params, 3, 24, LAYERS)
    a, b = mgr.claim(2)
    (inp,) = mgr.fetch([BatchItem(a, [1, 2, 3]), BatchItem(b, [4, 5])])
    return inp, mgr.blocks[0]


def _wrong_views(inp):
    """(what is wrong, K argument, V argument): views of the right cache tensor, but not the
    fetch's K and V of one layer."""
    k0, v0, v1 = inp.k_cache(0), inp.v_cache(0), inp.v_cache(1)
    views = [("shifted by one page", k0[1:], v0[1:]),
             ("K and V swapped", v0, k0),
             ("K of layer 0, V of layer 1", k0, v1),
             ("K as both", k0, inp.k_cache(2))]
    other = {torch.int8: torch.float8_e4m3fn, torch.float8_e4m3fn: torch.int8}.get(k0.dtype)
    if other is not None:  # the bytes read as the other 8-bit type
        views.append(("another dtype", k0.view(other), v0.view(other)))
    return views


def _call(op, inp, kc, vc, plan=None):
    n = int(inp.qo_indptr_host[-1])
    k, v = torch.randn(n, H, D), torch.randn(n, H, D)
    q = torch.randn(n, H * G, D)
    if op == "append":
        ops.append_kv(kc, vc, k, v, inp.qo_indptr, inp.cache_lengths, inp.lookup_table,
                      layout=inp.layout)
    elif op == "prefill":
        ops.prefill_attention(q, kc, vc, inp.qo_indptr, inp.cache_lengths, inp.lookup_table,
                              layout=inp.layout)
    elif op == "decode":
        ops.decode_attention(q[:2], kc, vc, inp.cache_lengths, inp.lookup_table,
                             layout=inp.layout)
    else:  # rebinding a prepared append launch of the same step
        plan._append.rebind(k_cache=kc, v_cache=vc).run()


@pytest.mark.parametrize("kind,cache_dtype", [("paged", None), ("paged", "int8"),
                                              ("continuous", None), ("linear", None),
                                              ("linear", "float8_e4m3fn")])
@pytest.mark.parametrize("op", ["append", "prefill", "decode", "plan rebind"])
def test_other_views_of_the_same_cache_are_refused(kind, cache_dtype, op):
    inp, blocks = _fetch(kind, cache_dtype)
    plan = None
    if op == "plan rebind":  # a launch prepared for layer 0
        plan = plan_step(inp)
        n = int(inp.qo_indptr_host[-1])
        plan.append_kv(0, torch.randn(n, H, D), torch.randn(n, H, D))
    for what, kc, vc in _wrong_views(inp):
        saved = blocks.clone()
        with pytest.raises(InvalidArgumentError, match="k_cache|v_cache"):
            _call(op, inp, kc, vc, plan)
        assert torch.equal(blocks, saved), what
    _call("append", inp, inp.k_cache(2), inp.v_cache(2))  # the right views still work
    inp.check_live()


@pytest.mark.parametrize("kind", ["paged", "continuous", "linear"])
@pytest.mark.parametrize("op", ["append", "prefill", "decode", "plan rebind"])
def test_k_and_v_of_two_devices_head_shards_are_refused(kind, op):
    """Heads split over two devices of one machine: K of device 0's shard with V of device
    1's (one layer) read K of heads 0-1 with V of heads 2-3, and the append wrote device 0's
    V rows over device 1's heads."""
    params = KVCacheParams("float32", 2 * H, D, kind, page_size=2 if kind == "paged" else None)
    if kind == "linear":
        mgr = LinearKVCache(params, 3, 12, LAYERS, devices=("cpu", "cpu"))
        mgr.reset_for_new_sequences([0, 1])
        i0, i1 = mgr.step_inputs([3, 2])
        caches = mgr.get_kv_cache_buffer(0), mgr.get_kv_cache_buffer(1)
    else:
        cls = PagedKVCacheManager if kind == "paged" else ContinuousBatchingKVCacheManager
        mgr = cls(params, 3, 24, LAYERS, devices=("cpu", "cpu"))
        a, b = mgr.claim(2)
        i0, i1 = mgr.fetch([BatchItem(a, [1, 2, 3]), BatchItem(b, [4, 5])])
        caches = tuple(mgr.blocks)
    plan = None
    if op == "plan rebind":
        plan = plan_step(i0)  # a launch prepared for device 0's layer 0
        n = int(i0.qo_indptr_host[-1])
        plan.append_kv(0, torch.randn(n, H, D), torch.randn(n, H, D))
    saved = [c.clone() for c in caches]
    for kc, vc in ((i0.k_cache(1), i1.v_cache(1)), (i1.k_cache(1), i0.v_cache(1))):
        with pytest.raises(InvalidArgumentError, match="head shard"):
            _call(op, i0, kc, vc, plan)
    assert all(torch.equal(c, s) for c, s in zip(caches, saved))
    _call("append", i0, i0.k_cache(1), i0.v_cache(1))  # one shard's own pair still works
    i0.check_live()


def test_a_plans_rebound_attention_refuses_an_output_over_its_queries():
    """The op refused ``out`` sharing memory with ``q``; the plan's later layers took it and
    the kernel overwrote query rows before reading them."""
    inp, _ = _fetch("paged")
    n = int(inp.qo_indptr_host[-1])
    plan = plan_step(inp)
    for layer in range(2):
        plan.append_kv(layer, torch.randn(n, H, D), torch.randn(n, H, D))
    q = torch.randn(n, H * G, D)
    want, _ = plan.attention(1, q.clone())
    plan.attention(0, q.clone())  # prepares the launch the next call would rebind
    base = torch.cat([torch.zeros(1, H * G, D), q])
    with pytest.raises(InvalidArgumentError, match="out and q"):
        plan.attention(1, base[1:], out=base[:n])
    assert torch.equal(base[1:], q)  # the queries were not overwritten
    got, _ = plan.attention(1, q.clone(), out=torch.empty_like(q))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("offsets,ok", [([0, 3, 5], True), ([0, 2, 3], True),
                                        ([0, 3, 15], False), ([0, 4, 6], False),
                                        ([0, 3, 2], False)])
def test_increment_cache_lengths_keeps_within_what_the_fetch_reserved(offsets, ok):
    """Before: offsets giving an item more tokens than its inputs carried made cache lengths
    past its pages; the table's padding (page 0, another sequence's page) then took its
    rows."""
    params = KVCacheParams("float32", H, D, "paged", page_size=3)
    mgr = PagedKVCacheManager(params, 3, 24, 1)
    a, b = mgr.claim(2)
    (inp,) = mgr.fetch([BatchItem(a, [1, 2, 3]), BatchItem(b, [4, 5])], num_steps=2)
    for given in (torch.tensor(offsets, dtype=torch.int32), type("M", (), {
            "input_row_offsets": torch.tensor(offsets, dtype=torch.int64)})()):
        if ok:
            nxt = mgr.increment_cache_lengths(inp, given)
            assert nxt.cache_lengths.tolist() == [offsets[1], offsets[2] - offsets[1]]
        else:
            with pytest.raises(InvalidArgumentError, match="prev_model_inputs"):
                mgr.increment_cache_lengths(inp, given)
    assert mgr.increment_cache_lengths(inp).cache_lengths.tolist() == [3, 2]
    inp.check_live()


@pytest.mark.parametrize("batch", [0, 2])
@pytest.mark.parametrize("workspace", ["x", 123, torch.zeros(4)])
def test_a_workspace_that_is_not_one_is_refused(batch, workspace):
    kc = torch.randn(4, 2, H, D)
    table = torch.zeros((batch, 1), dtype=torch.int32)
    lengths = torch.ones(batch, dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match="workspace"):
        ops.decode_attention(torch.randn(batch, H * G, D), kc, kc.clone(), lengths, table,
                             workspace=workspace)
    ops.decode_attention(torch.randn(batch, H * G, D), kc, kc.clone(), lengths, table,
                         workspace=SplitWorkspace(torch.device("cpu")))


def test_a_view_as_another_float_type_is_refused():
    """A float16 cache's views passed as bfloat16 (with bfloat16 rows) matched the old check:
    bfloat16 1.0 was written and read back from the float16 cache as 1.875."""
    params = KVCacheParams("float16", H, D, "paged", page_size=2)
    mgr = PagedKVCacheManager(params, 2, 8, 1)
    (a,) = mgr.claim(1)
    (inp,) = mgr.fetch([BatchItem(a, [1, 2, 3])])
    saved = mgr.blocks[0].clone()
    ones = torch.ones(3, H, D, dtype=torch.bfloat16)
    with pytest.raises(InvalidArgumentError, match="float16 view"):
        ops.append_kv(inp.k_cache(0).view(torch.bfloat16), inp.v_cache(0).view(torch.bfloat16),
                      ones, ones, inp.qo_indptr, inp.cache_lengths, inp.lookup_table)
    assert torch.equal(mgr.blocks[0], saved)


def test_8bit_views_refuse_another_dtype_and_rebind_checks_their_params():
    """An 8-bit view says which q/k/v dtype and head_dim its cache was made for: float16 rows
    into a float32 manager's int8 cache were accepted (the K-only cache refused them), and a
    launch rebound to the views of a head_dim 136 cache (144-byte rows, as 128's) wrote
    head_dim 128 rows into them."""
    from kvtvm.errors import DTypeMismatchError
    from kvtvm.ops import prepare_append_kv
    from kvtvm.storage import layer_view

    def views(head_dim):
        params = KVCacheParams("float32", 2, head_dim, "paged", page_size=4,
                               cache_dtype="int8")
        blocks = torch.zeros(6, params.bytes_per_page(1), dtype=torch.uint8)
        return blocks, [layer_view(blocks, params, 1, 0, kv) for kv in (0, 1)]

    blocks, (kc, vc) = views(128)
    tables = (torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
              torch.tensor([[0, 1]], dtype=torch.int32))
    half = torch.randn(3, 2, 128, dtype=torch.float16)
    with pytest.raises(DTypeMismatchError, match="float32"):
        ops.append_kv(kc, vc, half, half, *tables)
    k = torch.randn(3, 2, 128)
    launch = prepare_append_kv(kc, vc, k, k, *tables)
    other, (kc2, vc2) = views(136)
    with pytest.raises(InvalidArgumentError, match="head_dim=136"):
        launch.rebind(k_cache=kc2, v_cache=vc2)
    assert not blocks.any() and not other.any()
