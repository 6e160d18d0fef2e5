"""Helpers shared by the schedules of every family and target."""

from __future__ import annotations

from kvtvm.kernels._tvm import LoopRV, Schedule, get_block

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def new_schedule(mod, spec) -> Schedule:
    """A schedule over ``mod`` working on the spec's entry function."""
    sch = Schedule(mod)
    sch.work_on(spec.func_name)
    return sch


def vector_lanes(spec, vector_bytes: int) -> int:
    """Elements of ``spec.dtype`` in a ``vector_bytes`` load, capped so it divides head_dim."""
    lanes = max(1, vector_bytes // DTYPE_BYTES[spec.dtype])
    while spec.head_dim % lanes:
        lanes //= 2
    return lanes


def under_locate(sch: Schedule, consumer) -> LoopRV:
    """Move ``consumer`` under the token loop of the ``locate`` block (token -> sequence),
    keep the located sequence in a register, and return that token loop."""
    locate = get_block(sch, "locate")
    (token,) = sch.get_loops(locate)
    sch.reverse_compute_at(consumer, token)
    sch.set_scope(locate, 0, "local")
    return token


def replace_function(mod, func, what: str):
    """``mod`` with its one function replaced by the hand-written ``func`` (same name, same
    parameters: the definition's signature is the kernel's ABI)."""
    import tvm

    (name, old), = mod.functions_items()
    assert len(old.params) == len(func.params), f"{what} signature drifted from the definition"
    return tvm.IRModule({name: func.with_attr("global_symbol", name.name_hint)})
