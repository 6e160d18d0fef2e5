"""What the ops' boundary checks see beyond dtype and shape (kvtvm/ops/checks.py):

- K and V cache views that overlap element by element (one head apart in one buffer, 8-bit rows
  one row apart) are refused by append -- before, only views with the same data pointer were,
  and V's rows landed over K's; the interleaved K/V views of every manager stay accepted. The
  element test is checked against brute force on random strided views of one buffer.
- an int32 table inside a written tensor (a page table stored in a cache page, ``lse`` over the
  page table) is refused before anything is written (append wrote into the wrong page; decode
  overwrote the table, then raised over float bits);
- tensors the kernels write bump their autograd version counters, as torch's in-place ops do: a
  tensor saved for a backward and then written by kvtvm makes the backward raise (it silently
  used the new values);
- attention reads the caches only: read-only numpy caches are accepted and give the same output;
- a uint8 cache at a storage offset not a multiple of 4 is a typed error naming it (was torch's
  bare RuntimeError); non-strided tensors (mkldnn) are typed errors (were RuntimeErrors).
"""

import itertools

import numpy as np
import pytest
import torch

from kvtvm import KVCacheParams, ops
from kvtvm.errors import InvalidArgumentError
from kvtvm.manager import BatchItem, PagedKVCacheManager
from kvtvm.ops.checks import _elements_meet

P, PS, H, D = 6, 4, 2, 16


def _tables():
    return (torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32),
            torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))


def _rows(n=3, heads=H, d=D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, heads, d, generator=gen), torch.randn(n, heads, d, generator=gen)


@pytest.mark.parametrize("how", ["v one head past k", "v one element past k"])
def test_append_refuses_k_and_v_views_that_overlap(how):
    buf = torch.randn(P, PS, H + 1, D)
    if how == "v one head past k":
        kc, vc = buf[:, :, :H], buf[:, :, 1:]
    else:
        flat = torch.randn(P * PS * H * D + 1)
        kc, vc = flat[:-1].view(P, PS, H, D), flat[1:].view(P, PS, H, D)
        buf = flat
    before = buf.clone()
    k, v = _rows()
    with pytest.raises(InvalidArgumentError, match="k_cache and v_cache"):
        ops.append_kv(kc, vc, k, v, *_tables())
    assert torch.equal(buf, before)


def test_append_refuses_8bit_views_one_row_apart():
    from kvtvm.quant import quant_row_bytes

    row = quant_row_bytes(D)
    flat = torch.zeros(P * PS * H * row + row, dtype=torch.int8)
    kc = flat[:-row].view(P, PS, H, row)
    vc = flat[row:].view(P, PS, H, row)
    k, v = _rows()
    with pytest.raises(InvalidArgumentError, match="k_cache and v_cache"):
        ops.append_kv(kc, vc, k, v, *_tables())
    assert not flat.any()


@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
def test_managers_interleaved_k_and_v_views_are_still_accepted(cache_dtype):
    params = KVCacheParams("float32", H, D, "paged", page_size=PS, cache_dtype=cache_dtype)
    mgr = PagedKVCacheManager(params, 2, 64, num_layers=2)
    seqs = mgr.claim(2)
    (inp,) = mgr.fetch([BatchItem(s, list(range(5 + i))) for i, s in enumerate(seqs)])
    k, v = _rows(11)
    for layer in range(2):
        ops.append_kv(inp.k_cache(layer), inp.v_cache(layer), k, v, inp.qo_indptr,
                      inp.cache_lengths, inp.lookup_table)


def _brute_meet(a, b, base):
    """Byte sets of two views' elements (offsets into ``base``'s storage) intersect."""
    def byte_set(t):
        size, start = t.element_size(), t.data_ptr() - base.data_ptr()
        out = set()
        for idx in itertools.product(*(range(n) for n in t.shape)):
            off = start + size * sum(i * s for i, s in zip(idx, t.stride()))
            out.update(range(off, off + size))
        return out
    return bool(byte_set(a) & byte_set(b))


def test_element_overlap_test_equals_brute_force():
    """Random views of one buffer with the same shape and nested strides (every axis steps
    past what the smaller ones span, as a cache view's do), at random offsets -- but a whole
    number of pages apart."""
    rng = np.random.default_rng(7)
    base = torch.zeros(4096, dtype=torch.int8)
    checked = met = 0
    while checked < 400:
        rank = int(rng.integers(1, 4))
        shape = [int(rng.integers(1, 4)) for _ in range(rank)]
        strides, span = [], 1  # span: elements from the first to past the last
        for n in reversed(shape):  # innermost first
            stride = span + int(rng.integers(0, 3))
            strides.insert(0, stride)
            span += stride * (n - 1)
        dtype = [torch.int8, torch.float16, torch.float32][int(rng.integers(0, 3))]
        size = torch.tensor([], dtype=dtype).element_size()
        a0 = int(rng.integers(0, 32))
        b0 = a0 + int(rng.integers(-span - 2, span + 2))
        if b0 < 0 or max(a0, b0) + span > 4096 // size:
            continue
        typed = base.view(dtype)
        a = typed.as_strided(shape, strides, a0)
        b = typed.as_strided(shape, strides, b0)
        # views a whole number of pages (axis 0) apart are page arrays kept apart by their
        # page tables (transformers' K and V): not refused
        pages_apart = b0 != a0 and (b0 - a0) % strides[0] == 0
        want = _brute_meet(a, b, typed) and not pages_apart
        assert _elements_meet(a, b) == want == _elements_meet(b, a), (shape, strides, a0, b0)
        checked += 1
        met += want
    assert 40 < met < 360  # both answers were exercised


def test_append_refuses_a_page_table_inside_the_cache():
    blocks = torch.randn(P, 2, PS, H, D)
    table = blocks[5].view(-1).view(torch.int32)[:4].view(2, 2)
    table.copy_(torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))
    before = blocks.clone()
    indptr, lengths, _ = _tables()
    k, v = _rows()
    with pytest.raises(InvalidArgumentError, match="lookup_table"):
        ops.append_kv(blocks[:, 0], blocks[:, 1], k, v, indptr, lengths, table)
    assert torch.equal(blocks, before)


def test_prefill_refuses_out_over_qo_indptr():
    blocks = torch.randn(P, 2, PS, H, D)
    q = torch.randn(3, 2 * H, D)
    out = torch.zeros_like(q)
    indptr = out.view(-1).view(torch.int32)[:3].copy_(torch.tensor([0, 1, 3]))
    _, lengths, table = _tables()
    with pytest.raises(InvalidArgumentError, match="out and qo_indptr"):
        ops.prefill_attention(q, blocks[:, 0], blocks[:, 1], indptr, lengths, table, out=out)
    assert indptr.tolist() == [0, 1, 3]


def _saved_for_backward(t):
    x = torch.randn(t.shape, requires_grad=True)
    return (x * t).sum(), x   # mul saves t for x's gradient


def test_a_cache_written_by_append_after_autograd_saved_it_fails_the_backward():
    blocks = torch.randn(P, 2, PS, H, D)
    loss, _ = _saved_for_backward(blocks)
    version = blocks._version
    k, v = _rows()
    ops.append_kv(blocks[:, 0], blocks[:, 1], k, v, *_tables())
    assert blocks._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_attention_out_written_after_autograd_saved_it_fails_the_backward():
    blocks = torch.randn(P, 2, PS, H, D)
    q = torch.randn(2, 2 * H, D)
    out, lse = torch.empty_like(q), torch.empty(2, 2 * H)
    loss, _ = _saved_for_backward(out)
    _, lengths, table = _tables()
    ops.decode_attention(q, blocks[:, 0], blocks[:, 1], lengths, table, out=out, lse=lse)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_copy_bumps_the_version_of_the_cache():
    blocks = torch.randn(P, 2, PS, H, D)
    loss, _ = _saved_for_backward(blocks)
    ops.copy_pages(blocks, torch.tensor([1], dtype=torch.int32),
                   torch.tensor([2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_under_inference_mode_the_ops_run_on_inference_tensors():
    with torch.inference_mode():
        blocks = torch.randn(P, 2, PS, H, D)
        k, v = _rows()
        ops.append_kv(blocks[:, 0], blocks[:, 1], k, v, *_tables())
        q = torch.randn(2, 2 * H, D)
        _, lengths, table = _tables()
        out, _ = ops.decode_attention(q, blocks[:, 0], blocks[:, 1], lengths, table)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_attention_reads_read_only_numpy_caches(op):
    blocks = torch.randn(P, 2, PS, H, D)
    frozen = blocks.numpy().copy()
    frozen.flags.writeable = False
    indptr, lengths, table = _tables()
    if op == "decode":
        q = torch.randn(2, 2 * H, D)
        call = lambda kc, vc: ops.decode_attention(q, kc, vc, lengths, table)  # noqa: E731
    else:
        q = torch.randn(3, 2 * H, D)
        call = lambda kc, vc: ops.prefill_attention(q, kc, vc, indptr, lengths,  # noqa: E731
                                                    table)
    want = call(blocks[:, 0], blocks[:, 1])
    got = call(frozen[:, 0], frozen[:, 1])
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_copy_of_uint8_pages_at_an_odd_offset_is_a_typed_error():
    big = torch.arange(1 + 6 * 32, dtype=torch.uint8)
    blocks = big[1:].view(6, 32)
    before = big.clone()
    with pytest.raises(InvalidArgumentError, match="blocks.storage_offset"):
        ops.copy_pages(blocks, torch.tensor([1], dtype=torch.int32),
                       torch.tensor([2], dtype=torch.int32))
    assert torch.equal(big, before)
    aligned = big[4:4 + 5 * 32].view(5, 32)  # offset 4: copies
    ops.copy_pages(aligned, torch.tensor([1], dtype=torch.int32),
                   torch.tensor([2], dtype=torch.int32))
    assert torch.equal(aligned[2], aligned[1])


def test_non_strided_tensors_are_typed_errors():
    blocks = torch.randn(P, 2, PS, H, D)
    q = torch.randn(2, 2 * H, D)
    _, lengths, table = _tables()
    with pytest.raises(InvalidArgumentError, match="q: expected a strided tensor"):
        ops.decode_attention(q.to_mkldnn(), blocks[:, 0], blocks[:, 1], lengths, table)
    with pytest.raises(InvalidArgumentError, match="blocks: expected a strided tensor"):
        ops.copy_pages(blocks.view(P, -1).to_mkldnn(), torch.tensor([1], dtype=torch.int32),
                       torch.tensor([2], dtype=torch.int32))


def test_a_one_page_cache_with_a_zero_page_stride_is_written():
    """numpy's ``blocks[0][None]``: the page axis of one page has stride 0 (a
    ZeroDivisionError in the element test)."""
    blocks = np.zeros((1, 2, PS, H, D), np.float32)
    kc, vc = blocks[0, 0][None], blocks[0, 1][None]
    k, v = _rows(2)
    ops.append_kv(kc, vc, k, v, torch.tensor([0, 2], dtype=torch.int32),
                  torch.tensor([0], dtype=torch.int32), torch.tensor([[0]], dtype=torch.int32))
    assert np.array_equal(blocks[0, 0, :2], k.numpy()) and np.array_equal(blocks[0, 1, :2],
                                                                          v.numpy())


def test_page_arrays_one_page_apart_need_a_table_that_keeps_them_apart():
    buf = torch.zeros(P + 1, PS, H, D)
    kc, vc = buf[:-1], buf[1:]         # V's page i is K's page i + 1
    k, v = _rows(6)
    indptr, lengths = torch.tensor([0, 6], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match="lookup_table.*keep K and V apart"):
        ops.append_kv(kc, vc, k, v, indptr, lengths, torch.tensor([[0, 1]], dtype=torch.int32))
    assert not buf.any()
    ops.append_kv(kc, vc, k, v, indptr, lengths, torch.tensor([[0, 2]], dtype=torch.int32))
    assert torch.equal(kc[0], k[:4]) and torch.equal(kc[2, :2], k[4:])
    assert torch.equal(vc[0], v[:4]) and torch.equal(vc[2, :2], v[4:])


def test_a_cache_and_its_tables_in_one_arena():
    """Disjoint bytes of one buffer: the strided cache views' element range, not their whole
    storage, is compared with the tables (it was refused)."""
    n_cache = P * 2 * PS * H * D
    arena = torch.zeros(n_cache + 16)
    blocks = arena[:n_cache].view(P, 2, PS, H, D)
    ints = arena[n_cache:].view(torch.int32)
    indptr, lengths, table = ints[0:3], ints[3:5], ints[5:9].view(2, 2)
    for dst, src in zip((indptr, lengths, table), _tables()):
        dst.copy_(src)
    k, v = _rows()
    ops.append_kv(blocks[:, 0], blocks[:, 1], k, v, indptr, lengths, table)
    assert torch.equal(blocks[0, 0, 2], k[0])


def test_a_structured_array_field_is_a_typed_error():
    """Strides that are not whole items (a field of a structured array): torch's bare
    ValueError before."""
    rows = np.zeros((2, 2 * H, D), dtype=[("x", np.float32), ("pad", np.int8)])
    blocks = torch.randn(P, 2, PS, H, D)
    _, lengths, table = _tables()
    with pytest.raises(InvalidArgumentError, match="q: expected an array whose strides"):
        ops.decode_attention(rows["x"], blocks[:, 0], blocks[:, 1], lengths, table)
