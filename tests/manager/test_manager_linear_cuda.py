"""LinearKVCache on a CUDA device: lengths kept in a device buffer, K/V appended by the CUDA
append kernel (layout hnd) through ``step_inputs``, read back by the CUDA decode kernel
(checked against the numpy reference), and ``evict`` compacting the batch with the CUDA copy
kernel; the cache is compared with a dense shadow after every step.

Kernels: append, decode (group 4) and copy, float16, 8 KV heads x 128, hnd (tools/gpu-kit.sh)."""

import numpy as np
import pytest
import torch

from kvtvm import KVCacheParams, ops
from kvtvm.kernels.reference import reference_decode
from kvtvm.manager import LinearKVCache

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

H, G, D, LAYERS, MAX_LEN = 8, 4, 128, 2, 128


def _write(cache, new, gen, shadow):
    """Append ``new[b]`` random rows per active sequence on the GPU; mirror them in ``shadow``
    ([sequence] -> list of [LAYERS, 2, H, D] rows); returns the step's inputs."""
    (inp,) = cache.step_inputs(new)
    assert inp.cache_lengths.is_cuda and inp.layout == "hnd"
    new = [new] * cache.active_batch_size if isinstance(new, int) else list(new)
    kv = torch.randn(LAYERS, 2, sum(new), H, D, generator=gen).half()
    coll = inp.collection()
    for layer in range(LAYERS):
        ops.append_kv(coll.get_key_cache(layer).blocks, coll.get_value_cache(layer).blocks,
                      kv[layer, 0].cuda(), kv[layer, 1].cuda(), inp.qo_indptr,
                      inp.cache_lengths, inp.lookup_table, layout="hnd")
    off = 0
    for b, n in enumerate(new):
        shadow[b].extend(kv[:, :, off + j] for j in range(n))
        off += n
    return inp, new


def _check(cache, shadow):
    assert cache.host_lengths.tolist() == [len(rows) for rows in shadow]
    assert cache.kv_cache_lengths.cpu().tolist() == cache.host_lengths.tolist()
    buf = cache.get_kv_cache_buffer().cpu()  # [L, batch, 2, H, max_len, D]
    for b, rows in enumerate(shadow):
        want = torch.stack(rows, dim=2)  # [L, 2, T, H, D]
        got = buf[:, b, :, :, :len(rows)].transpose(2, 3)
        assert torch.equal(got, want), f"sequence {b}"


def test_prompt_decode_and_evict_on_cuda():
    gen = torch.Generator().manual_seed(0)
    params = KVCacheParams("float16", H, D, "linear")
    cache = LinearKVCache(params, 4, MAX_LEN, LAYERS, devices=("cuda",))
    assert cache.get_kv_cache_buffer().is_cuda
    cache.reset_for_new_sequences([0, 0, 0])
    shadow = [[], [], []]
    _, new = _write(cache, [20, 32, 7], gen, shadow)
    cache.commit_sequence_length(torch.tensor(new, dtype=torch.int32))
    _check(cache, shadow)
    for step in range(5):
        if step == 3:  # drop the middle sequence: the copy kernel moves the last one down
            cache.evict([0, 2])
            shadow = [shadow[0], shadow[2]]
            _check(cache, shadow)
        inp, _ = _write(cache, 1, gen, shadow)
        batch = cache.active_batch_size
        q = torch.randn(batch, H * G, D, generator=gen).half()
        for layer in range(LAYERS):
            # the whole layer, the fetch's own view (a [:batch] slice of it is refused like
            # any other slice, tests/ops): the table names the active slots
            layer_cache = cache.get_kv_cache_for_decoder_layer(layer)
            kc, vc = layer_cache[:, 0], layer_cache[:, 1]
            out, lse = ops.decode_attention(q.cuda(), kc, vc, inp.cache_lengths,
                                            inp.lookup_table, layout="hnd")
            want_o, want_l = reference_decode(
                q.float().numpy(), kc.float().cpu().numpy(), vc.float().cpu().numpy(),
                inp.cache_lengths.cpu().numpy(), inp.lookup_table.cpu().numpy(), layout="hnd")
            torch.cuda.synchronize()
            np.testing.assert_allclose(out.float().cpu().numpy(), want_o, rtol=1e-2, atol=1e-2)
            np.testing.assert_allclose(lse.cpu().numpy(), want_l, rtol=1e-2, atol=1e-2)
        cache.commit_sequence_length(1)
        _check(cache, shadow)
