"""Non-finite rows through attention (the documented behaviour, docs/kernels.md): a NaN/inf
input row is stored as a NaN row (8-bit: zeros with a NaN scale), and it poisons exactly the
query rows that attend to it -- a NaN key makes their output and lse NaN, a NaN value their
output -- in decode whatever the number of KV splits, and in prefill whatever the tiling;
rows that do not see it (before it under the causal mask, outside the sliding window, other
sequences) stay finite and equal the reference. Full-precision caches behave the same."""

import numpy as np
import pytest
import torch

from kvtvm import ops
from kvtvm.kernels.reference import reference_decode, reference_prefill
from kvtvm.quant import quant_row_bytes
from helpers import numpy_of as _np

H, G, D, PAGE = 2, 2, 40, 5
COUNTS = [9, 30, 1]   # new tokens of 3 sequences (all start empty)
BAD_K = 2             # ragged row whose K holds a NaN (sequence 0, position 2)
BAD_V = 20            # ragged row whose V holds an inf (sequence 1, position 11)


def _setup(storage, rng):
    pages = sum(-(-c // PAGE) for c in COUNTS) + 1
    table = np.full((3, 7), -1, np.int32)
    perm, cur = rng.permutation(pages), 0
    for b, c in enumerate(COUNTS):
        n = -(-c // PAGE)
        table[b, :n] = perm[cur:cur + n]
        cur += n
    if storage:
        kc = torch.zeros(pages, PAGE, H, quant_row_bytes(D), dtype=torch.int8).view(
            getattr(torch, storage))
    else:
        kc = torch.zeros(pages, PAGE, H, D)
    vc = kc.clone()
    k = torch.from_numpy(rng.standard_normal((sum(COUNTS), H, D)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((sum(COUNTS), H, D)).astype(np.float32))
    k[BAD_K, 0, 1] = float("nan")
    v[BAD_V, H - 1, 0] = float("inf")
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(COUNTS)]), dtype=torch.int32)
    ops.append_kv(kc, vc, k, v, indptr, torch.zeros(3, dtype=torch.int32),
                  torch.from_numpy(table))
    return kc, vc, indptr, torch.from_numpy(table)


def _same(got, want, tol=2e-5):
    got = got.float().numpy()
    np.testing.assert_array_equal(~np.isfinite(got), ~np.isfinite(want))
    ok = np.isfinite(want)
    np.testing.assert_allclose(got[ok], want[ok], atol=tol, rtol=0)


@pytest.mark.parametrize("storage", ["int8", "float8_e4m3fn", ""])
def test_nonfinite_rows_poison_exactly_the_rows_that_see_them(storage):
    rng = np.random.default_rng(4)
    kc, vc, indptr, table = _setup(storage, rng)
    q = torch.from_numpy(rng.standard_normal((sum(COUNTS), H * G, D)).astype(np.float32))
    for causal, window in ((True, None), (False, None), (True, 4)):
        want, want_lse = reference_prefill(q.numpy(), _np(kc), _np(vc), indptr.numpy(),
                                           np.zeros(3, np.int32), table.numpy(),
                                           causal=causal, sliding_window=window)
        out, lse = ops.prefill_attention(q, kc, vc, indptr, torch.zeros(3, dtype=torch.int32),
                                         table, causal=causal, sliding_window=window)
        _same(out, want)
        _same(lse, want_lse, 1e-4)
        if causal and window is None:   # rows before the bad ones see nothing of them
            assert np.isfinite(out[:BAD_K].numpy()).all()
            assert np.isfinite(out[COUNTS[0]:BAD_V].numpy()).all()
            assert np.isnan(out[BAD_K:COUNTS[0], :G].numpy()).all()  # KV head 0's
            assert np.isnan(lse[BAD_K:COUNTS[0], :G].numpy()).all()
    lengths = torch.tensor([c - 1 for c in COUNTS], dtype=torch.int32)
    qd = q[np.cumsum(COUNTS) - 1].contiguous()
    for window in (None, 3):
        want, want_lse = reference_decode(qd.numpy(), _np(kc), _np(vc), lengths.numpy(),
                                          table.numpy(), sliding_window=window)
        assert (window is not None) or np.isnan(want[0, :G]).all()
        for splits in (1, 2, 4):
            out, lse = ops.decode_attention(qd, kc, vc, lengths, table, num_splits=splits,
                                            sliding_window=window)
            _same(out, want)
            _same(lse, want_lse, 1e-4)
