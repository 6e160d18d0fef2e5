"""CPU (llvm) schedules: parallel over tokens or (sequence, head), vectorized over head_dim."""

from __future__ import annotations

from .common import new_schedule, under_locate, vector_lanes


#: op -> function(spec) giving that op's default knobs on this target.
KNOB_DEFAULTS = {"append": lambda spec: {"vector_bytes": 32, "parallel": True}}
#: op -> function(spec) giving the values ``kvtvm.tune`` searches for each knob.
KNOB_SPACES = {"append": lambda spec: {"vector_bytes": [8, 16, 32, 64]}}
#: op -> knob overrides the ops layer may ask for at run time besides the defaults (append and
#: decode: a serial kernel for small calls); ``python -m kvtvm build`` builds each of them too.
RUNTIME_VARIANTS = {"append": [{"parallel": False}], "decode": [{"parallel": False}]}


def default_knobs(spec) -> dict:
    return dict(KNOB_DEFAULTS[spec.op](spec))


def schedule_append(mod, spec, knobs):
    sch = new_schedule(mod, spec)
    block = sch.get_sblock("append")
    token = under_locate(sch, block)
    _, d = sch.get_loops(block)[-2:]
    _, d_vec = sch.split(d, [None, vector_lanes(spec, knobs["vector_bytes"])])
    if knobs["parallel"]:  # a serial variant serves small batches (no thread-pool wake-up)
        sch.parallel(token)
    sch.vectorize(d_vec)
    return sch.mod


# -- copy (kvtvm.kernels.copy) -------------------------------------------------------------
KNOB_DEFAULTS["copy"] = lambda spec: {"rows_per_task": 64, "vector_bytes": 32}
KNOB_SPACES["copy"] = lambda spec: {"rows_per_task": [16, 64, 256], "vector_bytes": [16, 32, 64]}


def schedule_copy(mod, spec, knobs):
    """(outer, inner / rows_per_task) in parallel; inside, the launch's copies in a serial
    loop, each moving rows_per_task rows of head_dim, vectorized."""
    sch = new_schedule(mod, spec)
    block = sch.get_sblock("copy")
    o, r, i, d = sch.get_loops(block)
    r_task, r_in = sch.split(r, [None, knobs["rows_per_task"]])
    sch.reorder(r_task, i, r_in)
    sch.parallel(sch.fuse(o, r_task))
    _, d_vec = sch.split(d, [None, vector_lanes(spec, knobs["vector_bytes"])])
    sch.vectorize(d_vec)
    return sch.mod


# -- prefill (kvtvm.kernels.prefill; schedule in cpu_prefill.py) ----------------------------
from .cpu_prefill import schedule_prefill, prefill_knobs, prefill_knob_space  # noqa: E402
KNOB_DEFAULTS["prefill"] = prefill_knobs
KNOB_SPACES["prefill"] = prefill_knob_space

# -- decode (kvtvm.kernels.decode; schedule in cpu_decode.py) ------------------------------
from .cpu_decode import schedule_decode, decode_knobs, decode_knob_space  # noqa: E402,F401
KNOB_DEFAULTS["decode"] = decode_knobs
KNOB_SPACES["decode"] = decode_knob_space
