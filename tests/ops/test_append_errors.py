"""append_kv rejects bad input with a typed error naming the argument, and writes nothing."""

import numpy as np
import pytest
import torch

from kvtvm import ops
from kvtvm.errors import (DeviceMismatchError, DTypeMismatchError, InvalidArgumentError,
                          KVCacheError, SequenceTooLongError)

H, D, P, S = 2, 16, 6, 4


def good_args():
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(P, 2, 2, S, H, D, generator=g)
    return dict(k_cache=cache[:, 0, 1], v_cache=cache[:, 1, 1],
                k=torch.randn(5, H, D, generator=g), v=torch.randn(5, H, D, generator=g),
                qo_indptr=torch.tensor([0, 2, 5], dtype=torch.int32),
                cache_lengths=torch.tensor([1, 3], dtype=torch.int32),
                lookup_table=torch.tensor([[3, 0], [5, 2]], dtype=torch.int32)), cache


def expect_error(error, match, **changes):
    args, cache = good_args()
    before = cache.clone()
    args.update(changes)
    with pytest.raises(error, match=match) as info:
        ops.append_kv(**args)
    assert isinstance(info.value, KVCacheError)
    assert torch.equal(cache, before), "a rejected call wrote to the cache"
    return str(info.value)


def test_good_args_work():
    args, cache = good_args()
    before = cache.clone()
    ops.append_kv(**args)
    assert not torch.equal(cache, before)


def test_wrong_dtype_of_new_rows():
    msg = expect_error(DTypeMismatchError, "k: expected float32, got float16",
                       k=torch.randn(5, H, D).half())
    assert "float16" in msg


def test_unsupported_cache_dtype():
    expect_error(DTypeMismatchError, "k_cache", k_cache=torch.zeros(P, S, H, D,
                                                                    dtype=torch.float64))


def test_a_cache_of_no_pages_names_the_page_not_an_alias():
    """K and V views of an empty cache tensor share a null data pointer; they are not the
    same memory (it said "k_cache and v_cache: expected separate memory")."""
    empty = torch.zeros(0, 2, 2, S, H, D)
    expect_error(InvalidArgumentError, r"lookup_table\[0, 0\]: expected a page in \[0, 0\)",
                 k_cache=empty[:, 0, 1], v_cache=empty[:, 1, 1])


@pytest.mark.parametrize("which", ["expand", "as_strided"])
def test_a_self_overlapping_cache_view_is_refused(which):
    """A written view whose elements share memory (every page the same memory, or rows
    overlapping): the append would land in other pages; refused like torch refuses it."""
    if which == "expand":
        view = torch.zeros(1, S, H, D).expand(P, S, H, D)
    else:
        view = torch.zeros(P * S * H * D).as_strided((P, S, H, D), (S * H * D, H * D, 1, 1))
    expect_error(InvalidArgumentError, r"k_cache.stride\(\)", k_cache=view)


def test_wrong_rank():
    expect_error(InvalidArgumentError, "k: expected rank 3", k=torch.randn(5, H * D))


def test_wrong_heads():
    expect_error(InvalidArgumentError, r"k.shape\[1\] \(n_kv_heads\)", k=torch.randn(5, 3, D))


def test_v_shape_differs():
    expect_error(InvalidArgumentError, "v", v=torch.randn(4, H, D))


def test_non_contiguous_head_dim():
    args, _ = good_args()
    strided = torch.randn(P, S, H, 2 * D)[..., ::2]
    expect_error(InvalidArgumentError, r"k_cache.stride\(-1\)", k_cache=strided)


def test_lookup_table_not_int32():
    expect_error(DTypeMismatchError, "lookup_table: expected int32, got int64",
                 lookup_table=torch.tensor([[3, 0], [5, 2]]))


def test_lookup_table_out_of_range():
    msg = expect_error(InvalidArgumentError, r"lookup_table\[1, 1\]",
                       lookup_table=torch.tensor([[3, 0], [5, P]], dtype=torch.int32))
    assert f"[0, {P})" in msg and str(P) in msg


def test_negative_page_in_use():
    expect_error(InvalidArgumentError, r"lookup_table\[0, 0\]",
                 lookup_table=torch.tensor([[-1, 0], [5, 2]], dtype=torch.int32))


def test_length_past_capacity():
    # sequence 1 holds 2 pages of 4 = 8 tokens; 7 cached + 3 new = 10
    msg = expect_error(SequenceTooLongError, r"cache_lengths\[1\] \+ new tokens",
                       cache_lengths=torch.tensor([1, 7], dtype=torch.int32))
    assert "10" in msg and "8" in msg


def test_negative_length():
    expect_error(InvalidArgumentError, r"cache_lengths\[0\]: expected >= 0, got -1",
                 cache_lengths=torch.tensor([-1, 3], dtype=torch.int32))


def test_indptr_inconsistent():
    expect_error(InvalidArgumentError, r"qo_indptr\[-1\]",
                 qo_indptr=torch.tensor([0, 2, 4], dtype=torch.int32))
    expect_error(InvalidArgumentError, "non-decreasing",
                 qo_indptr=torch.tensor([0, 6, 5], dtype=torch.int32))
    expect_error(InvalidArgumentError, r"qo_indptr.shape\[0\]",
                 qo_indptr=torch.tensor([0, 5], dtype=torch.int32))


def test_batch_mismatch():
    expect_error(InvalidArgumentError, r"lookup_table.shape\[0\] \(batch\)",
                 lookup_table=torch.tensor([[3, 0]], dtype=torch.int32))


def test_wrong_layout_name():
    expect_error(InvalidArgumentError, "layout", layout="nchw")


def test_tensors_on_different_devices():
    expect_error(DeviceMismatchError, "k: expected device cpu",
                 k=torch.empty(5, H, D, device="meta"))


def test_not_a_tensor():
    expect_error(InvalidArgumentError, "a torch.Tensor or numpy.ndarray", k=[[1.0]])


def test_numpy_wrong_dtype():
    expect_error(DTypeMismatchError, "lookup_table",
                 lookup_table=np.array([[3, 0], [5, 2]], dtype=np.int64))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensor_on_other_gpu():  # pragma: no cover - GPU machines only
    args, _ = good_args()
    cuda = {k: v.to("cuda:0") for k, v in args.items()}
    cuda["k"] = cuda["k"].to("cuda:1")
    with pytest.raises(DeviceMismatchError, match="k: expected device cuda:0"):
        ops.append_kv(**cuda)


@pytest.mark.parametrize("extra", [0, 1], ids=["at-the-limit", "past-it"])
def test_batch_up_to_the_kernels_search_depth(extra):
    """One token for each of MAX_APPEND_BATCH (+1) sequences: the kernels' binary search of
    qo_indptr reaches exactly that many sequences, so one more is refused before anything is
    written (it was a KernelIndexError after the first 2**17 sequences had been written)."""
    from kvtvm.kernels.accessor import SEARCH_STEPS
    from kvtvm.ops.append import MAX_APPEND_BATCH

    assert MAX_APPEND_BATCH == 2 ** (SEARCH_STEPS + 1)
    batch = MAX_APPEND_BATCH + extra
    kc, vc = torch.zeros(batch, 1, 1, 4), torch.zeros(batch, 1, 1, 4)
    k, v = torch.randn(batch, 1, 4), torch.randn(batch, 1, 4)
    indptr = torch.arange(batch + 1, dtype=torch.int32)
    table = torch.randperm(batch).to(torch.int32).view(batch, 1)
    args = (kc, vc, k, v, indptr, torch.zeros(batch, dtype=torch.int32), table)
    if extra:
        with pytest.raises(InvalidArgumentError, match=r"batch.*at most 131072"):
            ops.append_kv(*args)
        assert not kc.any() and not vc.any()
    else:
        ops.append_kv(*args)
        pages = table[:, 0].long()
        assert torch.equal(kc[pages, 0], k) and torch.equal(vc[pages, 0], v)
