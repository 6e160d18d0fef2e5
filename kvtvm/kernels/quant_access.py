"""How kernels read and write quantized cache rows (:mod:`kvtvm.quant`): binding a K/V pair
whose sides may be stored differently, decoding an 8-bit value, reading a row's inline scale,
and encoding a float32 value into int8 / float8_e4m3fn bits.

A quantized side of a cache is bound as an ``int8`` buffer whose last extent is the row
(``quant_row_bytes(head_dim)`` bytes: values, float32 scale, padding); the ops hand the kernel
an ``int8`` view of the same bytes whatever the storage type, so float8 needs no DLPack
support and the storage type is compiled in (``KernelSpec.k_storage`` / ``v_storage``). A
full-precision side (``""``: a skipped layer, the V of a K-only cache) is bound as today.

Every helper returns a TIR expression (call them inside a TVMScript function). The e4m3 codecs
are integer arithmetic on the bits -- exact, vectorizable, independent of the FPU's
denormal mode and of any native float8 support:

- decode: the bits moved into a float16 (sign to bit 15, the rest to bits 7-13) are the value
  over 2**8; float16 -> float32 converts it (subnormals included) and the row scale carries the
  2**8 back (:func:`e4m3_to_half_scaled`). (The NaN code 0x7F never occurs in a cache kvtvm
  wrote.)
- encode (``|y| <= 448``): below ``2**-6`` the subnormal code is ``rne(|y| * 2**9)`` (8
  rolls into the smallest normal code, as it should); above, round the float32 mantissa to 3
  bits to nearest even on the bits and rebias.
"""

from __future__ import annotations

from ..cuda_limits import decode_vectors
from ..quant import QMAX, SCALE_BYTES
from ._tvm import T
from .accessor import cache_index, cache_row_elems, match_cache_pair

__all__ = ["match_quant_cache_pair", "cache_row_elems", "load_value", "row_scale", "dequant",
           "encode", "scale_byte", "QMAX"]


def match_quant_cache_pair(var_k_cache, var_v_cache, layout: str, n_kv_heads: int,
                           head_dim: int, dtype: str, k_storage: str, v_storage: str):
    """:func:`kvtvm.kernels.accessor.match_cache_pair` with the storage types required (the
    name the quantizing append binds its caches with)."""
    return match_cache_pair(var_k_cache, var_v_cache, layout, n_kv_heads, head_dim, dtype,
                            k_storage, v_storage)


def _u8(byte):
    """An int8 element as its unsigned byte value (int32)."""
    return T.bitwise_and(T.Cast("int32", byte), 0xFF)


def e4m3_to_half_scaled(byte):
    """float32 of float8_e4m3fn bits held in an int8, divided by 2**8 (exactly): the bits
    moved into a float16 (sign to bit 15, exponent and mantissa to bits 7-13) are the e4m3
    value with exponent bias 15 instead of 7, and float16 -> float32 is one vector instruction
    (``vcvtph2ps``) that handles the subnormals exactly. :func:`row_scale` returns the scale
    times 2**8 for float8 rows, so ``load_value * row_scale`` is the exact dequantized value."""
    s = T.Cast("int16", byte)  # sign-extended: bits 7-15 are the sign
    # one shift puts the sign at bit 15 (a copy of it lands on bit 14, masked off) and the
    # exponent and mantissa at bits 7-13: 0xBF80 as an int16 (1.5% less CPU decode time than
    # moving the sign apart)
    bits = T.bitwise_and(T.shift_left(s, T.int16(7)), T.int16(-0x4080))
    return T.Cast("float32", T.reinterpret("float16", bits))


#: float8 values are loaded divided by this (:func:`e4m3_to_half_scaled`); their scale times it.
FP8_LOAD_SCALE = 256.0


def load_value(cache, index, storage: str):
    """float32 value of element ``index`` of a cache buffer stored as ``storage``, unscaled:
    multiply by :func:`row_scale` to dequantize (float8 values come divided by
    :data:`FP8_LOAD_SCALE`, which :func:`row_scale` multiplies back)."""
    if storage == "float8_e4m3fn":
        return e4m3_to_half_scaled(cache[index])
    return T.Cast("float32", cache[index])


def row_scale(cache, row_index, head_dim: int, storage: str):
    """The float32 scale of the row whose first element is ``row_index`` (a 4-tuple with dim
    0), times :data:`FP8_LOAD_SCALE` for float8 rows (exact: a power of two, and a scale is at
    most ``FLT_MAX / 448``); 1 for a full-precision buffer. Four byte loads, reassembled
    (little-endian)."""
    if not storage:
        return T.float32(1)
    *lead, _ = row_index
    bits = _u8(cache[(*lead, head_dim)])
    for i in range(1, SCALE_BYTES):
        bits = T.bitwise_or(bits, T.shift_left(_u8(cache[(*lead, head_dim + i)]), 8 * i))
    scale = T.reinterpret("float32", bits)
    return scale * T.float32(FP8_LOAD_SCALE) if storage == "float8_e4m3fn" else scale


def _rne(x):
    """Round a float32 to the nearest integer, ties to even (``nearbyint``: a vector
    instruction on x86; ``nearbyintf`` in CUDA -- ``T.round`` would round ties away on CUDA)."""
    return T.nearbyint(x)


def encode(y, storage: str):
    """int8 bits of ``y`` (float32, already clipped to ``[-QMAX, QMAX]``, no NaN)."""
    if storage == "int8":
        return T.Cast("int8", T.Cast("int32", _rne(y)))
    bits = T.reinterpret("int32", y)
    sign = T.bitwise_and(T.shift_right(bits, 24), 0x80)
    a = T.bitwise_and(bits, 0x7FFFFFFF)
    sub = T.Cast("int32", _rne(T.reinterpret("float32", a) * T.float32(512.0)))
    normal = T.shift_right(a + 0x7FFFF + T.bitwise_and(T.shift_right(a, 20), 1), 20) - (120 << 3)
    code = T.Select(a < (121 << 23), sub, normal)  # 121 << 23: the float32 bits of 2**-6
    return T.Cast("int8", T.bitwise_or(code, sign))


def scale_byte(scale, i: int):
    """Byte ``i`` (little-endian) of a float32 ``scale``, as int8."""
    return T.Cast("int8", T.shift_right(T.reinterpret("int32", scale), 8 * i))


def dequant(cache, layout: str, page, slot, head, dim, head_dim: int, storage: str):
    """The dequantized float32 value at (page, slot, head, dim): :func:`load_value` times
    :func:`row_scale` (just the converted value for a full-precision buffer)."""
    value = load_value(cache, cache_index(layout, page, slot, head, dim), storage)
    if not storage:
        return value
    return value * row_scale(cache, cache_index(layout, page, slot, head, 0), head_dim, storage)


def quant_vec_choices(spec) -> list[int]:
    """CUDA decode knob ``vec`` for 8-bit caches: head_dim values per thread, whole int32
    words of the staged rows (4 to 32 in steps of 4), leaving a power of two of lanes (at most 32)
    per row (:func:`kvtvm.cuda_limits.decode_vectors`)."""
    return decode_vectors(spec.dtype, spec.head_dim, quantized=True)


def head_split_choices(spec) -> list[int]:
    """CUDA decode knob ``head_split`` for 8-bit caches: the parts a GQA group's query heads
    may be split into (the divisors of the group size)."""
    return [h for h in range(1, spec.group_size + 1) if spec.group_size % h == 0]


def word_row_scale(words, lead, head_dim: int, storage: str, fast: bool = False):
    """:func:`row_scale` of a row staged as int32 words (``words[(*lead, head_dim // 4)]`` holds
    the scale); ``fast``: for values converted exactly (the CUDA kernels' float16 tiles), not
    over :data:`FP8_LOAD_SCALE`."""
    scale = T.reinterpret("float32", words[(*lead, head_dim // 4)])
    if storage == "float8_e4m3fn" and not fast:
        return scale * T.float32(FP8_LOAD_SCALE)
    return scale
