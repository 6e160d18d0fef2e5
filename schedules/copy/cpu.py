"""CPU (llvm) schedule of copy -- a HAND-WRITTEN TIR kernel with the definition's signature
(tests compare it with ``kvtvm.kernels.copy.define``): (outer, inner / rows_per_task) tasks in
parallel; inside, the launch's copies in a serial loop, each checked once (a copy outside the
rows is skipped: the definition's ``check`` block sets the flag) and moving rows_per_task rows
of head_dim, vectorized. Written by hand so that the bounds check sits outside the row loops
(as a condition inside the vectorized loop it cost 30-80%)."""

from __future__ import annotations

from kvtvm.errors import InvalidArgumentError
from kvtvm.kernels._tvm import ATTR_NOALIAS, T, alloc_buffer, block, prim_func  # noqa: F401
from kvtvm.kernels.accessor import _ITEMSIZE, match_err, match_tensor
from kvtvm.kernels.copy import in_rows
from kvtvm.kernels.errflag import ERR_PAGE

from ..common import replace_function, vector_lanes


def default_knobs(spec) -> dict:
    return {"rows_per_task": 64, "vector_bytes": 32}


def schedule(mod, spec, knobs):
    D, dtype = spec.head_dim, spec.dtype
    RT = knobs["rows_per_task"]
    if type(RT) is not int or RT < 1:  # (0: a TVM crash; -3 built a copy skipping rows)
        raise InvalidArgumentError(f"copy knob rows_per_task={RT!r}: a positive int is needed")
    L = vector_lanes(spec, knobs["vector_bytes"])
    DV = D // L
    align = _ITEMSIZE[dtype]

    # fmt: off
    @prim_func
    def copy(var_buf: T.handle, var_src: T.handle, var_dst: T.handle, var_err: T.handle):
        T.func_attr({ATTR_NOALIAS: True})
        outer, rows, inner, n = T.int64(), T.int64(), T.int64(), T.int64()
        buf = match_tensor(var_buf, (outer, rows, inner, T.int64(D)), dtype)
        src = match_tensor(var_src, (n,), "int32")
        dst = match_tensor(var_dst, (n,), "int32")
        err = match_err(var_err)
        out = T.decl_buffer((outer, rows, inner, T.int64(D)), dtype, data=buf.data,
                            align=align)
        for i in range(n):
            with block("check"):
                T.reads()
                T.writes()
                if not in_rows(src[i], dst[i], rows):
                    err[ERR_PAGE] = 1
        for task in T.parallel(outer * ((inner + RT - 1) // RT)):
            with block("copy"):
                T.reads()
                T.writes()
                o: T.int64 = task // ((inner + RT - 1) // RT)
                r0: T.int64 = T.floormod(task, (inner + RT - 1) // RT) * RT
                for i in range(n):
                    if in_rows(src[i], dst[i], rows):
                        for rr in range(T.min(T.int64(RT), inner - r0)):
                            for dv in range(DV):
                                for l in T.vectorized(L):
                                    out[o, T.Cast("int64", dst[i]), r0 + rr, dv * L + l] = \
                                        buf[o, T.Cast("int64", src[i]), r0 + rr, dv * L + l]
    # fmt: on
    return replace_function(mod, copy, "copy")
