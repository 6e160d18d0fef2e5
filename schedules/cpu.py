"""CPU (llvm) schedules: parallel over tokens or (sequence, head), vectorized over head_dim."""

from __future__ import annotations

from .common import new_schedule, under_locate, vector_lanes


def default_knobs(spec) -> dict:
    if spec.op == "append":
        return {"vector_bytes": 32}
    return {}


def schedule_append(mod, spec, knobs):
    sch = new_schedule(mod, spec)
    block = sch.get_sblock("append")
    token = under_locate(sch, block)
    _, d = sch.get_loops(block)[-2:]
    _, d_vec = sch.split(d, [None, vector_lanes(spec, knobs["vector_bytes"])])
    sch.parallel(token)
    sch.vectorize(d_vec)
    return sch.mod
