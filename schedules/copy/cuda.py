"""CUDA schedule of copy (transformations of the definition; sm_90a and sm_80 alike): one
thread per (outer, inner, head_dim / lanes) vector; each thread runs the launch's copies in a
serial loop, lanes vectorized."""

from __future__ import annotations

from kvtvm.kernels._tvm import get_block

from ..common import new_schedule, vector_lanes


def default_knobs(spec) -> dict:
    return {"vector_bytes": 16, "threads": 256}


def schedule(mod, spec, knobs):
    sch = new_schedule(mod, spec)
    block = get_block(sch, "copy")
    o, r, i, d = sch.get_loops(block)
    d_out, d_vec = sch.split(d, [None, vector_lanes(spec, knobs["vector_bytes"])])
    sch.reorder(d_out, i)
    bx, tx = sch.split(sch.fuse(o, r, d_out), [None, knobs["threads"]])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(d_vec)
    (c,) = sch.get_loops(get_block(sch, "check"))
    cb, ct = sch.split(c, [None, 128])
    sch.bind(cb, "blockIdx.x")
    sch.bind(ct, "threadIdx.x")
    return sch.mod
