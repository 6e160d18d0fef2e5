"""Helpers shared by the schedules of every target."""

from __future__ import annotations

from tvm import s_tir

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def new_schedule(mod, spec) -> s_tir.Schedule:
    """A schedule over ``mod`` working on the spec's entry function."""
    sch = s_tir.Schedule(mod)
    sch.work_on(spec.func_name)
    return sch


def vector_lanes(spec, vector_bytes: int) -> int:
    """Elements of ``spec.dtype`` in a ``vector_bytes`` load, capped so it divides head_dim."""
    lanes = max(1, vector_bytes // DTYPE_BYTES[spec.dtype])
    while spec.head_dim % lanes:
        lanes //= 2
    return lanes


def under_locate(sch: s_tir.Schedule, consumer) -> s_tir.schedule.LoopRV:
    """Move ``consumer`` under the token loop of the ``locate`` block (token -> sequence),
    keep the located sequence in a register, and return that token loop."""
    locate = sch.get_sblock("locate")
    (token,) = sch.get_loops(locate)
    sch.reverse_compute_at(consumer, token)
    sch.set_scope(locate, 0, "local")
    return token
