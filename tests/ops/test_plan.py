"""StepPlan: every layer's append and attention of one step, checked once and replayed.

Compared with the plain ops on a twin manager fed the same random K/V and queries: outputs,
log-sum-exps and the whole cache must be equal (the same kernels run), on a prefill step and on
decode steps; the replay path must actually be taken; bad input on any layer still raises the
ops' typed errors and writes nothing.
"""

import numpy as np
import pytest
import torch

from helpers import run_step as _run_step
from kvtvm import KVCacheParams, plan
from kvtvm.errors import DTypeMismatchError, InvalidArgumentError
from kvtvm.manager import BatchItem, PagedKVCacheManager, TokenBatch
from kvtvm.ops import Launch

H, G, D, LAYERS, P = 2, 3, 16, 3, 4


def _manager():
    params = KVCacheParams("float32", H, D, "paged", page_size=P)
    return PagedKVCacheManager(params, 4, 64, LAYERS)


def test_plan_matches_the_ops_over_prefill_and_decode_steps(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    planned, plain = _manager(), _manager()
    for mgr in (planned, plain):
        mgr.blocks[0].copy_(torch.randn(mgr.blocks[0].shape, generator=torch.Generator()
                                        .manual_seed(1)))
    ids = planned.claim(3)
    assert plain.claim(3) == ids
    replays = []
    real = Launch.rebind

    def counted(*args, **kwargs):  # counts rebinds that succeeded
        launch = real(*args, **kwargs)
        replays.append(1)
        return launch

    monkeypatch.setattr(Launch, "rebind", counted)
    steps = [[BatchItem(ids[0], [1] * 7), BatchItem(ids[1], [2] * 4), BatchItem(ids[2], [3])]]
    steps += [TokenBatch(ids, [4, 5, 6])] * 3
    for batch in steps:
        n = sum(len(it.tokens) for it in batch)
        qkv = [(torch.randn(n, H * G, D, generator=gen), torch.randn(n, H, D, generator=gen),
                torch.randn(n, H, D, generator=gen)) for _ in range(LAYERS)]
        before = len(replays)
        got = _run_step(planned, batch, qkv, planned=True)
        want = _run_step(plain, batch, qkv, planned=False)
        for (go, gl), (wo, wl) in zip(got, want):
            assert torch.equal(go, wo) and torch.equal(gl, wl)
        assert len(replays) - before == 2 * (LAYERS - 1)  # layer 0 full, the others replayed
    assert torch.equal(planned.blocks[0], plain.blocks[0])


def test_bad_input_on_a_later_layer_raises_and_writes_nothing():
    mgr = _manager()
    (a,) = mgr.claim(1)
    (inp,) = mgr.fetch([BatchItem(a, [1, 2, 3])])
    p = plan.plan_step(inp)
    k = torch.randn(3, H, D)
    p.append_kv(0, k, k)
    cache = mgr.blocks[0].clone()
    with pytest.raises(DTypeMismatchError):
        p.append_kv(1, k.double(), k.double())
    with pytest.raises(InvalidArgumentError, match="rows of k"):
        p.append_kv(1, k[:2], k[:2])
    assert torch.equal(mgr.blocks[0], cache)
    p.append_kv(1, k, k)
    q = torch.randn(3, H * G, D)
    p.attention(0, q)
    with pytest.raises(InvalidArgumentError):
        p.attention(1, q[:, :H * G - 1])
    with pytest.raises(InvalidArgumentError, match="layer"):
        p.attention(LAYERS, q)
    with pytest.raises(InvalidArgumentError, match="decode"):
        plan.plan_step(inp, decode=True)


def test_numpy_inputs_are_planned_too():
    mgr = _manager()
    (a,) = mgr.claim(1)
    (inp,) = mgr.fetch([BatchItem(a, [1])])
    p = plan.plan_step(inp)
    assert p.decode
    k = np.random.default_rng(0).standard_normal((1, H, D)).astype(np.float32)
    for layer in range(LAYERS):
        p.append_kv(layer, k, k)
        out, lse = p.attention(layer, np.ones((1, H * G, D), np.float32))
        # one token in the cache: attention returns its V row, for every query head
        np.testing.assert_allclose(out.numpy(), np.repeat(k, G, axis=1), rtol=1e-6)
    # numpy arrays cross the DLPack boundary without a copy: the later layers are rebound too
    assert p._append.slots["k"] is not p._append.slots["v"]


def test_one_tensor_passed_as_k_and_v_is_replayed():
    mgr = _manager()
    (a,) = mgr.claim(1)
    (inp,) = mgr.fetch([BatchItem(a, [1, 2])])
    p = plan.plan_step(inp)
    k = torch.randn(2, H, D)
    for layer in range(LAYERS):
        p.append_kv(layer, k, k)
    assert p._append.slots["k"] is k and p._append.slots["v"] is k
    for layer in range(LAYERS):
        assert torch.equal(inp.k_cache(layer)[inp.lookup_table[0, 0], :2], k)
        assert torch.equal(inp.v_cache(layer)[inp.lookup_table[0, 0], :2], k)


def test_a_cuda_launch_refuses_to_rebind_rows_off_16_bytes():
    """prepare_* checks CUDA rows are 16-byte aligned; a rebound launch compared only dtype,
    shape, strides and device, so a later layer's q / k / v starting mid-vector reached the
    kernel. (Checked without a GPU: the launch is never run.)"""
    base = torch.zeros(3 * 8 * 16 + 4)
    slots = {"q": base[:384].view(3, 8, 16), "err": torch.zeros(4, dtype=torch.int32)}
    launch = Launch(None, torch.device("cuda"), slots, outputs=())
    with pytest.raises(InvalidArgumentError, match="16-byte aligned"):
        launch.rebind(q=base[1:385].view(3, 8, 16))      # 4 bytes off
    assert launch.rebind(q=base[4:388].view(3, 8, 16)).slots["q"].data_ptr() % 16 == 0


def _quant_tables(storage):
    """The K/V views of a one-layer paged ``storage`` cache holding one 9-token sequence, and
    a decode launch over them with user-owned tables (no fetch token: the ownership check
    does not apply)."""
    from kvtvm import ops

    params = KVCacheParams("float32", H, D, "paged", page_size=P, cache_dtype=storage)
    mgr = PagedKVCacheManager(params, 2, 32, 1)
    (s,) = mgr.claim(1)
    (inp,) = mgr.fetch([BatchItem(s, list(range(9)))])
    torch.manual_seed(0)
    k, v = torch.randn(9, H, D), torch.randn(9, H, D)
    views = (inp.k_cache(0), inp.v_cache(0))
    ops.append_kv(*views, k, v, inp.qo_indptr, inp.cache_lengths, inp.lookup_table)
    mgr.step([BatchItem(s, list(range(9)))])
    lengths = torch.tensor([8], dtype=torch.int32)
    table = inp.lookup_table[:1].clone()
    q = torch.randn(1, H * G, D)
    return views, ops.prepare_decode_attention(q, *views, lengths, table)


def test_rebind_refuses_a_cache_of_another_storage_type():
    """An int8 launch rebound to float8 views (or the other way) took the bytes as its own
    type: attention off by 1.1 with no error (the slot holds float8 as its int8 view)."""
    (ik, iv), i8_launch = _quant_tables("int8")
    (fk, fv), f8_launch = _quant_tables("float8_e4m3fn")
    with pytest.raises(InvalidArgumentError, match="k_cache: expected a int8 cache"):
        i8_launch.rebind(k_cache=fk, v_cache=fv)
    with pytest.raises(InvalidArgumentError, match="k_cache: expected a float8_e4m3fn cache"):
        f8_launch.rebind(k_cache=ik, v_cache=iv)
    # its own storage rebinds (the float8 views taken as the kernel's int8 view)
    again = f8_launch.rebind(k_cache=fk, v_cache=fv)
    assert torch.equal(again.run()[0], f8_launch.run()[0])


@pytest.mark.parametrize("slot", ["cache_lengths", "lookup_table", "sm_scale"])
def test_rebind_refuses_the_slots_a_plan_does_not_swap(slot):
    """Tables rebound skipped the op's staleness and index checks: a superseded fetch's
    tables, or a length past the sequence's pages, ran."""
    _, launch = _quant_tables("int8")
    with pytest.raises(InvalidArgumentError, match=f"{slot}: expected one of the slots"):
        launch.rebind(**{slot: launch.slots[slot]})


def test_kvtvm_plan_is_reachable_from_import_kvtvm():
    """docs/kernels.md writes ``kvtvm.plan.plan_step(inputs)``: after ``import kvtvm`` alone
    that was an AttributeError."""
    from helpers import run_python

    out = run_python("import kvtvm; print(kvtvm.plan.plan_step is kvtvm.plan_step)")
    assert out.split()[-1] == "True"
