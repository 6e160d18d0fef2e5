"""CUDA schedules for Hopper (sm_90a): 16-byte vector accesses, one warp group per token
row for the memory-bound kernels."""

from __future__ import annotations

from .common import new_schedule, under_locate, vector_lanes


def append_knobs(spec) -> dict:
    # 16-byte accesses; several tokens per thread block keep enough bytes in flight
    return {"vector_bytes": 16, "tokens_per_block": 4}


#: op -> function(spec) giving that op's default knobs on this target.
KNOB_DEFAULTS = {"append": append_knobs}
#: op -> function(spec) giving the values ``kvtvm.tune`` searches for each knob.
KNOB_SPACES = {"append": lambda spec: {"vector_bytes": [4, 8, 16],
                                       "tokens_per_block": [1, 2, 4, 8]}}


def default_knobs(spec) -> dict:
    return dict(KNOB_DEFAULTS[spec.op](spec))


def schedule_append(mod, spec, knobs):
    """tokens -> (blockIdx.x, threadIdx.y); (head, dim / lanes) -> threadIdx.x; lanes vectorized."""
    sch = new_schedule(mod, spec)
    block = sch.get_sblock("append")
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


# -- copy (kvtvm.kernels.copy) -------------------------------------------------------------
KNOB_DEFAULTS["copy"] = lambda spec: {"vector_bytes": 16, "threads": 256}
KNOB_SPACES["copy"] = lambda spec: {"vector_bytes": [4, 8, 16], "threads": [128, 256, 512]}


def schedule_copy(mod, spec, knobs):
    """One thread per (outer, inner, head_dim / lanes) vector; each thread runs the launch's
    copies in a serial loop, lanes vectorized."""
    sch = new_schedule(mod, spec)
    block = sch.get_sblock("copy")
    o, r, i, d = sch.get_loops(block)
    d_out, d_vec = sch.split(d, [None, vector_lanes(spec, knobs["vector_bytes"])])
    sch.reorder(d_out, i)
    bx, tx = sch.split(sch.fuse(o, r, d_out), [None, knobs["threads"]])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(d_vec)
    return sch.mod


# -- decode (kvtvm.kernels.decode; schedule in cuda_decode.py) -----------------------------
from .cuda_decode import schedule_decode, decode_knobs, decode_knob_space  # noqa: E402,F401
KNOB_DEFAULTS["decode"] = decode_knobs
KNOB_SPACES["decode"] = decode_knob_space


# -- prefill (kvtvm.kernels.prefill; schedule in cuda_prefill.py) ---------------------------
from .cuda_prefill import (schedule_prefill, prefill_knobs, prefill_knob_space,  # noqa: E402,F401
                           SHORT_QUERY_KNOBS)
KNOB_DEFAULTS["prefill"] = prefill_knobs
KNOB_SPACES["prefill"] = prefill_knob_space
#: op -> knob overrides the ops layer may ask for at run time besides the defaults (prefill: a
#: small-tile kernel for calls whose sequences add few tokens each); ``python -m kvtvm build``
#: builds each of them too.
RUNTIME_VARIANTS = {"prefill": [SHORT_QUERY_KNOBS]}
