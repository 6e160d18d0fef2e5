"""CPU (llvm) schedule of the quantizing append (``kvtvm.kernels.append_quant``): the kernel
rebuilt from the knobs -- tokens in parallel, ``vector_bytes / 4`` float32 lanes over
head_dim for the row max, the scaling and the encoding."""

from __future__ import annotations

from kvtvm.kernels.append_quant import build

from ..common import replace_function


def default_knobs(spec) -> dict:
    return {"vector_bytes": 64, "parallel": True}


def schedule(mod, spec, knobs):
    func = build(spec, bool(knobs["parallel"]), max(1, int(knobs["vector_bytes"]) // 4))
    return replace_function(mod, func, "append")
