"""CUDA schedule of the quantizing append (``kvtvm.kernels.append_quant``; sm_90a and sm_80
alike): the kernel rebuilt with one thread per (token, head) row, ``threads`` per block -- a
row's max and its encoding are a serial loop over head_dim (a row is at most a few hundred
bytes; appends are small next to attention)."""

from __future__ import annotations

from kvtvm.kernels.append_quant import build_cuda

from ..common import replace_function


def default_knobs(spec) -> dict:
    return {"threads": 128}


def schedule(mod, spec, knobs):
    return replace_function(mod, build_cuda(spec, int(knobs["threads"])), "append")
