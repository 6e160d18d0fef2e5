"""Prefill: ragged multi-token causal attention over the cached prefix plus the new tokens.

Compile-time: dtype, n_kv_heads, group_size (query heads per KV head), head_dim, token layout
(nhd/hnd), feature ``"sliding_window"``, and how K and V are stored (``spec.k_storage`` /
``v_storage``: ``""`` full precision, or 8-bit rows with an inline float32 scale,
:mod:`kvtvm.quant`): one definition and one CPU schedule serve every storage type (the CUDA
schedule too: its tensor-core kernel stages and converts 8-bit tiles,
``schedules/prefill/cuda_quant_tiles.py``), the K/V loads dequantizing to
float32 (:mod:`kvtvm.kernels.quant_access`; a plain converting load for a full-precision side),
accumulation in float32.
Runtime: batch, tokens, pages, page_size, max pages per sequence, cache strides and offset,
``causal``, ``sm_scale``, ``window``.

Inputs (``b`` in ``[0, batch)``; the new tokens of ``b`` are rows ``qo_indptr[b]:qo_indptr[b+1]``
and their K/V are already in the cache, written by ``append``)::

    q                 [num_tokens, n_kv_heads * group_size, head_dim]   dtype
    k_cache, v_cache  [num_pages, page_size, H, D] (nhd) or [num_pages, H, page_size, D] (hnd)
    qo_indptr         [batch + 1] int32
    cache_lengths     [batch] int32    tokens cached before this step; sequence b attends over
                                       kv_len = cache_lengths[b] + new tokens of b positions
    lookup_table      [batch, max_pages] int32
    out               [num_tokens, n_q_heads, head_dim]   dtype     (written)
    lse               [num_tokens, n_q_heads] float32   natural-log sum of exp(scores) (written)
    causal            int32   1: row i of b (position p = cache_lengths[b] + i) sees KV <= p
    sm_scale          float32 scores are sm_scale * q.k
    window            int32   with feature "sliding_window": a row at position p sees only
                              KV positions > p - window (window >= 1); ignored otherwise
    err               [ERR_SLOTS] int32   error flag (:mod:`kvtvm.kernels.errflag`)

Every index is checked in the kernel: a row outside ``[qo_indptr[b], qo_indptr[b+1])`` of
the sequence found for it sets ``err[ERR_INDPTR]``, a sequence with a negative length or
``cache_lengths[b] + new tokens > max_pages * page_size`` sets ``err[ERR_POSITION]`` (those
rows attend over nothing: their outputs are unspecified), and a KV position on a page outside
``[0, num_pages)`` is left out of the softmax and sets ``err[ERR_PAGE]``.

Query head ``h`` reads KV head ``h // group_size``. Accumulation is float32 for every dtype;
the softmax runs in base 2 on scores pre-multiplied by ``sm_scale * log2(e)``.

Blocks: ``locate`` (token -> sequence, binary search of ``qo_indptr``) and ``attn`` (one
(token, query head) row: online softmax over its visible KV positions). The tuned schedules
replace this per-row form by hand-written tiled kernels with the same signature (see
``schedules/prefill/cpu.py`` and ``schedules/prefill/cuda.py``), checked against it.

Knobs: llvm ``tile_q`` (0: schedule this definition), ``tile_kv``, ``row_block``,
``key_block``; cuda ``warps``, ``tile_kv``, ``stages``, ``q_in_regs``, ``m_tiles``,
``one_barrier``, ``wgmma``. Variants: ``"short_query"`` on cuda.
"""

from __future__ import annotations

import math

from ._tvm import ATTR_NOALIAS, T, alloc_buffer, block, prim_func, tir
from .accessor import find_sequence, match_cache_pair, match_err, match_tensor
from .errflag import ERR_INDPTR, ERR_PAGE, ERR_POSITION
from .quant_access import dequant
from .reference import reference_prefill  # noqa: F401  (the numpy reference, beside its kernel)
from .variants import VARIANTS as _ALL_VARIANTS

#: Named runtime variants: target -> name -> knob overrides (``"short_query"`` on cuda).
VARIANTS = _ALL_VARIANTS["prefill"]

#: log2(e): the kernels softmax in base 2.
LOG2E = math.log2(math.e)
#: "minus infinity" of the running max (finite, so max - max never makes a NaN).
NEG_INF = -1.0e30


def match_params(spec, var_q, var_k_cache, var_v_cache, var_qo_indptr, var_cache_lengths,
                 var_lookup, var_out, var_lse, var_err):
    """Bind the buffers of the prefill signature (call inside a TVMScript function; the
    definition and every schedule that writes its own PrimFunc share it).

    Returns ``(ntok, batch, num_pages, page_size, max_pages, q, k_cache, v_cache, qo_indptr,
    cache_lengths, lookup, out, lse, err)``.
    """
    H, D, dtype = spec.n_kv_heads, spec.head_dim, spec.dtype
    HQ = H * spec.group_size
    ntok, batch, max_pages = T.int64(), T.int64(), T.int64()
    q = match_tensor(var_q, (ntok, HQ, D), dtype)
    num_pages, page_size, k_cache, v_cache = match_cache_pair(
        var_k_cache, var_v_cache, spec.layout, H, D, dtype, spec.k_storage, spec.v_storage)
    qo_indptr = match_tensor(var_qo_indptr, (batch + 1,), "int32")
    cache_lengths = match_tensor(var_cache_lengths, (batch,), "int32")
    lookup = match_tensor(var_lookup, (batch, max_pages), "int32")
    out = match_tensor(var_out, (ntok, HQ, D), dtype)
    lse = match_tensor(var_lse, (ntok, HQ), "float32")
    err = match_err(var_err)
    return (ntok, batch, num_pages, page_size, max_pages, q, k_cache, v_cache, qo_indptr,
            cache_lengths, lookup, out, lse, err)


def sequence_ok(qo_indptr, cache_lengths, b, capacity):
    """Whether sequence ``b``'s length is >= 0 and its final length (cached + new) fits the
    ``capacity`` positions of its lookup-table row (int64 arithmetic: no overflow)."""
    return tir.all(cache_lengths[b] >= 0,
                   T.Cast("int64", cache_lengths[b]) + T.Cast("int64", qo_indptr[b + 1])
                   - T.Cast("int64", qo_indptr[b]) <= capacity)


def uses_wgmma(spec) -> bool:
    """Whether ``spec``'s CUDA tensor-core prefill can issue wgmma (sm_90a, head_dim <= 128)."""
    return spec.arch == "sm_90a" and spec.dtype != "float32" and spec.head_dim <= 128


def knob_space(spec):
    """The knob values ``kvtvm.tune`` searches for ``spec`` (its target's schedule knobs); on
    sm_90a a list of grids (the mma.sync kernel's and the wgmma kernel's, which has no
    m_tiles / q_in_regs choices)."""
    if spec.target == "llvm":
        return {"tile_q": [4, 8, 16, 32], "tile_kv": [16, 32, 64], "row_block": [2, 4, 8],
                "key_block": [2, 4, 8]}
    if spec.dtype == "float32":
        return {"warps": [2, 4, 8]}
    mma = {"warps": [2, 4, 8], "tile_kv": [32, 64] if spec.head_dim <= 128 else [16, 32],
           "stages": [2, 3], "q_in_regs": [0, 1] if spec.head_dim <= 128 else [0],
           "m_tiles": [1, 2] if spec.head_dim <= 128 else [1], "one_barrier": [0, 1],
           "wgmma": [0]}
    if spec.quantized:  # 8-bit tiles: two m-tiles a warp, or 16 warps of wgmma, spill
        mma["m_tiles"] = [1]
    if not uses_wgmma(spec):
        return mma
    wgmma = {"warps": [8, 12, 16], "tile_kv": [32, 64], "stages": [2, 3], "q_in_regs": [0],
             "m_tiles": [1], "one_barrier": [1], "wgmma": [1]}
    if spec.quantized:
        return [mma, dict(wgmma, warps=[8])]
    # 128-position tiles need ~190 registers a thread: two warp groups at most
    return [mma, wgmma, dict(wgmma, warps=[8], tile_kv=[128])]


def define(spec):
    """The unscheduled prefill PrimFunc of ``spec`` (one row per (token, query head))."""
    H, G, D, dtype, layout = (spec.n_kv_heads, spec.group_size, spec.head_dim, spec.dtype,
                              spec.layout)
    HQ = H * G
    SLIDE = 1 if "sliding_window" in spec.features else 0  # noqa: N806

    # fmt: off
    @prim_func
    def prefill(var_q: T.handle, var_k_cache: T.handle, var_v_cache: T.handle,
                var_qo_indptr: T.handle, var_cache_lengths: T.handle, var_lookup: T.handle,
                var_out: T.handle, var_lse: T.handle, causal: T.int32, sm_scale: T.float32,
                window: T.int32, var_err: T.handle):
        T.func_attr({ATTR_NOALIAS: True})
        (ntok, batch, num_pages, page_size, max_pages, q, k_cache, v_cache, qo_indptr,
         cache_lengths, lookup, out, lse, err) = match_params(
            spec, var_q, var_k_cache, var_v_cache, var_qo_indptr, var_cache_lengths,
            var_lookup, var_out, var_lse, var_err)
        seq_of = alloc_buffer((ntok,), "int32")
        for n in range(ntok):
            with block("locate"):
                vn = T.axis.spatial(ntok, n)
                T.reads(qo_indptr[0:batch + 1])
                T.writes(seq_of[vn])
                bounds = alloc_buffer((2,), "int32", scope="local")
                find_sequence(qo_indptr, bounds, batch, vn)
                seq_of[vn] = bounds[0]
        for n, h in T.grid(ntok, HQ):
            with block("attn"):
                vn, vh = T.axis.remap("SS", [n, h])
                T.reads(seq_of[vn], qo_indptr[0:batch + 1], cache_lengths[0:batch],
                        lookup[0:batch, 0:max_pages], q[vn, vh, 0:D],
                        k_cache[0:num_pages, 0:k_cache.shape[1], 0:k_cache.shape[2], 0:D],
                        v_cache[0:num_pages, 0:v_cache.shape[1], 0:v_cache.shape[2], 0:D])
                T.writes(out[vn, vh, 0:D], lse[vn, vh], err[0:4])
                acc = alloc_buffer((D,), "float32", scope="local")
                qs = alloc_buffer((D,), "float32", scope="local")
                st = alloc_buffer((4,), "float32", scope="local")  # m, l, s, alpha
                b: T.int32 = seq_of[vn]
                pos: T.int64 = T.Cast("int64", cache_lengths[b]) + vn \
                    - T.Cast("int64", qo_indptr[b])
                kv_len: T.int64 = T.Cast("int64", cache_lengths[b]) \
                    + T.Cast("int64", qo_indptr[b + 1]) - T.Cast("int64", qo_indptr[b])
                row_ok: T.bool = tir.all(T.Cast("int64", qo_indptr[b]) <= vn,
                                         vn < T.Cast("int64", qo_indptr[b + 1]))
                len_ok: T.bool = sequence_ok(qo_indptr, cache_lengths, b,
                                             max_pages * page_size)
                if not row_ok:
                    err[ERR_INDPTR] = 1
                elif not len_ok:
                    err[ERR_POSITION] = 1
                hi: T.int64 = T.if_then_else(row_ok and len_ok,
                                             T.if_then_else(causal != 0, pos + 1, kv_len),
                                             T.int64(0))
                lo: T.int64 = T.max(pos - T.Cast("int64", window) + 1, T.int64(0)) * SLIDE
                for d in range(D):
                    qs[d] = T.Cast("float32", q[vn, vh, d]) * sm_scale * T.float32(LOG2E)
                    acc[d] = T.float32(0)
                st[0] = T.float32(NEG_INF)
                st[1] = T.float32(0)
                for j in range(T.max(hi - lo, T.int64(0))):
                    page: T.int64 = T.Cast("int64", lookup[b, T.truncdiv(lo + j, page_size)])
                    slot: T.int64 = T.truncmod(lo + j, page_size)
                    if page >= 0 and page < num_pages:
                        st[2] = T.float32(0)
                        for d in range(D):
                            st[2] = st[2] + qs[d] * dequant(
                                k_cache, layout, page, slot, vh // G, d, D, spec.k_storage)
                        st[3] = T.exp2(st[0] - T.max(st[0], st[2]))
                        st[0] = T.max(st[0], st[2])
                        st[2] = T.exp2(st[2] - st[0])
                        st[1] = st[1] * st[3] + st[2]
                        for d in range(D):
                            acc[d] = acc[d] * st[3] + st[2] * dequant(
                                v_cache, layout, page, slot, vh // G, d, D, spec.v_storage)
                    else:
                        err[ERR_PAGE] = 1
                for d in range(D):
                    out[vn, vh, d] = T.Cast(dtype, acc[d] / st[1])
                lse[vn, vh] = (st[0] + T.log2(st[1])) * T.float32(1.0 / LOG2E)
    # fmt: on
    return prefill
