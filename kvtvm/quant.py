"""The quantized KV row format and its numpy reference quantizer / dequantizer.

A quantized cache stores each (token, head) row of K (or V) as ``head_dim`` 8-bit values, then
its float32 scale (little-endian), then zero padding up to a multiple of :data:`ROW_ALIGN`
bytes, so every row starts 16-byte aligned (vector loads) and a page stays one contiguous unit
(page copies, fork's copy-on-write, eviction and export remain byte copies)::

    row = [ q_0 .. q_{D-1} | scale (float32, 4 bytes) | 0 padding ]   quant_row_bytes(D) bytes

The per-layer views the managers hand out are ``[..., quant_row_bytes(D)]`` tensors of dtype
``int8`` (storage ``"int8"``) or ``float8_e4m3fn`` (storage ``"float8_e4m3fn"``): the view's
dtype *is* the storage type, and its last extent tells the ops the row stride.

Quantization, per row ``x`` (float32; float16/bfloat16 inputs convert exactly):

- ``amax = max |x|``; ``scale = float32(amax / QMAX)``; ``inv = float32(QMAX / amax)`` (0 when
  ``amax`` is 0, so an all-zero row stays exactly zero);
- int8 (``QMAX = 127``): ``q = rint(clip(x * inv, -127, 127))``, round half to even;
- float8_e4m3fn (``QMAX = 448``): ``q = e4m3(clip(x * inv, -448, 448))``, round to nearest
  even, saturating;
- a row whose scale would be a float32 subnormal (``scale < MIN_SCALE = 2**-126``, i.e.
  ``amax`` below about ``QMAX * 2**-126``) is stored with scale 0 and values ``x * 0`` (zeros;
  e4m3 keeps their sign): what CUDA's flush-to-zero arithmetic gives, so the CPU and CUDA
  kernels write the same bytes (such a row's values are below 2**-117, nothing attention can
  tell from 0);
- **non-finite input**: a row holding a NaN or an infinity is stored as all-zero values with a
  NaN scale, so it dequantizes to NaN everywhere and poisons attention exactly as it would in a
  full-precision cache -- never a silently finite row.

Dequantization: ``float32(q) * scale``. Because no scale covers two tokens, re-appending the same
rows after a pop gives byte-identical pages. Numpy only (no torch, no TVM).
"""

from __future__ import annotations

import numpy as np

__all__ = ["QUANT_DTYPES", "QMAX", "SCALE_BYTES", "ROW_ALIGN", "MIN_SCALE",
           "quant_row_bytes", "round_up", "numpy_storage_dtype", "quantize_rows",
           "dequantize_rows", "row_scales"]

#: Quantized storage types -> the largest magnitude a value may take.
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
QUANT_DTYPES = tuple(QMAX)
#: Bytes of the per-row scale (float32).
SCALE_BYTES = 4
#: Every row of a quantized (or mixed-format) cache starts at a multiple of this many bytes.
ROW_ALIGN = 16
#: The smallest scale stored (float32's smallest normal): a row whose ``amax / QMAX`` rounds
#: below it is stored with scale 0 and zero values. CUDA (nvcc's fast math flushes
#: subnormals) could not write its scale, and ``inv = QMAX / amax`` overflows to inf below
#: ``QMAX / FLT_MAX`` (about 2**-121 for int8), which saturated every value to ``+-QMAX``.
MIN_SCALE = 2.0 ** -126


def round_up(n: int, m: int) -> int:
    """``n`` rounded up to a multiple of ``m``."""
    return -(-n // m) * m


def quant_row_bytes(head_dim: int) -> int:
    """Bytes of one quantized (token, head) row: values, float32 scale, padding to 16."""
    return round_up(head_dim + SCALE_BYTES, ROW_ALIGN)


def numpy_storage_dtype(storage: str) -> np.dtype:
    """Numpy dtype of a quantized storage type's values (``ml_dtypes`` for float8)."""
    if storage == "int8":
        return np.dtype(np.int8)
    import ml_dtypes

    return np.dtype(ml_dtypes.float8_e4m3fn)


def quantize_rows(x, storage: str) -> np.ndarray:
    """Encode rows ``x [..., D]`` into quantized rows ``[..., quant_row_bytes(D)]``.

    Parameters
    ----------
    x : array_like
        ``[..., D]`` float32 / float16 / bfloat16 rows (one per token and head).
    storage : {"int8", "float8_e4m3fn"}

    Returns
    -------
    numpy.ndarray
        ``[..., quant_row_bytes(D)]`` of :func:`numpy_storage_dtype` ``(storage)``: values,
        then the float32 scale's bytes, then zeros.
    """
    qmax = np.float32(QMAX[storage])
    x = np.asarray(x).astype(np.float32)
    D = x.shape[-1]
    finite = np.isfinite(x).all(axis=-1, keepdims=True)
    amax = np.where(finite, np.abs(np.where(np.isfinite(x), x, 0)), 0).max(axis=-1,
                                                                          keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scale = (amax / qmax).astype(np.float32)
        kept = scale >= np.float32(MIN_SCALE)        # else scale 0, values x * 0
        scale = np.where(kept, scale, 0).astype(np.float32)
        inv = np.where(kept, qmax / np.where(kept, amax, 1), 0).astype(np.float32)
        y = (np.where(finite, x, 0) * inv).astype(np.float32)
    y = np.clip(np.where(np.isnan(y), 0, y), -qmax, qmax)
    scale = np.where(finite, scale, np.float32(np.nan)).astype(np.float32)
    if storage == "int8":
        values = np.rint(y).astype(np.int8).view(np.uint8)
    else:
        values = y.astype(numpy_storage_dtype(storage)).view(np.uint8)
    out = np.zeros(x.shape[:-1] + (quant_row_bytes(D),), np.uint8)
    out[..., :D] = values
    out[..., D:D + SCALE_BYTES] = scale.astype("<f4").view(np.uint8)
    return out.view(numpy_storage_dtype(storage))


def row_scales(rows, head_dim: int) -> np.ndarray:
    """The float32 scales ``[...]`` of quantized rows ``[..., R]`` (any 1-byte dtype)."""
    raw = np.ascontiguousarray(np.asarray(rows).view(np.uint8)[..., head_dim:head_dim + 4])
    return raw.view("<f4")[..., 0]


def dequantize_rows(rows, head_dim: int, storage: str | None = None) -> np.ndarray:
    """Decode quantized rows ``[..., R]`` into float32 ``[..., head_dim]``.

    ``storage`` defaults to the rows' dtype (int8 or float8_e4m3fn).
    """
    rows = np.asarray(rows)
    if storage is None:
        storage = "int8" if rows.dtype == np.int8 else "float8_e4m3fn"
    raw = rows.view(np.uint8)[..., :head_dim]
    values = np.ascontiguousarray(raw).view(numpy_storage_dtype(storage)).astype(np.float32)
    return (values * row_scales(rows, head_dim)[..., None]).astype(np.float32)
