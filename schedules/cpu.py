"""CPU (llvm) schedules: parallel over tokens or (sequence, head), vectorized over head_dim."""

from __future__ import annotations

from .common import new_schedule, under_locate, vector_lanes


#: op -> function(spec) giving that op's default knobs on this target.
KNOB_DEFAULTS = {"append": lambda spec: {"vector_bytes": 32}}
#: op -> function(spec) giving the values ``kvtvm.tune`` searches for each knob.
KNOB_SPACES = {"append": lambda spec: {"vector_bytes": [8, 16, 32, 64]}}


def default_knobs(spec) -> dict:
    return dict(KNOB_DEFAULTS[spec.op](spec))


def schedule_append(mod, spec, knobs):
    sch = new_schedule(mod, spec)
    block = sch.get_sblock("append")
    token = under_locate(sch, block)
    _, d = sch.get_loops(block)[-2:]
    _, d_vec = sch.split(d, [None, vector_lanes(spec, knobs["vector_bytes"])])
    sch.parallel(token)
    sch.vectorize(d_vec)
    return sch.mod
