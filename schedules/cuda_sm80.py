"""CUDA schedules for Ampere (sm_80): the Hopper schedules (no Hopper-only instructions are
used by them), with Ampere's knob defaults where they differ."""

from __future__ import annotations

from .cuda_sm90 import KNOB_DEFAULTS, KNOB_SPACES, schedule_append  # noqa: F401


def default_knobs(spec) -> dict:
    return dict(KNOB_DEFAULTS[spec.op](spec))
from .cuda_sm90 import schedule_copy  # noqa: E402,F401  (copy: same schedule and knobs)
from .cuda_decode import schedule_decode  # noqa: E402,F401  (decode: same schedule and knobs)
from .cuda_sm90 import schedule_prefill, RUNTIME_VARIANTS  # noqa: E402,F401  (prefill: same)
