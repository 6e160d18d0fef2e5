"""Hand-written schedules, one module per target family (installed as ``kvtvm.schedules``).

Each module defines ``default_knobs(spec) -> dict`` and ``schedule_<op>(mod, spec, knobs)``
returning the scheduled ``IRModule``. Schedules find blocks by the names the kernel
definitions give them.
"""
