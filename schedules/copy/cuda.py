"""CUDA schedule of copy (sm_90a and sm_80 alike) -- a HAND-WRITTEN TIR kernel with the
definition's signature (tests compare it with ``kvtvm.kernels.copy.define``): each thread moves
``vectors_per_thread`` 16-byte vectors, ``threads`` apart (blocks over (outer) x (copy, chunk
of the row's vectors)), so a warp moves contiguous bytes and the launch's copies run in
parallel (they are independent by the op's contract; outer < 65536, the grid's y limit, which
the op checks). Each thread checks its copy's ``src``/``dst`` once; a copy outside the rows is
skipped and its first thread sets the flag -- no second kernel, no serial loop."""

from __future__ import annotations

from kvtvm.kernels._tvm import ATTR_IS_SCHEDULED, ATTR_NOALIAS, T, block, prim_func, tir
from kvtvm.kernels.accessor import _ITEMSIZE, match_err, match_tensor
from kvtvm.kernels.errflag import ERR_PAGE

from ..common import replace_function, vector_lanes


def _in_rows(s, d, rows):
    """``kvtvm.kernels.copy.in_rows`` as two unsigned compares (a negative index wraps past
    every row count)."""
    return tir.all(T.Cast("uint64", T.Cast("int64", s)) < T.Cast("uint64", rows),
                   T.Cast("uint64", T.Cast("int64", d)) < T.Cast("uint64", rows))


def default_knobs(spec) -> dict:
    # two vectors per thread: on an H100 (docs/PERF.md) they moved 1024 pages 7% faster than one
    # and cut the bounds check's cost there from +7% to +1% (tools/gpu_copy_check_probe.py)
    return {"vector_bytes": 16, "threads": 256, "vectors_per_thread": 2}


def schedule(mod, spec, knobs):
    D, dtype = spec.head_dim, spec.dtype
    L = vector_lanes(spec, knobs["vector_bytes"])
    DV = D // L
    NT = int(knobs["threads"])
    VPT = int(knobs.get("vectors_per_thread", 1))  # a thread's vectors, NT apart (coalesced)
    align = _ITEMSIZE[dtype]

    # fmt: off
    @prim_func
    def copy(var_buf: T.handle, var_src: T.handle, var_dst: T.handle, var_err: T.handle):
        T.func_attr({ATTR_NOALIAS: True, ATTR_IS_SCHEDULED: True})
        outer, rows, inner, n = T.int64(), T.int64(), T.int64(), T.int64()
        buf = match_tensor(var_buf, (outer, rows, inner, T.int64(D)), dtype)
        src = match_tensor(var_src, (n,), "int32")
        dst = match_tensor(var_dst, (n,), "int32")
        err = match_err(var_err)
        out = T.decl_buffer((outer, rows, inner, T.int64(D)), dtype, data=buf.data,
                            align=align)
        # blockIdx.y: the outer index; blockIdx.x: (copy, chunk of its row's vectors); 32-bit
        # index arithmetic (64-bit division is emulated on the GPU)
        for by in T.thread_binding(T.Cast("int32", outer), thread="blockIdx.y"):
            for bx in T.thread_binding(T.Cast("int32", n) * T.Cast("int32", (inner * DV + NT * VPT - 1) // (NT * VPT)),
                                       thread="blockIdx.x"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    with block("copy"):
                        T.reads()
                        T.writes()
                        chunks: T.int32 = T.Cast("int32", (inner * DV + NT * VPT - 1) // (NT * VPT))
                        i: T.int32 = T.truncdiv(bx, chunks)
                        w0: T.int32 = T.truncmod(bx, chunks) * (NT * VPT) + tx
                        ok: T.bool = _in_rows(src[i], dst[i], rows)  # checked once per thread
                        if ok:
                            for k in T.unroll(VPT):
                                if w0 + k * NT < T.Cast("int32", inner) * DV:
                                    for l in T.vectorized(L):
                                        out[T.Cast("int64", by), T.Cast("int64", dst[i]),
                                            T.Cast("int64", T.truncdiv(w0 + k * NT, DV)),
                                            T.Cast("int64", T.truncmod(w0 + k * NT, DV) * L + l)] = \
                                            buf[T.Cast("int64", by), T.Cast("int64", src[i]),
                                                T.Cast("int64", T.truncdiv(w0 + k * NT, DV)),
                                                T.Cast("int64", T.truncmod(w0 + k * NT, DV) * L + l)]
                        elif w0 == 0 and by == 0:
                            err[ERR_PAGE] = 1
    # fmt: on
    return replace_function(mod, copy, "copy")
