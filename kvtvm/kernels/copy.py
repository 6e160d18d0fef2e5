"""Copy: move whole pages (or batch slots) of a cache tensor, in order, in place.

Used by the paged manager for copy-on-write of a shared page (fork, prefix hits) and by the
linear cache to compact surviving sequences to the front of the batch.

Compile-time: dtype, head_dim (the contiguous innermost extent, vectorized). ``n_kv_heads`` and
the layout do not matter to a copy; the ops layer always passes ``n_kv_heads=1``, layout
``nhd``, so one kernel per (dtype, head_dim) serves every cache.
Runtime: outer, rows, inner, number of copies.

Inputs::

    buf       [outer, rows, inner, head_dim]   contiguous, read and written in place
    src, dst  [n] int32                         row indices
    err       [ERR_SLOTS] int32                 error flag (:mod:`kvtvm.kernels.errflag`)

A copy whose ``src`` or ``dst`` lies outside ``[0, rows)`` is skipped and sets
``err[ERR_PAGE]`` (checked in the kernel in every mode).

One launch runs independent copies: no ``dst`` index repeats and none is also a ``src``
index, so any order gives ``buf[o, dst[i]] = buf[o, src[i]]`` (old values) for every ``i``
and ``o``. The ops layer (:mod:`kvtvm._copy_op`) turns an ordered list of copies (sequential
semantics, e.g. a compaction chain ``src = [1, 2], dst = [0, 1]``) into rounds of independent
copies, one launch each. Device code is emitted with ``restrict`` pointers; independence is
what makes that truthful for an in-place copy. Schedules parallelize over
``(outer, inner, head_dim)`` and keep the copies of a launch in a serial loop inside.

Blocks: ``copy``.

Knobs: llvm ``rows_per_task``, ``vector_bytes``; cuda ``vector_bytes``, ``threads``,
``vectors_per_thread``
(schedules ``schedules/copy/{cpu,cuda}.py``). No variants.
"""

from __future__ import annotations

from ._tvm import T, block, prim_func, tir
from .accessor import _ITEMSIZE, match_err, match_tensor
from .errflag import ERR_PAGE
from .reference import reference_copy_pages  # noqa: F401  (the numpy reference, beside its kernel)
from .variants import VARIANTS as _ALL_VARIANTS

__all__ = ["define", "knob_space", "reference_copy_pages", "VARIANTS"]

#: Named runtime variants: none (one kernel per spec).
VARIANTS = _ALL_VARIANTS["copy"]


def knob_space(spec) -> dict:
    """The knob values ``kvtvm.tune`` searches for ``spec`` (its target's schedule knobs)."""
    if spec.target == "llvm":
        return {"rows_per_task": [16, 64, 256], "vector_bytes": [16, 32, 64]}
    return {"vector_bytes": [4, 8, 16], "threads": [128, 256, 512],
            "vectors_per_thread": [1, 2, 4, 8]}


def in_rows(s, d, rows):
    """Whether copy ``s -> d`` stays inside the ``rows`` rows."""
    return tir.all(s >= 0, T.Cast("int64", s) < rows, d >= 0, T.Cast("int64", d) < rows)


def define(spec):
    """The unscheduled copy PrimFunc of ``spec`` (``spec.head_dim`` is the innermost extent)."""
    D, dtype = spec.head_dim, spec.dtype
    align = _ITEMSIZE[dtype]  # only element alignment is assumed (see match_tensor)

    # fmt: off
    @prim_func
    def copy(var_buf: T.handle, var_src: T.handle, var_dst: T.handle, var_err: T.handle):
        outer, rows, inner, n = T.int64(), T.int64(), T.int64(), T.int64()
        buf = match_tensor(var_buf, (outer, rows, inner, T.int64(D)), dtype)
        src = match_tensor(var_src, (n,), "int32")
        dst = match_tensor(var_dst, (n,), "int32")
        err = match_err(var_err)
        # the written side of ``buf``: same memory, a second buffer object, so the block's
        # reads and writes are distinct buffers for the scheduler
        out = T.decl_buffer((outer, rows, inner, T.int64(D)), dtype, data=buf.data,
                            align=align)
        # the flag is set by its own block: the copy's innermost loop keeps a branch-free,
        # loop-invariant condition the vectorizer hoists
        for i in range(n):
            with block("check"):
                vi = T.axis.spatial(n, i)
                T.reads(src[vi], dst[vi])
                T.writes(err[0:4])
                if not in_rows(src[vi], dst[vi], rows):
                    err[ERR_PAGE] = 1
        for o, r, i, d in T.grid(outer, inner, n, T.int64(D)):
            with block("copy"):
                vo, vr, vi, vd = T.axis.remap("SSSS", [o, r, i, d])
                T.reads(src[vi], dst[vi], buf[vo, 0:rows, vr, vd])
                T.writes(out[vo, 0:rows, vr, vd])
                if in_rows(src[vi], dst[vi], rows):
                    out[vo, T.Cast("int64", dst[vi]), vr, vd] = \
                        buf[vo, T.Cast("int64", src[vi]), vr, vd]
    # fmt: on
    return copy
