"""CPU (llvm) schedule of append (transformations of the definition): parallel over tokens,
vectorized over head_dim."""

from __future__ import annotations

from kvtvm.kernels._tvm import get_block

from ..common import new_schedule, under_locate, vector_lanes


def default_knobs(spec) -> dict:
    return {"vector_bytes": 32, "parallel": True}


def schedule(mod, spec, knobs):
    sch = new_schedule(mod, spec)
    block = get_block(sch, "append")
    token = under_locate(sch, block)
    _, d = sch.get_loops(block)[-2:]
    _, d_vec = sch.split(d, [None, vector_lanes(spec, knobs["vector_bytes"])])
    if knobs["parallel"]:  # a serial variant serves small batches (no thread-pool wake-up)
        sch.parallel(token)
    sch.vectorize(d_vec)
    return sch.mod
