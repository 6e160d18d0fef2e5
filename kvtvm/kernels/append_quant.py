"""Append into a quantized cache: quantize each new (token, head) row of K and V and write its
8-bit values, float32 scale and zero padding (:mod:`kvtvm.quant`), byte for byte what
:func:`kvtvm.quant.quantize_rows` writes.

Same signature, inputs, bounds checks and error flag as :mod:`kvtvm.kernels.append` (whose
docstring describes them: a row with a bad ``qo_indptr``, position or page is skipped and
flagged); the K and V caches are ``int8`` buffers of rows of ``quant_row_bytes(head_dim)``
bytes, or ``dtype`` rows for a full-precision side (``spec.k_storage`` / ``v_storage`` ``""``).

Per row: ``amax`` of the finite values and whether any is NaN/inf (on the bits), then
``scale = amax / QMAX``, flushed to 0 below ``MIN_SCALE`` (float32's smallest normal), ``inv
= QMAX / amax`` (0 where the scale is 0: an all-zero row, or one too small for a normal
scale, is written as zeros), and each value is ``encode(clip(x * inv))``; a row holding NaN
or inf is written as zeros with a NaN scale.

:func:`build` writes the CPU kernel from two knobs (one task per token in parallel or
serially; ``lanes`` float32 lanes per vector); :func:`define` is the serial scalar form. The
CUDA kernel is hand-written in ``schedules/append/cuda_quant.py`` (IEEE division despite nvcc's
fast math; under its flush-to-zero a row whose largest magnitude is a float32 subnormal, below
2**-126, is stored as zeros; the CPU follows the reference there too).
"""

from __future__ import annotations

from ..quant import MIN_SCALE, QMAX, quant_row_bytes
from ._tvm import ATTR_NOALIAS, T, alloc_buffer, block, prim_func, tir
from .accessor import cache_index, find_sequence, match_err, match_tensor
from .append import VARIANTS  # noqa: F401  (same runtime variants as the full-precision append)
from .errflag import ERR_INDPTR, ERR_PAGE, ERR_POSITION
from .quant_access import encode, match_quant_cache_pair, scale_byte

#: float32 bits of NaN (what numpy writes for the scale of a non-finite row).
NAN_BITS = 0x7FC00000
_EXP_MASK = 0x7F800000


def knob_space(spec) -> dict:
    """The knob values ``kvtvm.tune`` searches for ``spec`` (its target's schedule knobs: the
    CUDA schedule has no ``vector_bytes``, its rows are 16-byte loads; it tunes the block)."""
    if spec.target == "llvm":
        return {"vector_bytes": [16, 32, 64]}
    return {"threads": [64, 128, 256, 512]}


def _f32(value):
    return T.Cast("float32", value)


def _finite_or_zero(y, bad):
    """``y`` with NaN -> 0 (``0 * inf``), and 0 for a non-finite row (``bad``)."""
    return T.Select(tir.any(T.isnan(y), bad != 0), T.float32(0), y)


def define(spec):
    """The unscheduled (serial, scalar) quantizing append of ``spec``."""
    return build(spec, parallel=False, lanes=1)


def _row_writer(storage: str, layout: str, D: int, L: int):
    """A macro writing row ``(n, h)`` of ``x`` into ``cache`` at (page, slot): a copy for a
    full-precision side, quantize + scale + padding for an 8-bit one."""
    R = quant_row_bytes(D)
    DV = D // L

    if not storage:
        @T.macro
        def copy_row(cache, x, n, h, page, slot, amax, bad, sv):
            for dv in range(DV):
                for l in T.vectorized(L):
                    cache[cache_index(layout, page, slot, h, dv * L + l)] = x[n, h, dv * L + l]

        return copy_row

    qmax = float(QMAX[storage])

    @T.macro
    def quant_row(cache, x, n, h, page, slot, amax, bad, sv):
        for l in T.vectorized(L):
            amax[l] = T.float32(0)
            bad[l] = 0
        for dv in range(DV):
            for l in T.vectorized(L):
                bad[l] = T.max(bad[l], T.Select(T.bitwise_and(T.reinterpret(
                    "int32", _f32(x[n, h, dv * L + l])), _EXP_MASK) == _EXP_MASK, 1, 0))
                amax[l] = T.max(amax[l], T.Select(T.bitwise_and(T.reinterpret(
                    "int32", _f32(x[n, h, dv * L + l])), _EXP_MASK) == _EXP_MASK,
                    T.float32(0), T.abs(_f32(x[n, h, dv * L + l]))))
        for l in range(1, L):
            amax[0] = T.max(amax[0], amax[l])
            bad[0] = T.max(bad[0], bad[l])
        if bad[0] != 0:  # the row is stored as zeros (x * 0, NaN/inf -> 0) with a NaN scale
            sv[0] = T.float32(0)  # its scale bytes are NaN's (from the int bits: CUDA codegen
            # cannot reinterpret a constant)
            sv[1] = T.float32(0)
        else:  # a scale below MIN_SCALE (0 for an all-zero row) is stored as 0, values 0
            sv[0] = amax[0] / T.float32(qmax)
            sv[0] = T.Select(sv[0] < T.float32(MIN_SCALE), T.float32(0), sv[0])
            sv[1] = T.Select(sv[0] > T.float32(0), T.float32(qmax) / amax[0], T.float32(0))
        for dv in range(DV):
            for l in T.vectorized(L):
                cache[cache_index(layout, page, slot, h, dv * L + l)] = encode(T.min(T.max(
                    _finite_or_zero(_f32(x[n, h, dv * L + l]) * sv[1], bad[0]),
                    T.float32(-qmax)), T.float32(qmax)), storage)
        for i in range(4):
            cache[cache_index(layout, page, slot, h, D + i)] = T.Select(
                bad[0] != 0, T.Cast("int8", T.shift_right(T.int32(NAN_BITS), 8 * i)),
                scale_byte(sv[0], i))
        for i in range(R - D - 4):
            cache[cache_index(layout, page, slot, h, D + 4 + i)] = T.int8(0)

    return quant_row


def match_params(spec, var_k_cache, var_v_cache, var_k, var_v, var_qo_indptr,
                 var_cache_lengths, var_lookup, var_err):
    """Bind the buffers of the append signature over a (partly) quantized K/V pair (call inside
    a TVMScript function; the CPU kernel and the CUDA schedule share it). Returns ``(num_pages,
    page_size, ntok, batch, max_pages, k_cache, v_cache, k, v, qo_indptr, cache_lengths, lookup,
    err)``."""
    H, D, dtype = spec.n_kv_heads, spec.head_dim, spec.dtype
    num_pages, page_size, k_cache, v_cache = match_quant_cache_pair(
        var_k_cache, var_v_cache, spec.layout, H, D, dtype, spec.k_storage, spec.v_storage)
    ntok, batch, max_pages = T.int64(), T.int64(), T.int64()
    k = match_tensor(var_k, (ntok, H, D), dtype)
    v = match_tensor(var_v, (ntok, H, D), dtype)
    qo_indptr = match_tensor(var_qo_indptr, (batch + 1,), "int32")
    cache_lengths = match_tensor(var_cache_lengths, (batch,), "int32")
    lookup = match_tensor(var_lookup, (batch, max_pages), "int32")
    err = match_err(var_err)
    return (num_pages, page_size, ntok, batch, max_pages, k_cache, v_cache, k, v, qo_indptr,
            cache_lengths, lookup, err)


def _token_writer(write_k, write_v):
    """A macro writing heads ``[h_lo, h_hi)`` of ragged row ``n``: find its sequence, check
    the row offset, position and page (skip and flag what is out of range), write."""

    @T.macro
    def quant_token(k_cache, v_cache, k, v, qo_indptr, cache_lengths, lookup, err, num_pages,
                    page_size, max_pages, batch, n, h_lo, h_hi, amax, bad, sv, bounds):
        find_sequence(qo_indptr, bounds, batch, n)
        pos: T.int64 = T.Cast("int64", cache_lengths[bounds[0]]) + n \
            - T.Cast("int64", qo_indptr[bounds[0]])
        if n < T.Cast("int64", qo_indptr[bounds[0]]) \
                or n >= T.Cast("int64", qo_indptr[bounds[0] + 1]):
            err[ERR_INDPTR] = 1
        elif pos < T.int64(0) or pos >= max_pages * page_size:
            err[ERR_POSITION] = 1
        else:
            page: T.int64 = T.Cast("int64", lookup[bounds[0], T.truncdiv(pos, page_size)])
            slot: T.int64 = T.truncmod(pos, page_size)
            if page >= 0 and page < num_pages:
                for h in range(h_lo, h_hi):
                    write_k(k_cache, k, n, h, page, slot, amax, bad, sv)
                    write_v(v_cache, v, n, h, page, slot, amax, bad, sv)
            else:
                err[ERR_PAGE] = 1

    return quant_token


def build(spec, parallel: bool, lanes: int):
    """The quantizing append PrimFunc: tokens in parallel (or serially), each head's K and V
    row with ``lanes``-wide vectors over head_dim."""
    H, D, dtype, layout = spec.n_kv_heads, spec.head_dim, spec.dtype, spec.layout
    ks, vs = spec.k_storage, spec.v_storage
    L = max(1, lanes)
    while D % L:
        L //= 2
    write_k = _row_writer(ks, layout, D, L)
    write_v = _row_writer(vs, layout, D, L)
    tasks = T.parallel if parallel else T.serial

    quant_token = _token_writer(write_k, write_v)

    # fmt: off
    @prim_func
    def append(var_k_cache: T.handle, var_v_cache: T.handle, var_k: T.handle, var_v: T.handle,
               var_qo_indptr: T.handle, var_cache_lengths: T.handle, var_lookup: T.handle,
               var_err: T.handle):
        T.func_attr({ATTR_NOALIAS: True})
        (num_pages, page_size, ntok, batch, max_pages, k_cache, v_cache, k, v, qo_indptr,
         cache_lengths, lookup, err) = match_params(
            spec, var_k_cache, var_v_cache, var_k, var_v, var_qo_indptr, var_cache_lengths,
            var_lookup, var_err)
        for n in tasks(ntok):
            with block("append"):
                T.reads()
                T.writes()
                amax = alloc_buffer((L,), "float32")
                bad = alloc_buffer((L,), "int32")
                sv = alloc_buffer((2,), "float32")  # scale, inverse
                bounds = alloc_buffer((2,), "int32", scope="local")
                quant_token(k_cache, v_cache, k, v, qo_indptr, cache_lengths, lookup, err,
                            num_pages, page_size, max_pages, batch, n, 0, H, amax, bad, sv, bounds)
    # fmt: on
    return append
