"""append_kv on the CPU (llvm) kernels against the numpy reference, every layout and dtype."""

import numpy as np
import pytest
import torch

from kvtvm import ops
from kvtvm.kernels.reference import reference_append
from kvtvm.params import torch_dtype

DTYPES = ["float16", "bfloat16", "float32"]
H, D = 2, 32


def random_batch(rng, page_size, new_counts, start_lengths, num_pages, layout, dtype,
                 num_layers=3, layer=1):
    """A random cache tensor in the manager's 6-D layout and a ragged batch writing into
    permuted, non-contiguous pages. Returns (cache, k_view, v_view, k, v, indptr, lengths,
    table)."""
    tdt = torch_dtype(dtype)
    batch = len(new_counts)
    final = [s + n for s, n in zip(start_lengths, new_counts)]
    pages_per_seq = max(1, max(-(-f // page_size) for f in final))
    needed = sum(-(-f // page_size) for f in final)
    assert needed <= num_pages
    perm = rng.permutation(num_pages)  # pages handed out in random order
    table = np.full((batch, pages_per_seq), -1, np.int32)
    cursor = 0
    for b, f in enumerate(final):
        n = -(-f // page_size)
        table[b, :n] = perm[cursor:cursor + n]
        cursor += n
    if layout == "nhd":
        cache = torch.randn(num_pages, 2, num_layers, page_size, H, D).to(tdt)
        kv, vv = cache[:, 0, layer], cache[:, 1, layer]
    else:  # LINEAR: [num_layers, slots, 2, H, S, D]
        cache = torch.randn(num_layers, num_pages, 2, H, page_size, D).to(tdt)
        kv, vv = cache[layer, :, 0], cache[layer, :, 1]
    total = sum(new_counts)
    k = torch.randn(total, H, D).to(tdt)
    v = torch.randn(total, H, D).to(tdt)
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(new_counts)]), dtype=torch.int32)
    lengths = torch.tensor(start_lengths, dtype=torch.int32)
    return cache, kv, vv, k, v, indptr, lengths, torch.from_numpy(table)


def check_against_reference(args, layout):
    cache, kv, vv, k, v, indptr, lengths, table = args
    ref_k, ref_v = reference_append(kv.float().numpy(), vv.float().numpy(), k.float().numpy(),
                                    v.float().numpy(), indptr.numpy(), lengths.numpy(),
                                    table.numpy(), layout)
    before = cache.clone()
    ops.append_kv(kv, vv, k, v, indptr, lengths, table, layout=layout)
    np.testing.assert_array_equal(kv.float().numpy(), ref_k)
    np.testing.assert_array_equal(vv.float().numpy(), ref_v)
    # other layers untouched
    if layout == "nhd":
        other = [i for i in range(cache.shape[2]) if i != 1]
        assert torch.equal(cache[:, :, other], before[:, :, other])
    else:
        assert torch.equal(cache[[0, 2]], before[[0, 2]])
    changed = (cache != before).any().item()
    assert changed == (k.shape[0] > 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_paged_permuted_pages(dtype, page_size):
    rng = np.random.default_rng(page_size)
    # sequences starting mid-page, crossing page boundaries, an empty one, a decode step
    counts = [5, 0, 37, 1, 16]
    starts = [3, 9, page_size - 1, 40, 0]
    num_pages = sum(-(-(s + n) // page_size) for s, n in zip(starts, counts)) + 7
    args = random_batch(rng, page_size, counts, starts, num_pages, "nhd", dtype)
    check_against_reference(args, "nhd")


@pytest.mark.parametrize("dtype", DTYPES)
def test_continuous_layout(dtype):
    """CONTINUOUS: one block of max_seq_len per sequence, lookup_table [batch, 1]."""
    rng = np.random.default_rng(1)
    max_seq_len = 64
    args = random_batch(rng, max_seq_len, [7, 0, 30], [0, 12, 33], 5, "nhd", dtype)
    assert args[-1].shape == (3, 1)
    check_against_reference(args, "nhd")


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_layout(dtype):
    """LINEAR: head-major [slots, H, max_seq_len, D] per layer, slot per sequence."""
    rng = np.random.default_rng(2)
    args = random_batch(rng, 48, [4, 11, 0, 1], [0, 20, 5, 47], 6, "hnd", dtype)
    check_against_reference(args, "hnd")


def test_numpy_inputs_zero_copy():
    rng = np.random.default_rng(3)
    k_cache = rng.standard_normal((6, 8, H, D)).astype(np.float32)
    v_cache = rng.standard_normal((6, 8, H, D)).astype(np.float32)
    k = rng.standard_normal((10, H, D)).astype(np.float32)
    v = rng.standard_normal((10, H, D)).astype(np.float32)
    indptr = np.array([0, 3, 10], np.int32)
    lengths = np.array([6, 2], np.int32)
    table = np.array([[4, 1], [0, 5]], np.int32)
    ref_k, ref_v = reference_append(k_cache, v_cache, k, v, indptr, lengths, table)
    ops.append_kv(k_cache, v_cache, k, v, indptr, lengths, table)  # written in place
    np.testing.assert_array_equal(k_cache, ref_k)
    np.testing.assert_array_equal(v_cache, ref_v)


def test_large_batch_binary_search():
    """Many sequences with one token each (decode step) locate their rows correctly."""
    rng = np.random.default_rng(4)
    batch = 300
    starts = rng.integers(0, 40, batch).tolist()
    counts = rng.integers(0, 3, batch).tolist()
    num_pages = sum(-(-(s + n) // 16) for s, n in zip(starts, counts)) + 1
    args = random_batch(rng, 16, counts, starts, max(num_pages, 1), "nhd", "float16")
    check_against_reference(args, "nhd")


@pytest.mark.parametrize("threshold", [0, 1 << 40], ids=["parallel", "serial"])
def test_large_append_in_both_variants(monkeypatch, threshold):
    """Above CPU_PARALLEL_APPEND_BYTES the parallel CPU kernel runs, below it the serial
    one; both write exactly what the reference writes."""
    from kvtvm.ops import append

    monkeypatch.setattr(append, "CPU_PARALLEL_APPEND_BYTES", threshold)
    rng = np.random.default_rng(5)
    counts = [924, 0, 130]
    starts = [7, 3, 16]
    num_pages = sum(-(-(s + n) // 16) for s, n in zip(starts, counts)) + 2
    args = random_batch(rng, 16, counts, starts, num_pages, "nhd", "float16")
    check_against_reference(args, "nhd")


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_one_head_of_one_element(layout):
    """n_kv_heads = head_dim = 1 (the CPU kernels take any head_dim): TVM drops both unit
    loops under the token loop, which the schedule must not expect (it failed to build)."""
    rng = np.random.default_rng(6)
    shape = (4, 5, 1, 1) if layout == "nhd" else (4, 1, 5, 1)
    kc = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
    vc = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
    k, v = (torch.from_numpy(rng.standard_normal((4, 1, 1)).astype(np.float32))
            for _ in range(2))
    indptr, lengths = torch.tensor([0, 3, 4], dtype=torch.int32), torch.tensor([4, 0],
                                                                               dtype=torch.int32)
    table = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)
    want_k, want_v = reference_append(kc.numpy(), vc.numpy(), k.numpy(), v.numpy(),
                                      indptr.numpy(), lengths.numpy(), table.numpy(), layout)
    ops.append_kv(kc, vc, k, v, indptr, lengths, table, layout=layout)
    np.testing.assert_array_equal(kc.numpy(), want_k)
    np.testing.assert_array_equal(vc.numpy(), want_v)
