"""The numpy reference quantizer / dequantizer (kvtvm.quant) and the reference ops over
quantized cache views (kvtvm.kernels.reference)."""

import ml_dtypes
import numpy as np
import pytest

from kvtvm.kernels.reference import reference_append, reference_decode, reference_prefill
from kvtvm.quant import (dequantize_rows, numpy_storage_dtype, quant_row_bytes, quantize_rows,
                         row_scales)

STORAGES = ("int8", "float8_e4m3fn")


def test_row_bytes_are_16_byte_multiples_with_room_for_the_scale():
    for d in (1, 8, 12, 40, 64, 80, 96, 128, 256):
        r = quant_row_bytes(d)
        assert r % 16 == 0 and d + 4 <= r < d + 4 + 16
    assert quant_row_bytes(64) == 80 and quant_row_bytes(128) == 144


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("src", ["float32", "float16", "bfloat16"])
def test_layout_scale_and_error_bound(storage, src):
    rng = np.random.default_rng(0)
    D = 64
    x = (rng.standard_normal((7, 3, D)) * rng.uniform(0.01, 30, (7, 3, 1))).astype(
        np.dtype(ml_dtypes.bfloat16) if src == "bfloat16" else src)
    rows = quantize_rows(x, storage)
    assert rows.dtype == numpy_storage_dtype(storage) and rows.shape == (7, 3, 80)
    raw = rows.view(np.uint8)
    assert not raw[..., D + 4:].any()                      # padding is zero
    xf = x.astype(np.float32)
    amax = np.abs(xf).max(-1)
    qmax = 127 if storage == "int8" else 448
    np.testing.assert_array_equal(row_scales(rows, D), (amax / np.float32(qmax)))
    deq = dequantize_rows(rows, D)
    scale = row_scales(rows, D)[..., None]
    if storage == "int8":
        # round to nearest: at most half a step (plus float32 rounding of scale * q)
        assert (np.abs(deq - xf) <= 0.5 * scale * (1 + 1e-5) + 1e-30).all()
        assert (np.abs(rows[..., :D].view(np.int8)) <= 127).all()
    else:
        # e4m3: 3 mantissa bits, nearest even -> relative error <= 2**-4 on normal values
        tiny = 2.0 ** -6 * scale
        err = np.abs(deq - xf)
        assert (err <= np.maximum(np.abs(xf) * 2.0 ** -4, tiny) * (1 + 1e-5)).all()
    # the row's absmax element maps to the extreme code and back to amax (up to float32 ulp)
    idx = np.abs(xf).argmax(-1)
    top = np.take_along_axis(deq, idx[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.abs(top), amax, rtol=2e-7)


def test_int8_rounds_half_to_even():
    x = np.zeros((1, 8), np.float32)
    x[0, :6] = [127, 2.5, 3.5, -2.5, 0.5, 1.5]            # amax 127: inv = 1 exactly
    q = quantize_rows(x, "int8")[0, :8].view(np.int8)
    assert q.tolist() == [127, 2, 4, -2, 0, 2, 0, 0]


def test_fp8_saturates_and_rounds_to_even():
    x = np.zeros((1, 8), np.float32)
    x[0, :3] = [448, 17.0, 19.0]          # inv = 1; 17 and 19 lie halfway between e4m3 codes
    deq = dequantize_rows(quantize_rows(x, "float8_e4m3fn"), 8)
    assert deq[0, :3].tolist() == [448, 16.0, 20.0]


@pytest.mark.parametrize("storage", STORAGES)
def test_zero_rows_exact_and_outlier_rows(storage):
    D = 128
    x = np.zeros((2, D), np.float32)
    rng = np.random.default_rng(1)
    x[1] = rng.standard_normal(D)
    x[1, 17] = 100 * np.abs(x[1]).max()                  # one channel 100x the rest
    rows = quantize_rows(x, storage)
    assert not rows[0].view(np.uint8).any()              # zero values, zero scale
    deq = dequantize_rows(rows, D)
    assert not deq[0].any()
    assert deq[1, 17] == pytest.approx(x[1, 17], rel=1e-6)
    bound = x[1, 17] / (254 if storage == "int8" else 16) * 1.0001
    assert np.abs(deq[1] - x[1]).max() <= bound


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rows_poison_to_nan(storage, bad):
    x = np.random.default_rng(2).standard_normal((3, 16)).astype(np.float32)
    x[1, 5] = bad
    rows = quantize_rows(x, storage)
    assert np.isnan(row_scales(rows, 16)[1]) and not rows[1, :16].view(np.uint8).any()
    deq = dequantize_rows(rows, 16)
    assert np.isnan(deq[1]).all() and np.isfinite(deq[[0, 2]]).all()
    np.testing.assert_array_equal(rows[[0, 2]].view(np.uint8),
                                  quantize_rows(x[[0, 2]], storage).view(np.uint8))


def test_subnormal_amax_stays_finite():
    x = np.zeros((1, 16), np.float32)
    x[0, 3] = 1e-40                                       # 127 / amax overflows to inf
    for storage in STORAGES:
        deq = dequantize_rows(quantize_rows(x, storage), 16)
        assert np.isfinite(deq).all() and deq[0, 0] == 0


def _paged_case(rng, storage, *, H=2, G=2, D=64, page_size=16, lens=(37, 5, 16), new=(1, 1, 1)):
    """Random page tables; the cache holds quantized rows of random float K/V."""
    W = max(-(-(c + n) // page_size) for c, n in zip(lens, new))
    num_pages = len(lens) * W + 3
    perm = rng.permutation(num_pages)[:len(lens) * W].reshape(len(lens), W).astype(np.int32)
    R = quant_row_bytes(D)
    kf = rng.standard_normal((num_pages, page_size, H, D)).astype(np.float32)
    vf = rng.standard_normal((num_pages, page_size, H, D)).astype(np.float32)
    kq, vq = quantize_rows(kf, storage), quantize_rows(vf, storage)
    assert kq.shape[-1] == R
    n = int(sum(new))
    qo = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    q = rng.standard_normal((n, H * G, D)).astype(np.float32)
    return dict(kf=kf, vf=vf, kq=kq, vq=vq, table=perm, lens=np.array(lens, np.int32), qo=qo,
                q=q)


@pytest.mark.parametrize("storage", STORAGES)
def test_reference_append_writes_quantized_rows(storage):
    rng = np.random.default_rng(3)
    c = _paged_case(rng, storage, lens=(15, 0, 3), new=(3, 17, 1))
    n = int(c["qo"][-1])
    k = rng.standard_normal((n, 2, 64)).astype(np.float16)
    v = rng.standard_normal((n, 2, 64)).astype(np.float16)
    ko, vo = reference_append(c["kq"], c["vq"], k, v, c["qo"], c["lens"], c["table"])
    touched = np.zeros(ko.shape[:2], bool)
    for b in range(3):
        for i, row in enumerate(range(c["qo"][b], c["qo"][b + 1])):
            pos = c["lens"][b] + i
            page, slot = c["table"][b, pos // 16], pos % 16
            touched[page, slot] = True
            assert ko[page, slot].view(np.uint8).tobytes() == \
                quantize_rows(k[row], storage).view(np.uint8).tobytes()
            assert vo[page, slot].view(np.uint8).tobytes() == \
                quantize_rows(v[row], storage).view(np.uint8).tobytes()
    np.testing.assert_array_equal(ko.view(np.uint8)[~touched], c["kq"].view(np.uint8)[~touched])


@pytest.mark.parametrize("storage", STORAGES)
def test_reference_attention_over_quantized_pages(storage):
    rng = np.random.default_rng(4)
    c = _paged_case(rng, storage)
    out, lse = reference_decode(c["q"], c["kq"], c["vq"], c["lens"], c["table"])
    deq = reference_decode(c["q"], dequantize_rows(c["kq"], 64), dequantize_rows(c["vq"], 64),
                           c["lens"], c["table"])
    np.testing.assert_array_equal(out, deq[0])
    full, _ = reference_decode(c["q"], c["kf"], c["vf"], c["lens"], c["table"])
    # the stated bound of the quantized cache against full precision (unit-normal K, V, Q)
    bound = 0.02 if storage == "int8" else 0.15
    assert np.abs(out - full).max() < bound
    pre, _ = reference_prefill(c["q"], c["kq"], c["vq"], c["qo"], c["lens"], c["table"])
    np.testing.assert_allclose(pre, out, rtol=1e-10, atol=1e-12)
