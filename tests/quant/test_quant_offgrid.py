"""Off-grid checks of the 8-bit cache on the CPU: shapes, storage mixes and inputs away from the
project's usual grid (odd head_dim, GQA, page sizes, ragged batches with empty sequences,
sliding windows, non-finite rows), each against the numpy references on fresh random inputs;
plus the regressions an off-grid sweep found."""

import numpy as np
import pytest
import torch

from kvtvm import ops
from kvtvm.kernels.reference import reference_append, reference_decode, reference_prefill
from kvtvm.quant import quant_row_bytes, quantize_rows
from helpers import append_writes_reference_bytes, numpy_of as _np, ragged_batch

#: max |kernel - reference over the dequantized cache| of the outputs, per q dtype
TOL = {"float32": 3e-5, "float16": 5e-3, "bfloat16": 4e-2}


def _tdt(name):
    return getattr(torch, name)


def _cache(rng, storage, dtype, shape, D, bad_rows=0):
    """A random cache view ``shape + (row,)``: quantized rows (random bytes in the padding) or
    ``dtype`` rows; ``bad_rows`` rows hold a NaN or an infinity (stored as the format does)."""
    x = (rng.standard_normal(shape + (D,)) * rng.uniform(0.05, 4, shape[:1] + (1,) * len(shape))
         ).astype(np.float32)
    flat = x.reshape(-1, D)
    for _ in range(bad_rows):
        flat[rng.integers(len(flat)), rng.integers(D)] = rng.choice([np.nan, np.inf, -np.inf])
    if not storage:
        return torch.from_numpy(x).to(_tdt(dtype))
    raw = quantize_rows(x, storage).view(np.uint8)
    raw[..., D + 4:] = rng.integers(0, 256, raw[..., D + 4:].shape)
    return torch.from_numpy(raw.view(np.int8)).view(_tdt(storage))


def _batch(rng, counts, starts, page_size, spare=2):
    return ragged_batch(rng, counts, starts, page_size, spare)


def _shape(layout, pages, page_size, H):
    return (pages, page_size, H) if layout == "nhd" else (pages, H, page_size)


def _close(got, want, tol):
    """Equal non-finite masks (NaN and inf alike), finite values within ``tol``."""
    got = got.float().numpy()
    np.testing.assert_array_equal(~np.isfinite(got), ~np.isfinite(want))
    ok = np.isfinite(want)
    np.testing.assert_allclose(got[ok], want[ok], atol=tol, rtol=0)


def _lse_tol(want):
    finite = want[np.isfinite(want)]
    return 2e-4 * max(1.0, float(np.abs(finite).max()) if finite.size else 1.0)


def _check_case(seed, ks, vs, dtype, layout, page_size, H, G, D, window, bad_rows=0):
    """Append, decode (1, 2, 5 splits) and prefill (causal or not) of one random ragged batch
    (empty sequences included) against the references."""
    rng = np.random.default_rng(seed)
    B = 4
    starts = [int(rng.integers(0, 3 * page_size + 40)) for _ in range(B)]
    counts = [int(rng.integers(0, 9)) for _ in range(B)]
    counts[0], counts[1] = max(counts[0], 1), 0      # one empty sequence at least
    n = sum(counts)
    # append: exact bytes
    pages, indptr, lengths, table = _batch(rng, counts, starts, page_size)
    kc = _cache(rng, ks, dtype, _shape(layout, pages, page_size, H), D)
    vc = _cache(rng, vs, dtype, _shape(layout, pages, page_size, H), D)
    k = torch.from_numpy((rng.standard_normal((n, H, D)) * rng.uniform(1e-3, 30, (n, H, 1))
                          ).astype(np.float32)).to(_tdt(dtype))
    v = torch.from_numpy((rng.standard_normal((n, H, D)) * rng.uniform(1e-3, 30, (n, H, 1))
                          ).astype(np.float32)).to(_tdt(dtype))
    append_writes_reference_bytes(kc, vc, k, v, indptr, lengths, table, layout)
    # decode over the cache after the batch (every sequence non-empty)
    pages, _, lengths, table = _batch(rng, [1] * B, [s + c for s, c in zip(starts, counts)],
                                      page_size)
    kc = _cache(rng, ks, dtype, _shape(layout, pages, page_size, H), D, bad_rows)
    vc = _cache(rng, vs, dtype, _shape(layout, pages, page_size, H), D, bad_rows)
    q = torch.from_numpy(rng.standard_normal((B, H * G, D)).astype(np.float32)).to(_tdt(dtype))
    with np.errstate(all="ignore"):
        want, want_lse = reference_decode(_np(q), _np(kc), _np(vc), lengths.numpy(),
                                          table.numpy(), layout=layout, sliding_window=window)
    for splits in (1, 2, 5):
        out, lse = ops.decode_attention(q, kc, vc, lengths, table, layout=layout,
                                        num_splits=splits, sliding_window=window)
        _close(out, want, TOL[dtype])
        _close(lse, want_lse, _lse_tol(want_lse))
    # prefill of the ragged batch over its cached prefix
    pages, indptr, lengths, table = _batch(rng, counts, starts, page_size)
    kc = _cache(rng, ks, dtype, _shape(layout, pages, page_size, H), D, bad_rows)
    vc = _cache(rng, vs, dtype, _shape(layout, pages, page_size, H), D, bad_rows)
    q = torch.from_numpy(rng.standard_normal((n, H * G, D)).astype(np.float32)).to(_tdt(dtype))
    for causal in (True, False):
        with np.errstate(all="ignore"):
            want, want_lse = reference_prefill(_np(q), _np(kc), _np(vc), indptr.numpy(),
                                               lengths.numpy(), table.numpy(), layout=layout,
                                               causal=causal, sliding_window=window)
        out, lse = ops.prefill_attention(q, kc, vc, indptr, lengths, table, layout=layout,
                                         causal=causal, sliding_window=window)
        _close(out, want, TOL[dtype])
        _close(lse, want_lse, _lse_tol(want_lse))


def _offgrid_sample(seed, n):
    """``n`` random off-grid cases: (seed, k storage, v storage, dtype, layout, page_size,
    H, G, head_dim, sliding_window); a storage ``""`` is full precision."""
    rng = np.random.default_rng(seed)
    storages = ["int8", "float8_e4m3fn", ""]
    out = []
    for i in range(n):
        ks, vs = (storages[j] for j in rng.integers(0, 3, 2))
        out.append((seed * 100 + i, ks or ("int8" if not vs else ""), vs,
                    str(rng.choice(["float32", "float16", "bfloat16"])),
                    str(rng.choice(["nhd", "hnd"])), int(rng.choice([1, 2, 3, 5, 7, 17, 64])),
                    int(rng.choice([1, 3, 5])), int(rng.choice([1, 3, 5, 6, 7, 12])),
                    int(rng.choice([5, 16, 24, 40, 80, 112])),
                    [None, 1, 4, 19][int(rng.integers(4))]))
    return out


@pytest.mark.parametrize("case", _offgrid_sample(2026, 2))
def test_a_seeded_off_grid_sample_equals_the_references(case):
    _check_case(*case)


@pytest.mark.parametrize("case", _offgrid_sample(1127, 2))
def test_non_finite_rows_off_grid_poison_as_the_references(case):
    _check_case(*case, bad_rows=3)


@pytest.mark.parametrize("vs,dtype", [("", "float32"), ("int8", "float16")])
def test_prefill_an_infinite_key_score_gives_nan_not_a_finite_row(vs, dtype):
    """A full-precision K side (a V-only cache, or no 8-bit side at all) holding +inf gives a
    score of +inf; attention over it is NaN (out and lse), as in the reference and in decode.
    The CPU prefill's exp2 clamped the NaN of ``inf - inf`` to 2**-125, so those rows came out
    finite, with lse = +inf."""
    rng = np.random.default_rng(4)
    H, G, D, page_size = 2, 2, 16, 4
    counts, starts = [6, 3], [10, 0]
    pages, indptr, lengths, table = _batch(rng, counts, starts, page_size)
    kc = _cache(rng, "", dtype, (pages, page_size, H), D)
    vc = _cache(rng, vs, dtype, (pages, page_size, H), D)
    kc[int(table[0, 12 // page_size]), 12 % page_size, 0, 0] = float("inf")   # seq 0, pos 12
    q = torch.from_numpy(np.abs(rng.standard_normal((9, H * G, D))).astype(np.float32)).to(
        _tdt(dtype))
    with np.errstate(all="ignore"):
        want, want_lse = reference_prefill(_np(q), _np(kc), _np(vc), indptr.numpy(),
                                           lengths.numpy(), table.numpy())
    assert np.isnan(want[2:6, :G]).all() and np.isfinite(want[:2]).all()   # rows that see it
    out, lse = ops.prefill_attention(q, kc, vc, indptr, lengths, table)
    _close(out, want, TOL[dtype])
    np.testing.assert_array_equal(np.isnan(lse.numpy()), np.isnan(want_lse))


@pytest.mark.parametrize("vs", ["", "int8"])
def test_attention_whose_every_score_is_minus_inf_is_nan_at_any_split_count(vs):
    """A full-precision K row holding -inf gives a score of -inf. Beside finite scores it
    weighs 0 (finite result); when it is all a query sees (one token, a window of 1), the
    reference's softmax is 0/0: NaN out and lse. The CPU decode gave 0 (its tile padding
    weighed 1 once no score beat the running max's floor; a split of only -inf scores was
    merged as an empty one) and the CPU prefill a NaN out with an lse of -inf."""
    rng = np.random.default_rng(6)
    H, G, D, page_size = 1, 3, 8, 4
    kc = _cache(rng, "", "float32", (3, page_size, H), D)
    vc = _cache(rng, vs, "float32", (3, page_size, H), D)
    kc[0, 0, 0, 0] = -float("inf")                       # position 0 of the sequence
    q = torch.from_numpy(np.abs(rng.standard_normal((1, H * G, D))).astype(np.float32))
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    for length, window in ((0, None), (6, None), (6, 1)):   # (6, 1): position 6 alone, finite
        lengths = torch.tensor([length], dtype=torch.int32)
        with np.errstate(all="ignore"):
            want, want_lse = reference_decode(q.numpy(), _np(kc), _np(vc), lengths.numpy(),
                                              table.numpy(), sliding_window=window)
        assert np.isnan(want).all() == (length == 0)
        for splits in (1, 2, 3):
            out, lse = ops.decode_attention(q, kc, vc, lengths, table, num_splits=splits,
                                            sliding_window=window)
            _close(out, want, TOL["float32"])
            _close(lse, want_lse, 1e-4)
            np.testing.assert_array_equal(np.isnan(lse.numpy()), np.isnan(want_lse))
    indptr = torch.tensor([0, 1], dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int32)
    with np.errstate(all="ignore"):
        want, want_lse = reference_prefill(q.numpy(), _np(kc), _np(vc), indptr.numpy(),
                                           zero.numpy(), table.numpy())
    out, lse = ops.prefill_attention(q, kc, vc, indptr, zero, table)
    assert np.isnan(want_lse).all() and np.isnan(out.numpy()).all()
    np.testing.assert_array_equal(np.isnan(lse.numpy()), np.isnan(want_lse))


@pytest.mark.parametrize("storage", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_rows_are_quantized_or_zero_never_saturated(storage, dtype):
    """Rows whose largest magnitude is below QMAX / FLT_MAX (2**-121 for int8, 2**-119 for
    e4m3; float32 and bfloat16 reach it) had an inverse scale of inf: every non-zero value was
    stored as +-QMAX (dequantized to +-amax, an error of up to amax). A row whose scale would be
    subnormal (below MIN_SCALE, 2**-126) is now an all-zero row with scale 0 -- what CUDA's
    flush-to-zero writes -- and every other row meets the usual error bound; the CPU append
    writes the reference's bytes."""
    from kvtvm.quant import MIN_SCALE, QMAX, dequantize_rows, row_scales

    rng = np.random.default_rng(8)
    H, D, page_size = 2, 24, 4
    amax = 2.0 ** rng.uniform(-126, -110, (6, H, 1))
    x = (rng.uniform(-1, 1, (6, H, D)) * amax).astype(np.float32)
    x = torch.from_numpy(x).to(_tdt(dtype))
    xf = x.float().numpy()
    rows = quantize_rows(xf, storage)
    deq, scale = dequantize_rows(rows, D), row_scales(rows, D)[..., None]
    row_amax = np.abs(xf).max(-1, keepdims=True)
    zero = (row_amax / np.float32(QMAX[storage])).astype(np.float32) < MIN_SCALE
    assert zero.any() and (~zero).any()          # both kinds of rows in the sample
    assert (scale[zero] == 0).all() and (deq[zero[..., 0]] == 0).all()   # (e4m3: +-0 codes)
    assert (scale[~zero] >= MIN_SCALE).all()
    if storage == "int8":
        bound = 0.5 * scale * (1 + 1e-5)
    else:
        bound = np.maximum(np.abs(xf) * 2.0 ** -4, 2.0 ** -6 * scale) * (1 + 1e-5)
    bound = np.where(zero, row_amax, bound)      # zero rows: off by the value itself
    assert (np.abs(deq - xf) <= bound).all()
    cache = torch.zeros(3, page_size, H, quant_row_bytes(D), dtype=torch.int8).view(
        _tdt(storage))
    other = cache.clone()
    indptr = torch.tensor([0, 6], dtype=torch.int32)
    lengths = torch.tensor([1], dtype=torch.int32)
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    want, _ = reference_append(_np(cache), _np(other), xf, xf, indptr.numpy(),
                               lengths.numpy(), table.numpy())
    ops.append_kv(cache, other, x, x, indptr, lengths, table)
    np.testing.assert_array_equal(cache.view(torch.uint8).numpy(), want.view(np.uint8))
