"""CPU (llvm) schedule of prefill attention."""

from __future__ import annotations

from .common import new_schedule, under_locate


def prefill_knobs(spec) -> dict:
    return {"tile_q": 0}


def prefill_knob_space(spec) -> dict:
    return {"tile_q": [0]}


def schedule_prefill(mod, spec, knobs):
    sch = new_schedule(mod, spec)
    block = sch.get_sblock("attn")
    token = under_locate(sch, block)
    sch.parallel(token)
    return sch.mod
