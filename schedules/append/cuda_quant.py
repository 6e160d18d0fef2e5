"""CUDA schedule of the quantizing append (``kvtvm.kernels.append_quant``; sm_90a and sm_80
alike). Hand-written TIR (the kernel is rewritten whole, not transformed from the definition);
tests/quant check it against the numpy reference byte for byte.

A (token, head) row is spread over ``LPR`` lanes of a warp (a power of two, at most 32); each
lane loads ``VEC`` values of ``head_dim`` as one 16-byte vector (``PER_LANE`` of them for wide
heads), keeps them in registers, and the lanes of a row agree on its absolute maximum (and on
whether it holds a NaN/inf) by a butterfly of ``__shfl_xor_sync`` within their ``LPR``-lane
segment. Each lane then encodes its values into 8-bit codes packed four to an int32 word and
stores the words (the cache is addressed through an int32 view of the same bytes: whole-word
stores, coalesced across the row's lanes); lane 0 writes the scale word and the zero padding.
Rows of ``ROWS`` (token, head) pairs per block; the row -> (sequence, page, slot) lookup and its
bounds checks are the same as the CPU kernel's (a bad row is skipped and flagged). K and V may
be stored differently; a full-precision side (a K-only or V-only cache) is copied as 16-byte
vectors.

Scale and reciprocal use IEEE division (``__fdiv_rn``) despite nvcc's fast math, so the bytes
equal the reference; a row whose scale would be subnormal (below ``MIN_SCALE``) is stored as
zeros with scale 0, as the reference does. Under fast math's flush-to-zero float32 subnormal
inputs read as 0: beside a larger value in their row (amax between about 2**-119 and 2**-112)
the reference may round one to a code of +-1 where this kernel writes 0, the one place the
bytes may differ.
"""

from __future__ import annotations

from kvtvm.kernels._tvm import ATTR_IS_SCHEDULED, ATTR_NOALIAS, T, alloc_buffer, block, prim_func, tir
from kvtvm.kernels.accessor import cache_index, find_sequence, match_err, match_tensor
from kvtvm.kernels.append_quant import NAN_BITS, _EXP_MASK, match_params
from kvtvm.kernels.errflag import ERR_INDPTR, ERR_PAGE, ERR_POSITION
from kvtvm.kernels.quant_access import encode, match_quant_cache_pair
from kvtvm.quant import MIN_SCALE, QMAX, quant_row_bytes

from ..common import DTYPE_BYTES, replace_function

FULL_MASK = 0xFFFFFFFF


def default_knobs(spec) -> dict:
    return {"threads": 128}


def geometry(spec, knobs) -> dict:
    """Lanes per row, values per lane vector, vectors per lane and rows per block."""
    D = spec.head_dim
    if D % 4:
        raise ValueError(f"CUDA quantizing append: head_dim {D} must be a multiple of 4")
    vec = 16 // DTYPE_BYTES[spec.dtype]          # values in one 16-byte load
    while D % vec:
        vec //= 2
    chunks = D // vec
    lpr = 1
    while lpr < min(chunks, 32):
        lpr *= 2
    per_lane = -(-chunks // lpr)
    rows = max(1, int(knobs["threads"]) // lpr)
    return dict(vec=vec, chunks=chunks, lpr=lpr, per_lane=per_lane, rows=rows)


def _f32(value):
    return T.Cast("float32", value)


def _nonfinite(x):
    """1 when float32 ``x`` is NaN or +-inf (its exponent bits all set; fast-math safe)."""
    return T.Select(T.bitwise_and(T.reinterpret("int32", x), _EXP_MASK) == _EXP_MASK, 1, 0)


def _scale(amax, qmax: float):
    """The row's stored scale, ``amax / QMAX`` (IEEE division), 0 below ``MIN_SCALE`` (nvcc's
    flush-to-zero would give 0 for a subnormal one anyway: the reference's rule, explicit)."""
    s = T.call_pure_extern("float32", "__fdiv_rn", amax, T.float32(qmax))
    return T.Select(s < T.float32(MIN_SCALE), T.float32(0), s)


def _clip(x, red, qmax: float):
    """``x * inv`` clipped to ``[-qmax, qmax]``; 0 for a NaN product and for every value of a
    non-finite row (``red[1]``), as the reference writes them."""
    y = x * red[2]
    y = T.Select(tir.any(T.isnan(y), red[1] != T.float32(0)), T.float32(0), y)
    return T.min(T.max(y, T.float32(-qmax)), T.float32(qmax))


def _word(codes):
    """Four int8 codes packed into an int32 word, little-endian."""
    word = T.bitwise_and(T.Cast("int32", codes[0]), 0xFF)
    for i in range(1, 4):
        word = T.bitwise_or(word, T.shift_left(T.bitwise_and(T.Cast("int32", codes[i]), 0xFF),
                                               8 * i))
    return word


def _side(storage: str, layout: str, D: int, dtype: str, g: dict):
    """A macro writing one side (K or V) of row (n, h) at (page, slot): load, reduce across
    the row's lanes, encode, store (a plain 16-byte copy for a full-precision side)."""
    VEC, CHUNKS, LPR, PL = g["vec"], g["chunks"], g["lpr"], g["per_lane"]
    R = quant_row_bytes(D)

    if not storage:
        @T.macro
        def copy_side(cache, words, x, n, h, page, slot, tx, xs, red):
            for p in T.unroll(PL):
                if page >= 0 and p * LPR + tx < CHUNKS:
                    for v in T.vectorized(VEC):
                        cache[cache_index(layout, page, slot, h, (p * LPR + tx) * VEC + v)] = \
                            x[n, h, (p * LPR + tx) * VEC + v]

        return copy_side

    qmax = float(QMAX[storage])

    def word_index(cache, page, slot, h, col):
        """int32 word holding byte ``col`` of row (page, slot, h) (strides and offset are
        16-byte multiples: the op checks it)."""
        s = cache.strides
        if layout == "nhd":
            byte = page * s[0] + slot * s[1] + T.Cast("int64", h) * s[2]
        else:
            byte = page * s[0] + T.Cast("int64", h) * s[1] + slot * s[2]
        return T.truncdiv(cache.elem_offset + byte + col, T.int64(4))

    @T.macro
    def quant_side(cache, words, x, n, h, page, slot, tx, xs, red):
        red[0] = T.float32(0)  # amax of the finite values
        red[1] = T.float32(0)  # 1: the row holds a NaN or an inf
        for p in T.unroll(PL):
            if page >= 0 and p * LPR + tx < CHUNKS:
                for v in T.vectorized(VEC):
                    xs[p * VEC + v] = x[n, h, (p * LPR + tx) * VEC + v]
            else:
                for v in T.unroll(VEC):
                    xs[p * VEC + v] = T.Cast(dtype, 0)
            for v in T.unroll(VEC):
                red[1] = T.max(red[1], _f32(_nonfinite(_f32(xs[p * VEC + v]))))
                red[0] = T.max(red[0], T.Select(_nonfinite(_f32(xs[p * VEC + v])) != 0,
                                                T.float32(0), T.abs(_f32(xs[p * VEC + v]))))
        # every lane of the warp reaches the shuffles (a skipped row reduces zeros)
        for sh in T.unroll(LPR.bit_length() - 1):
            red[0] = T.max(red[0], T.tvm_warp_shuffle_xor(T.uint32(FULL_MASK), red[0],
                                                          LPR >> (sh + 1), LPR, 32))
            red[1] = T.max(red[1], T.tvm_warp_shuffle_xor(T.uint32(FULL_MASK), red[1],
                                                          LPR >> (sh + 1), LPR, 32))
        if page >= 0:
            # the inverse scale (0 where the scale is: an all-zero row, or one too small for
            # a normal scale); a non-finite row encodes zeros
            red[2] = T.Select(_scale(red[0], qmax) > T.float32(0), T.call_pure_extern(
                "float32", "__fdiv_rn", T.float32(qmax), red[0]), T.float32(0))
            for p in T.unroll(PL):
                if p * LPR + tx < CHUNKS:
                    for w in T.unroll(VEC // 4):
                        words[word_index(cache, page, slot, h, (p * LPR + tx) * VEC + w * 4)] = \
                            _word([encode(_clip(_f32(xs[p * VEC + w * 4 + i]), red, qmax),
                                          storage) for i in range(4)])
            if tx == 0:
                words[word_index(cache, page, slot, h, D)] = T.Select(
                    red[1] != T.float32(0), T.int32(NAN_BITS),
                    T.reinterpret("int32", _scale(red[0], qmax)))
                for i in T.unroll((R - D - 4) // 4):
                    words[word_index(cache, page, slot, h, D + 4 + 4 * i)] = T.int32(0)

    return quant_side


def build(spec, knobs):
    """The CUDA quantizing append PrimFunc of ``spec``."""
    H, D, dtype, layout = spec.n_kv_heads, spec.head_dim, spec.dtype, spec.layout
    ks, vs = spec.k_storage, spec.v_storage
    g = geometry(spec, knobs)
    LPR, RB, VEC, PL = g["lpr"], g["rows"], g["vec"], g["per_lane"]
    side_k = _side(ks, layout, D, dtype, g)
    side_v = _side(vs, layout, D, dtype, g)

    # fmt: off
    @prim_func
    def append(var_k_cache: T.handle, var_v_cache: T.handle, var_k: T.handle, var_v: T.handle,
               var_qo_indptr: T.handle, var_cache_lengths: T.handle, var_lookup: T.handle,
               var_err: T.handle):
        T.func_attr({ATTR_NOALIAS: True, ATTR_IS_SCHEDULED: True})
        (num_pages, page_size, ntok, batch, max_pages, k_cache, v_cache, k, v, qo_indptr,
         cache_lengths, lookup, err) = match_params(
            spec, var_k_cache, var_v_cache, var_k, var_v, var_qo_indptr, var_cache_lengths,
            var_lookup, var_err)
        k_words = T.decl_buffer((1,), "int32", data=k_cache.data)
        v_words = T.decl_buffer((1,), "int32", data=v_cache.data)
        for bx in T.thread_binding(T.Cast("int32", (ntok * H + RB - 1) // RB), thread="blockIdx.x"):
            for ty in T.thread_binding(RB, thread="threadIdx.y"):
                for tx in T.thread_binding(LPR, thread="threadIdx.x"):
                    with block("append"):
                        T.reads()
                        T.writes()
                        xs = alloc_buffer((PL * VEC,), dtype, scope="local")
                        red = alloc_buffer((3,), "float32", scope="local")  # amax, bad, inv
                        where = alloc_buffer((2,), "int64", scope="local")  # page (-1: skip), slot
                        bounds = alloc_buffer((2,), "int32", scope="local")
                        row: T.int64 = T.Cast("int64", bx) * RB + T.Cast("int64", ty)
                        n: T.int64 = T.truncdiv(row, T.int64(H))
                        h: T.int32 = T.Cast("int32", T.truncmod(row, T.int64(H)))
                        where[0] = T.int64(-1)
                        where[1] = T.int64(0)
                        if row < ntok * H:
                            find_sequence(qo_indptr, bounds, batch, n)
                            if n < T.Cast("int64", qo_indptr[bounds[0]]) \
                                    or n >= T.Cast("int64", qo_indptr[bounds[0] + 1]):
                                if tx == 0:
                                    err[ERR_INDPTR] = 1
                            else:
                                pos: T.int64 = T.Cast("int64", cache_lengths[bounds[0]]) + n \
                                    - T.Cast("int64", qo_indptr[bounds[0]])
                                if pos < T.int64(0) or pos >= max_pages * page_size:
                                    if tx == 0:
                                        err[ERR_POSITION] = 1
                                else:
                                    page: T.int64 = T.Cast("int64", lookup[
                                        bounds[0], T.truncdiv(pos, page_size)])
                                    if page >= T.int64(0) and page < num_pages:
                                        where[0] = page
                                        where[1] = T.truncmod(pos, page_size)
                                    elif tx == 0:
                                        err[ERR_PAGE] = 1
                        side_k(k_cache, k_words, k, n, h, where[0], where[1], tx, xs, red)
                        side_v(v_cache, v_words, v, n, h, where[0], where[1], tx, xs, red)
    # fmt: on
    return append


def schedule(mod, spec, knobs):
    return replace_function(mod, build(spec, knobs), "append")
