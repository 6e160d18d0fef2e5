"""Prefill attention on a GPU: every prebuilt candidate (``python -m kvtvm.tune --op prefill
--build-only build/tune --arch sm_90a``) at the benchmark's shapes, each checked against torch
SDPA on the same inputs before it is timed.

Run on the GPU machine after ``source tools/gpu-env.sh``:
``python3 tools/gpu_prefill_probe.py build/tune --json $OUT/prefill-probe.json``.
Kernel time = CUDA-graph replays with the L2 cache flushed before each (kvtvm.bench.common).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from kvtvm import runtime
from kvtvm.bench.common import timed
from kvtvm.bench.prefill import GPU_CASES, HEAD_DIM, Case, run_sdpa
from kvtvm.tune import manifest_specs, prebuilt_candidates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    spec, = manifest_specs(args.root, "prefill")
    cases = [Case(b, n, c, spec.dtype, "cuda") for b, n, c in GPU_CASES]
    wants = [run_sdpa(case)().transpose(1, 2).reshape(case.q.shape).float() for case in cases]
    scale = 1.0 / math.sqrt(HEAD_DIM)
    rows = []
    print("TFLOP/s per case: " + "  ".join(case.name for case in cases))
    for knobs, path in prebuilt_candidates(spec, args.root):
        row = {"knobs": knobs}
        if isinstance(path, str):
            row["error"] = path
        else:
            fn = runtime.load_module(str(path), needs_cuda=True)[spec.func_name]
            for case, want in zip(cases, wants):
                call = (case.q, case.k_cache, case.v_cache, case.indptr, case.lengths,
                        case.table, case.out, case.lse, 1, scale, 0)
                case.out.fill_(float("nan"))
                fn(*call)
                torch.cuda.synchronize()
                err = (case.out.float() - want).abs().max().item()
                if not err < 2e-2:  # NaN fails too
                    row[case.name] = f"wrong ({err:.3g})"
                    continue
                sec, _ = timed(lambda: fn(*call), "cuda", 10, 2, "graph")
                row[case.name] = case.flops() / sec / 1e12
        rows.append(row)
        print(f"{knobs}: " + "  ".join(f"{row.get(c.name, '-'):.1f}"
                                       if isinstance(row.get(c.name), float)
                                       else str(row.get(c.name, row.get("error")))
                                       for c in cases), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
