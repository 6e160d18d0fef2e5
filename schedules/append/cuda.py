"""CUDA schedule of append (transformations of the definition; sm_90a and sm_80 alike):
16-byte vector accesses, several tokens per thread block."""

from __future__ import annotations

from kvtvm.kernels._tvm import get_block

from ..common import new_schedule, under_locate, vector_lanes


def default_knobs(spec) -> dict:
    # 16-byte accesses; several tokens per thread block keep enough bytes in flight
    return {"vector_bytes": 16, "tokens_per_block": 4}


def schedule(mod, spec, knobs):
    """tokens -> (blockIdx.x, threadIdx.y); (head, dim / lanes) -> threadIdx.x; lanes vectorized."""
    sch = new_schedule(mod, spec)
    block = get_block(sch, "append")
    token = under_locate(sch, block)
    row = sch.get_loops(block)[1:]  # (head, dim); a single KV head leaves no head loop
    row = sch.fuse(*row) if len(row) > 1 else row[0]
    lanes = vector_lanes(spec, knobs["vector_bytes"])
    threads, vec = sch.split(row, [None, lanes])
    sch.vectorize(vec)
    sch.bind(threads, "threadIdx.x")
    bx, ty = sch.split(token, [None, knobs["tokens_per_block"]])
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    return sch.mod
