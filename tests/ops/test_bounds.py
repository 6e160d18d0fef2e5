"""In-kernel bounds checks, every mode: with ``check_indices=False`` (the GPU default) an
out-of-range page, position or row offset is skipped by the kernel and reported as a
:class:`KernelIndexError`; nothing outside the tensors is read or written.

The cache is a view into the middle of a larger buffer filled with random values: the guard
rows before and after it must come out bit-identical, and the rows inside must equal the numpy
reference with the same skip semantics (:mod:`kvtvm.kernels.reference`).
"""

import numpy as np
import pytest
import torch

from kvtvm import ops
from kvtvm.errors import InvalidArgumentError, KernelIndexError
from kvtvm.kernels.errflag import ERR_INDPTR, ERR_PAGE, ERR_POSITION
from kvtvm.kernels.reference import reference_append, reference_errors

P, PS, H, D, GUARD = 8, 4, 2, 16, 3


def _guarded(gen, pages=P):
    """(whole buffer, cache view) of ``pages`` pages inside GUARD pages on either side."""
    whole = torch.randn(pages + 2 * GUARD, 2, PS, H, D, generator=gen)
    return whole, whole[GUARD:GUARD + pages]


def _append(gen, indptr, lengths, table, ntok):
    whole, cache = _guarded(gen)
    kc, vc = cache[:, 0], cache[:, 1]
    k, v = torch.randn(ntok, H, D, generator=gen), torch.randn(ntok, H, D, generator=gen)
    args = [torch.tensor(x, dtype=torch.int32) for x in (indptr, lengths, table)]
    want_k, want_v = reference_append(kc.numpy(), vc.numpy(), k.numpy(), v.numpy(),
                                      *(a.numpy() for a in args))
    before = whole.clone()
    return whole, before, kc, vc, k, v, args, want_k, want_v


@pytest.mark.parametrize("case,slot", [
    # cache_lengths = -1: position -1 would write before the tensor
    (dict(indptr=[0, 2, 4], lengths=[-1, 0], table=[[1, 2], [3, 4]]), ERR_POSITION),
    # rows past the sequence's capacity (2 pages of 4) would land in another sequence's page
    (dict(indptr=[0, 3, 4], lengths=[7, 0], table=[[1, 2], [3, 4]]), ERR_POSITION),
    # a page past the pool, and one 2**30 past it
    (dict(indptr=[0, 2, 4], lengths=[0, 0], table=[[P, 2], [3, 4]]), ERR_PAGE),
    (dict(indptr=[0, 2, 4], lengths=[0, 0], table=[[1, 2], [2 ** 30, 4]]), ERR_PAGE),
    (dict(indptr=[0, 2, 4], lengths=[0, 0], table=[[-5, 2], [3, 4]]), ERR_PAGE),
    # rows past qo_indptr[-1] belong to no sequence
    (dict(indptr=[0, 1, 2], lengths=[0, 0], table=[[1, 2], [3, 4]]), ERR_INDPTR),
])
def test_unchecked_append_skips_out_of_range_rows_and_raises(case, slot):
    gen = torch.Generator().manual_seed(slot)
    whole, before, kc, vc, k, v, args, want_k, want_v = _append(
        gen, case["indptr"], case["lengths"], case["table"], 4)
    with pytest.raises(KernelIndexError, match=["lookup_table", "cache_lengths",
                                                "qo_indptr"][slot]):
        ops.append_kv(kc, vc, k, v, *args, check_indices=False)
    assert torch.equal(whole[:GUARD], before[:GUARD]), "wrote before the cache"
    assert torch.equal(whole[-GUARD:], before[-GUARD:]), "wrote after the cache"
    np.testing.assert_array_equal(kc.numpy(), want_k)  # in-range rows written, others not
    np.testing.assert_array_equal(vc.numpy(), want_v)
    flags = reference_errors(*(a.numpy() for a in args), P, PS, 4)
    assert flags[slot] == 1


def test_checked_append_keeps_its_host_messages():
    gen = torch.Generator().manual_seed(1)
    whole, before, kc, vc, k, v, args, _, _ = _append(gen, [0, 2, 4], [-1, 0],
                                                       [[1, 2], [3, 4]], 4)
    with pytest.raises(InvalidArgumentError, match=r"cache_lengths\[0\]: expected >= 0"):
        ops.append_kv(kc, vc, k, v, *args, check_indices=True)
    assert torch.equal(whole, before)


def test_a_failed_launch_does_not_poison_the_next():
    gen = torch.Generator().manual_seed(2)
    whole, before, kc, vc, k, v, args, _, _ = _append(gen, [0, 2, 4], [0, 0],
                                                       [[P, 2], [3, 4]], 4)
    launch = ops.prepare_append_kv(kc, vc, k, v, *args, check_indices=False)
    with pytest.raises(KernelIndexError, match="^the kvtvm kernel skipped"):
        launch.run()
    args[2][0, 0] = 1  # fixed in place: the same launch now runs clean (its flag was reset)
    launch.run()


@pytest.mark.parametrize("dst", [P, 2 ** 30, -1])
def test_unchecked_copy_past_the_pool_writes_nothing_outside(dst):
    gen = torch.Generator().manual_seed(3)
    whole, cache = _guarded(gen)
    before = whole.clone()
    with pytest.raises(KernelIndexError, match="lookup_table"):
        ops.copy_pages(cache, torch.tensor([1, 2], dtype=torch.int32),
                       torch.tensor([3, dst], dtype=torch.int32), check_indices=False)
    assert torch.equal(whole[:GUARD], before[:GUARD])
    assert torch.equal(whole[-GUARD:], before[-GUARD:])
    assert torch.equal(cache[3], before[GUARD + 1])  # the in-range copy ran
    rest = [p for p in range(P) if p != 3]
    assert torch.equal(cache[rest], before[GUARD:GUARD + P][rest])


@pytest.mark.parametrize("op", ["decode", "prefill"])
@pytest.mark.parametrize("bad", ["huge_page", "negative_page", "huge_length", "negative_length"])
def test_unchecked_attention_with_bad_indices_raises_without_touching_outside(op, bad):
    gen = torch.Generator().manual_seed(4)
    whole, cache = _guarded(gen)
    before = whole.clone()
    kc, vc = cache[:, 0], cache[:, 1]
    table = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    lengths = torch.tensor([3, 5], dtype=torch.int32)
    slot = ERR_PAGE
    if bad == "huge_page":
        table[1, 1] = 2 ** 30
    elif bad == "negative_page":
        table[0, 0] = -(2 ** 31)
    elif bad == "huge_length":
        lengths[1], slot = 2 ** 31 - 1, ERR_POSITION
    else:
        lengths[0], slot = -7, ERR_POSITION
    match = "lookup_table" if slot == ERR_PAGE else "cache_lengths"
    if op == "decode":
        q = torch.randn(2, 2 * H, D, generator=gen)
        with pytest.raises(KernelIndexError, match=match):
            ops.decode_attention(q, kc, vc, lengths, table, check_indices=False)
    else:
        q = torch.randn(3, 2 * H, D, generator=gen)
        indptr = torch.tensor([0, 1, 3], dtype=torch.int32)
        with pytest.raises(KernelIndexError, match=match):
            ops.prefill_attention(q, kc, vc, indptr, lengths, table, check_indices=False)
    assert torch.equal(whole, before)  # attention writes no cache byte


def test_reference_errors_agree_with_the_kernels_on_random_tables():
    """Random (often bad) tables: the append kernel sets exactly the reference's flags and
    writes exactly the reference's rows."""
    rng = np.random.default_rng(5)
    gen = torch.Generator().manual_seed(5)
    for _ in range(30):
        batch = int(rng.integers(1, 4))
        counts = rng.integers(0, 4, batch)
        indptr = np.concatenate([[0], np.cumsum(counts)])
        lengths = rng.integers(-2, 9, batch)
        table = rng.integers(-2, P + 2, (batch, 2))
        ntok = int(indptr[-1])
        if ntok == 0:
            continue
        whole, before, kc, vc, k, v, args, want_k, _ = _append(
            gen, indptr.tolist(), lengths.tolist(), table.tolist(), ntok)
        flags = reference_errors(indptr, lengths, table, P, PS, ntok)
        if flags.any():
            with pytest.raises(KernelIndexError):
                ops.append_kv(kc, vc, k, v, *args, check_indices=False)
        else:
            ops.append_kv(kc, vc, k, v, *args, check_indices=False)
        np.testing.assert_array_equal(kc.numpy(), want_k)
        assert torch.equal(whole[:GUARD], before[:GUARD])
        assert torch.equal(whole[-GUARD:], before[-GUARD:])
