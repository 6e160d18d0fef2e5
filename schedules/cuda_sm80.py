"""CUDA schedules for Ampere (sm_80): the Hopper schedules with Ampere's knob defaults."""

from __future__ import annotations

from . import cuda_sm90


def default_knobs(spec) -> dict:
    return cuda_sm90.default_knobs(spec)


schedule_append = cuda_sm90.schedule_append
