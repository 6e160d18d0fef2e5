"""Append: write a ragged batch of new K/V rows into the cache.

Compile-time: dtype, n_kv_heads, head_dim, token layout (nhd/hnd).
Runtime: batch, tokens, pages, page_size, max pages per sequence, cache strides and offset.

Inputs (``b`` in ``[0, batch)``, new tokens of ``b`` are rows ``qo_indptr[b]:qo_indptr[b+1]``)::

    k_cache, v_cache  [num_pages, page_size, H, D] (nhd) or [num_pages, H, page_size, D] (hnd)
    k, v              [num_tokens, H, D]
    qo_indptr         [batch + 1] int32
    cache_lengths     [batch] int32    tokens already cached; row i of b goes to position
                                       cache_lengths[b] + i - qo_indptr[b]
    lookup_table      [batch, max_pages] int32

    err               [ERR_SLOTS] int32    error flag (:mod:`kvtvm.kernels.errflag`)

Every index is checked in the kernel, once per row by ``locate``: a row outside its sequence's
``qo_indptr`` range (``ERR_INDPTR``), at a position outside ``[0, max_pages * page_size)``
(``ERR_POSITION``) or on a page outside ``[0, num_pages)`` (``ERR_PAGE``) is marked skipped
(sequence -1), not written, and sets its flag; the op turns the flag into a typed error (with
``check_indices`` it raises before launch instead).

Blocks: ``locate`` (token -> sequence, by binary search of ``qo_indptr``) and ``append``.

Knobs: llvm ``vector_bytes``, ``parallel``; cuda ``vector_bytes``, ``tokens_per_block``
(schedules ``schedules/append/{cpu,cuda}.py``). Variants: ``"serial"`` on llvm.
"""

from __future__ import annotations

from ._tvm import ATTR_NOALIAS, T, alloc_buffer, block, prim_func
from .accessor import cache_index, find_sequence, match_cache_pair, match_err, match_tensor
from .errflag import ERR_INDPTR, ERR_PAGE, ERR_POSITION
from .reference import reference_append  # noqa: F401  (the numpy reference, beside its kernel)
from .variants import VARIANTS as _ALL_VARIANTS

#: Named runtime variants: target -> name -> knob overrides (``"serial"`` on llvm).
VARIANTS = _ALL_VARIANTS["append"]


def knob_space(spec) -> dict:
    """The knob values ``kvtvm.tune`` searches for ``spec`` (its target's schedule knobs)."""
    if spec.target == "llvm":
        return {"vector_bytes": [8, 16, 32, 64]}
    return {"vector_bytes": [4, 8, 16], "tokens_per_block": [1, 2, 4, 8]}


def define(spec):
    """The unscheduled append PrimFunc of ``spec``."""
    H, D, dtype, layout = spec.n_kv_heads, spec.head_dim, spec.dtype, spec.layout

    # fmt: off
    @prim_func
    def append(var_k_cache: T.handle, var_v_cache: T.handle, var_k: T.handle, var_v: T.handle,
               var_qo_indptr: T.handle, var_cache_lengths: T.handle, var_lookup: T.handle,
               var_err: T.handle):
        T.func_attr({ATTR_NOALIAS: True})
        num_pages, page_size, k_cache, v_cache = match_cache_pair(var_k_cache, var_v_cache,
                                                                  layout, H, D, dtype)
        ntok, batch, max_pages = T.int64(), T.int64(), T.int64()
        k = match_tensor(var_k, (ntok, H, D), dtype)
        v = match_tensor(var_v, (ntok, H, D), dtype)
        qo_indptr = match_tensor(var_qo_indptr, (batch + 1,), "int32")
        cache_lengths = match_tensor(var_cache_lengths, (batch,), "int32")
        lookup = match_tensor(var_lookup, (batch, max_pages), "int32")
        err = match_err(var_err)
        seq_of = alloc_buffer((ntok,), "int32")
        page_of = alloc_buffer((ntok,), "int64")
        slot_of = alloc_buffer((ntok,), "int64")
        for n in range(ntok):
            with block("locate"):
                vn = T.axis.spatial(ntok, n)
                T.reads(qo_indptr[0:batch + 1], cache_lengths[0:batch],
                        lookup[0:batch, 0:max_pages])
                T.writes(seq_of[vn], page_of[vn], slot_of[vn], err[0:4])
                # the row's sequence (largest b with qo_indptr[b] <= vn), page and slot, all
                # checked here once per row; sequence -1: the row is skipped (outside its
                # sequence's rows, its lookup row's capacity, or the pool)
                bounds = alloc_buffer((2,), "int32", scope="local")
                find_sequence(qo_indptr, bounds, batch, vn)
                seq_of[vn] = -1
                page_of[vn] = T.int64(0)
                slot_of[vn] = T.int64(0)
                if vn < T.Cast("int64", qo_indptr[bounds[0]]) \
                        or vn >= T.Cast("int64", qo_indptr[bounds[0] + 1]):
                    err[ERR_INDPTR] = 1
                else:
                    pos: T.int64 = T.Cast("int64", cache_lengths[bounds[0]]) + vn \
                        - T.Cast("int64", qo_indptr[bounds[0]])
                    if pos < T.int64(0) or pos >= max_pages * page_size:
                        err[ERR_POSITION] = 1
                    else:
                        page: T.int64 = T.Cast("int64", lookup[bounds[0],
                                                               T.truncdiv(pos, page_size)])
                        if page < T.int64(0) or page >= num_pages:
                            err[ERR_PAGE] = 1
                        else:
                            seq_of[vn] = bounds[0]
                            page_of[vn] = page
                            slot_of[vn] = T.truncmod(pos, page_size)
        for n, h, d in T.grid(ntok, H, D):
            with block("append"):
                vn, vh, vd = T.axis.remap("SSS", [n, h, d])
                T.reads(seq_of[vn], page_of[vn], slot_of[vn], k[vn, vh, vd], v[vn, vh, vd])
                T.writes(k_cache[0:num_pages, 0:k_cache.shape[1], 0:k_cache.shape[2], vd],
                         v_cache[0:num_pages, 0:v_cache.shape[1], 0:v_cache.shape[2], vd])
                if seq_of[vn] >= 0:  # checked by ``locate``
                    k_cache[cache_index(layout, page_of[vn], slot_of[vn], vh, vd)] = k[vn, vh, vd]
                    v_cache[cache_index(layout, page_of[vn], slot_of[vn], vh, vd)] = v[vn, vh, vd]
    # fmt: on
    return append
