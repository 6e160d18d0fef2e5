"""Caches past 2**31 elements (or bytes): every offset a kernel computes must be 64-bit.

An 80 GB GPU holds caches of tens of billions of elements, so an int32 offset anywhere (page
index times page stride, a token's row) would wrap and write into another page or outside the
tensor. Here the cache is ``torch.empty`` of a little more than 2**31 elements -- virtual
memory: only the pages a test touches are ever backed -- and the sequence lives in its last
pages, whose offsets do not fit in an int32. Append, decode, prefill and page copy must land
and read exactly where a 64-bit offset says, checked against numpy on the few pages touched.
"""

import numpy as np
import pytest
import torch

from kvtvm import KVCacheParams, ops
from kvtvm.quant import dequantize_rows, quantize_rows
from kvtvm.storage import layer_view

PS, H, HQ, D = 16, 2, 4, 64


def _attend(q, k, v, causal_from=None):
    """float64 attention of q [n, HQ, D] over k, v [m, H, D] (GQA), causal when
    ``causal_from`` is the cached length before the n query rows."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    k, v = np.repeat(k, HQ // H, axis=1), np.repeat(v, HQ // H, axis=1)
    s = np.einsum("nhd,mhd->hnm", q, k) / np.sqrt(D)
    if causal_from is not None:
        n, m = q.shape[0], k.shape[0]
        allowed = np.arange(m)[None, :] <= causal_from + np.arange(n)[:, None]
        s = np.where(allowed[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hnm,mhd->nhd", p, v)


def _big_cache(storage):
    """(blocks, k view, v view, num_pages) of a one-layer paged cache past 2**31 elements."""
    if storage == "float32":
        per_page = 2 * PS * H * D
        num_pages = 2 ** 31 // per_page + 40
        blocks = torch.empty((num_pages, 2, 1, PS, H, D), dtype=torch.float32)
        assert blocks.numel() > 2 ** 31
        return blocks, blocks[:, 0, 0], blocks[:, 1, 0], num_pages
    params = KVCacheParams("float32", H, D, "paged", page_size=PS, cache_dtype=storage)
    num_pages = 2 ** 31 // params.bytes_per_page(1) + 40
    blocks = torch.empty(params.cache_shape(1, 1, PS, num_pages), dtype=torch.uint8)
    assert blocks.numel() > 2 ** 31
    return (blocks, layer_view(blocks, params, 1, 0, 0), layer_view(blocks, params, 1, 0, 1),
            num_pages)


@pytest.mark.parametrize("storage", ["float32", "int8"])
def test_ops_on_pages_past_2_31_elements(storage):
    gen = torch.Generator().manual_seed(31)
    blocks, kc, vc, num_pages = _big_cache(storage)
    pages = [num_pages - 7, num_pages - 1, num_pages - 4]  # scattered, all past 2**31
    table = torch.tensor([pages], dtype=torch.int32)
    n0, n1 = 21, 9  # a prompt crossing a page, then a chunk that crosses the next one
    k = torch.randn(n0 + n1, H, D, generator=gen)
    v = torch.randn(n0 + n1, H, D, generator=gen)
    for start, n in ((0, n0), (n0, n1)):
        ops.append_kv(kc, vc, k[start:start + n], v[start:start + n],
                      torch.tensor([0, n], dtype=torch.int32),
                      torch.tensor([start], dtype=torch.int32), table)
    total = n0 + n1
    stored_k = torch.cat([kc[p] for p in pages])[:total]
    stored_v = torch.cat([vc[p] for p in pages])[:total]
    if storage == "float32":
        assert torch.equal(stored_k, k) and torch.equal(stored_v, v)
        kd, vd = k.numpy(), v.numpy()
    else:  # the reference quantizer's exact bytes
        for got, x in ((stored_k, k), (stored_v, v)):
            want = quantize_rows(x.numpy(), storage)
            assert np.array_equal(got.numpy().view(np.uint8), want.view(np.uint8))
        kd = dequantize_rows(stored_k.numpy(), D)
        vd = dequantize_rows(stored_v.numpy(), D)

    q = torch.randn(1, HQ, D, generator=gen)
    out, _ = ops.decode_attention(q, kc, vc, torch.tensor([total - 1], dtype=torch.int32),
                                  table)
    np.testing.assert_allclose(out.numpy(), _attend(q.numpy(), kd, vd), atol=2e-5, rtol=1e-4)

    qp = torch.randn(n1, HQ, D, generator=gen)
    out, _ = ops.prefill_attention(qp, kc, vc, torch.tensor([0, n1], dtype=torch.int32),
                                   torch.tensor([n0], dtype=torch.int32), table)
    np.testing.assert_allclose(out.numpy(), _attend(qp.numpy(), kd, vd, causal_from=n0),
                               atol=2e-5, rtol=1e-4)

    # page copy between pages past 2**31: the copied page's bytes, and its neighbours untouched
    src, dst = pages[0], num_pages - 2
    blocks[dst - 1:dst + 2].view(torch.uint8).fill_(0x5A)
    ops.copy_pages(blocks, torch.tensor([src], dtype=torch.int32),
                   torch.tensor([dst], dtype=torch.int32))
    assert torch.equal(blocks[dst], blocks[src])
    for neighbour in (dst - 1, dst + 1):
        assert bool((blocks[neighbour].view(torch.uint8) == 0x5A).all())


def test_linear_slot_past_2_31_elements():
    """The linear layout (``hnd``): the last batch slot of a cache past 2**31 elements, written
    deep into its sequence axis, then attended."""
    gen = torch.Generator().manual_seed(32)
    S = 4096
    B = 2 ** 31 // (2 * H * S * D) + 3
    cache = torch.empty((1, B, 2, H, S, D), dtype=torch.float32)
    assert cache.numel() > 2 ** 31
    kc, vc = cache[0, :, 0], cache[0, :, 1]
    table = torch.tensor([[B - 1]], dtype=torch.int32)
    start, n = S - 50, 40
    k = torch.randn(n, H, D, generator=gen)
    v = torch.randn(n, H, D, generator=gen)
    ops.append_kv(kc, vc, k, v, torch.tensor([0, n], dtype=torch.int32),
                  torch.tensor([start], dtype=torch.int32), table, layout="hnd")
    assert torch.equal(kc[B - 1, :, start:start + n].transpose(0, 1), k)
    assert torch.equal(vc[B - 1, :, start:start + n].transpose(0, 1), v)
    # attend over the last n positions only: the earlier ones are whatever empty() held, so
    # give them known values first
    kc[B - 1, :, :start].normal_(generator=gen)
    vc[B - 1, :, :start].normal_(generator=gen)
    q = torch.randn(1, HQ, D, generator=gen)
    out, _ = ops.decode_attention(q, kc, vc, torch.tensor([start + n - 1], dtype=torch.int32),
                                  table, layout="hnd")
    kd = kc[B - 1, :, :start + n].transpose(0, 1).numpy()
    vd = vc[B - 1, :, :start + n].transpose(0, 1).numpy()
    np.testing.assert_allclose(out.numpy(), _attend(q.numpy(), kd, vd), atol=2e-5, rtol=1e-4)
