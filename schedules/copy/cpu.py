"""CPU (llvm) schedule of copy (transformations of the definition): (outer, inner /
rows_per_task) in parallel; inside, the launch's copies in a serial loop, each moving
rows_per_task rows of head_dim, vectorized."""

from __future__ import annotations

from kvtvm.kernels._tvm import get_block

from ..common import new_schedule, vector_lanes


def default_knobs(spec) -> dict:
    return {"rows_per_task": 64, "vector_bytes": 32}


def schedule(mod, spec, knobs):
    sch = new_schedule(mod, spec)
    block = get_block(sch, "copy")
    o, r, i, d = sch.get_loops(block)
    r_task, r_in = sch.split(r, [None, knobs["rows_per_task"]])
    sch.reorder(r_task, i, r_in)
    sch.parallel(sch.fuse(o, r_task))
    _, d_vec = sch.split(d, [None, vector_lanes(spec, knobs["vector_bytes"])])
    sch.vectorize(d_vec)
    return sch.mod
