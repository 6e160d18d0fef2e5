"""Managers on a CUDA device: per-step tables uploaded into fixed device buffers (one
host-to-device copy per step), K/V written by the CUDA append kernel through the fetched inputs
and read back by the CUDA decode kernel; tables compared with the same steps on a CPU manager,
cache contents with a dense shadow, attention with the numpy reference.

Kernels: append and decode, float16, 8 KV heads x 128, group size 4, nhd (built by
tools/gpu-kit.sh)."""

import numpy as np
import pytest
import torch

from kvtvm import KVCacheParams, ops
from kvtvm.inputs import BatchItem, TokenBatch
from kvtvm.kernels.reference import reference_decode
from kvtvm.manager import ContinuousBatchingKVCacheManager, PagedKVCacheManager

from helpers import run_step as _run_step  # the plain-ops / plan_step step both tests compare

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

H, G, D, LAYERS, P = 8, 4, 128, 2, 16


def _managers(strategy):
    if strategy == "paged":
        params = KVCacheParams("float16", H, D, "paged", page_size=P, enable_prefix_caching=True)
        return (PagedKVCacheManager(params, 4, 256, LAYERS, devices=("cuda",)),
                PagedKVCacheManager(params, 4, 256, LAYERS))
    params = KVCacheParams("float16", H, D, "continuous")
    return (ContinuousBatchingKVCacheManager(params, 4, 256, LAYERS, devices=("cuda",)),
            ContinuousBatchingKVCacheManager(params, 4, 256, LAYERS))


def _tables(inp):
    return (inp.cache_lengths.cpu().tolist(), inp.qo_indptr.cpu().tolist(),
            inp.lookup_table.cpu().tolist())


@pytest.mark.parametrize("strategy", ["paged", "continuous"])
def test_decode_loop_on_cuda(strategy):
    gpu, cpu = _managers(strategy)
    gen = torch.Generator().manual_seed(0)
    ids = gpu.claim(3)
    assert cpu.claim(3) == ids
    shadow = {s: [] for s in ids}  # per sequence: [layer][k|v] rows written, host fp16
    prompts = {ids[0]: 20, ids[1]: 2 * P, ids[2]: 7}  # one prompt ends on a page boundary
    addresses = None
    for step in range(6):
        if step == 0:
            pairs = [(s, list(range(100, 100 + n))) for s, n in prompts.items()]
        else:
            pairs = [(s, [step]) for s in ids]
        batch = ([BatchItem(s, t) for s, t in pairs] if step % 2 == 0 else
                 TokenBatch([s for s, _ in pairs], [x for _, t in pairs for x in t],
                            [len(t) for _, t in pairs]))
        (inp,) = gpu.fetch(batch)
        (ref,) = cpu.fetch(batch)
        assert inp.cache_lengths.is_cuda and inp.lookup_table.is_cuda
        assert _tables(inp) == _tables(ref)
        ptrs = (inp.cache_lengths.data_ptr(), inp.qo_indptr.data_ptr(),
                inp.lookup_table.data_ptr())
        assert addresses in (None, ptrs), "per-step tables moved (not CUDA-graph friendly)"
        addresses = ptrs
        rows = int(inp.qo_indptr_host[-1])
        k = torch.randn(LAYERS, rows, H, D, generator=gen).half()
        v = torch.randn(LAYERS, rows, H, D, generator=gen).half()
        for layer in range(LAYERS):
            ops.append_kv(inp.k_cache(layer), inp.v_cache(layer), k[layer].cuda(),
                          v[layer].cuda(), inp.qo_indptr, inp.cache_lengths, inp.lookup_table)
        for b, (s, _) in enumerate(pairs):
            lo, hi = int(inp.qo_indptr_host[b]), int(inp.qo_indptr_host[b + 1])
            shadow[s].append((k[:, lo:hi], v[:, lo:hi]))
        if step > 0:  # decode attention over everything written, on the GPU
            q = torch.randn(len(ids), H * G, D, generator=gen).half()
            for layer in range(LAYERS):
                kc, vc = inp.k_cache(layer), inp.v_cache(layer)
                out, lse = ops.decode_attention(q.cuda(), kc, vc, inp.cache_lengths,
                                                inp.lookup_table)
                want_o, want_l = reference_decode(
                    q.float().numpy(), kc.float().cpu().numpy(), vc.float().cpu().numpy(),
                    inp.cache_lengths_host, inp.lookup_table.cpu().numpy())
                torch.cuda.synchronize()
                np.testing.assert_allclose(out.float().cpu().numpy(), want_o, rtol=1e-2,
                                           atol=1e-2)
                np.testing.assert_allclose(lse.cpu().numpy(), want_l, rtol=1e-2, atol=1e-2)
        gpu.step(batch)
        cpu.step(batch)
    # every row written is where the pages say, on the GPU
    (inp,) = gpu.fetch([BatchItem(s, [0]) for s in ids])
    table = inp.lookup_table.cpu().numpy()
    for layer in range(LAYERS):
        kc = inp.k_cache(layer).cpu()
        width = kc.shape[1]  # page size (the whole sequence for the continuous manager)
        for b, s in enumerate(ids):
            want = torch.cat([kk[layer] for kk, _ in shadow[s]])
            pos = np.arange(want.shape[0])
            got = kc[torch.from_numpy(table[b, pos // width]).long(), torch.from_numpy(pos % width)]
            assert torch.equal(got, want), f"seq {s} layer {layer}"


def test_multistep_lengths_advance_on_the_device():
    params = KVCacheParams("float16", H, D, "paged", page_size=P)
    mgr = PagedKVCacheManager(params, 2, 64, LAYERS, devices=("cuda",))
    a, b = mgr.claim(2)
    mgr.fetch([BatchItem(a, [1] * 5), BatchItem(b, [2] * 3)])
    mgr.step([BatchItem(a, [1] * 5), BatchItem(b, [2] * 3)])
    first = mgr.fetch([BatchItem(a, [3]), BatchItem(b, [4])], num_steps=3)
    nxt = mgr.increment_cache_lengths(first)
    last = mgr.increment_cache_lengths(nxt)
    assert nxt[0].cache_lengths.is_cuda
    assert nxt[0].cache_lengths.cpu().tolist() == [6, 4]
    assert last[0].cache_lengths.cpu().tolist() == [7, 5]
    assert first[0].cache_lengths.cpu().tolist() == [5, 3]  # the old inputs are unchanged
    assert last[0].max_lengths.tolist() == [[1, 8]]
    mgr.step([BatchItem(a, [3, 5, 6]), BatchItem(b, [4, 5, 6])])
    assert (mgr.cache_length(a), mgr.cache_length(b)) == (8, 6)


def test_step_plan_on_cuda_equals_the_ops():
    """ops.plan_step replays the first layer's launches on the others, on the GPU too."""
    outs = []
    for planned in (False, True):
        gpu, _ = _managers("paged")
        ids = gpu.claim(2)
        gen = torch.Generator().manual_seed(3)
        for b in gpu.blocks:
            b.copy_(torch.randn(b.shape, generator=gen).half())
        prompts = [BatchItem(ids[0], [1] * 9), BatchItem(ids[1], [2] * 16)]
        gpu.fetch(prompts)
        gpu.step(prompts)
        q = torch.randn(2, H * G, D, generator=gen).half().cuda()
        k = torch.randn(2, H, D, generator=gen).half().cuda()
        got = _run_step(gpu, TokenBatch(ids, [3, 4]), [(q, k, k)] * LAYERS, planned)
        torch.cuda.synchronize()
        outs.append([(o.cpu(), ls.cpu()) for o, ls in got])
    for (ao, al), (bo, bl) in zip(*outs):
        assert torch.equal(ao, bo) and torch.equal(al, bl)
