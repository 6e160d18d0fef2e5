"""Per-kernel GPU time of one decode or prefill call (torch.profiler), to see where a call's time
goes (e.g. split-KV decode: the split kernel against the merge kernel and the gap between them).

Run on the GPU machine after ``source tools/gpu-env.sh``:
``python3 tools/gpu_kernel_times.py decode 1 32768`` or ``... prefill 1 8192``.
"""

from __future__ import annotations

import argparse
import math

import torch

from kvtvm import ops
from kvtvm.bench.decode import make_case


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("op", choices=["decode", "prefill"])
    parser.add_argument("batch", type=int)
    parser.add_argument("tokens", type=int)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    scale = 1.0 / math.sqrt(128)
    if args.op == "decode":
        case = make_case(args.batch, args.tokens, 8, 4, 128, 16, "float16", "cuda")
        out = torch.empty_like(case["q"])
        lse = torch.empty(case["q"].shape[:2], dtype=torch.float32, device="cuda")

        def call():
            ops.decode_attention(case["q"], case["k_cache"], case["v_cache"], case["lengths"],
                                 case["table"], sm_scale=scale, out=out, lse=lse,
                                 check_indices=False)
    else:
        from kvtvm.bench.prefill import Case
        case = Case(args.batch, args.tokens, 0, "float16", "cuda")

        def call():
            ops.prefill_attention(case.q, case.k_cache, case.v_cache, case.indptr, case.lengths,
                                  case.table, causal=True, sm_scale=scale, out=case.out,
                                  lse=case.lse, check_indices=False)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    events.sort(key=lambda e: e.time_range.start)
    per = {}
    for e in events:
        per.setdefault(e.name, []).append(e.time_range.elapsed_us())
    for name, times in per.items():
        times.sort()
        print(f"{name[:60]:60s} n={len(times)} median {times[len(times) // 2]:.1f} us")
    # the gap between consecutive kernels of one call
    names = list(per)
    if len(names) == 2:
        gaps = [b.time_range.start - a.time_range.end for a, b in zip(events, events[1:])
                if a.name == names[0] and b.name == names[1]]
        gaps.sort()
        print(f"gap {names[0][:20]} -> {names[1][:20]}: median {gaps[len(gaps) // 2]:.1f} us")


if __name__ == "__main__":
    main()
