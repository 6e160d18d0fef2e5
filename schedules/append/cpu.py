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
    loops = sch.get_loops(block)
    if len(loops) > 1:  # under the token loop: head_dim (TVM drops unit loops, so with
        # n_kv_heads == head_dim == 1 there is none, and with head_dim == 1 it is the head's)
        _, d_vec = sch.split(loops[-1], [None, vector_lanes(spec, knobs["vector_bytes"])])
        sch.vectorize(d_vec)
    if knobs["parallel"]:  # a serial variant serves small batches (no thread-pool wake-up)
        sch.parallel(token)
    return sch.mod
