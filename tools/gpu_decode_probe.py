"""Decode attention on a GPU, every prebuilt candidate (``python -m kvtvm.tune --op decode
--build-only build/tune --arch sm_90a``) at the benchmark's shapes, then the best candidates
over a range of KV split counts: the data for the tuning log and for the split heuristic of
``kvtvm.ops.decode.choose_num_splits``.

Run on the GPU machine after ``source tools/gpu-env.sh``:
``python3 tools/gpu_decode_probe.py build/tune --json $OUT/decode-probe.json``.
Kernel time = CUDA-graph replays with the L2 cache flushed before each (kvtvm.bench.common).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from kvtvm import compiler, runtime
from kvtvm.ops.decode import choose_num_splits, split_workspace
from kvtvm.bench.common import timed
from kvtvm.bench.decode import make_case, torch_dense
from kvtvm.tune import manifest_specs, prebuilt_candidates

SHAPES = [(64, 4096), (1, 32768), (16, 4096), (128, 2048), (256, 1024), (1, 4096)]
SPLITS = {1: [8, 16, 24, 32, 48, 64, 96, 128], 16: [1, 2, 4, 6, 8, 12, 16],
          64: [1, 2, 3, 4, 8], 128: [1, 2, 4], 256: [1, 2]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--top", type=int, default=6)
    args = parser.parse_args()
    dev = torch.device("cuda")
    spec, = manifest_specs(args.root, "decode")
    H, G, D = spec.n_kv_heads, spec.group_size, spec.head_dim
    scale = 1.0 / math.sqrt(D)
    cases = {}
    for batch, ctx in SHAPES:
        case = make_case(batch, ctx, H, G, D, 16, spec.dtype, "cuda")
        case["want"] = torch_dense(case, scale)().squeeze(2).float()
        case["bytes"] = 2 * case["k_dense"].numel() * case["k_dense"].element_size()
        del case["k_dense"], case["v_dense"]
        cases[(batch, ctx)] = case

    def run(fn, batch, ctx, splits):
        case = cases[(batch, ctx)]
        o_part, lse_part = split_workspace(dev, splits, batch, H * G, D)
        out = torch.full_like(case["q"], float("nan"))
        lse = torch.empty(case["q"].shape[:2], dtype=torch.float32, device=dev)
        call_args = (case["q"], case["k_cache"], case["v_cache"], case["lengths"],
                     case["table"], out, lse, o_part, lse_part, scale, 0)
        fn(*call_args)
        torch.cuda.synchronize()
        err = (out.float() - case["want"]).abs().max().item()
        if not err < 2e-2:  # NaN fails too
            return None, f"wrong: max error {err}"
        sec, how = timed(lambda: fn(*call_args), "cuda", 20, 3, "graph")
        return sec, how

    results = {"device": torch.cuda.get_device_name(), "phase1": [], "phase2": []}
    fns = []
    for knobs, path in prebuilt_candidates(spec, args.root):
        if isinstance(path, str):
            continue
        module = runtime.load_module(str(path), needs_cuda=True)
        fns.append((knobs, module[spec.func_name]))
    print(f"{len(fns)} candidates of {spec.uri}")
    head = [(64, 4096), (1, 32768), (128, 2048)]
    for knobs, fn in fns:
        row = {"knobs": knobs}
        for batch, ctx in head:
            splits = choose_num_splits(batch, H, ctx, dev)
            sec, how = run(fn, batch, ctx, splits)
            row[f"{batch}x{ctx}"] = (None if sec is None
                                     else cases[(batch, ctx)]["bytes"] / sec / 1e12)
            row["timing"] = how
        results["phase1"].append(row)
        print("  " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in row.items()), flush=True)
    ok = [r for r in results["phase1"] if all(r[f"{b}x{c}"] for b, c in head)]
    ok.sort(key=lambda r: -sum(math.log(r[f"{b}x{c}"]) for b, c in head))
    best = [r["knobs"] for r in ok[:args.top]]
    default = fns[0][0]
    if default not in best:
        best.append(default)
    fn_of = {json.dumps(k, sort_keys=True): f for k, f in fns}
    print("\nTB/s by KV splits (heuristic's choice marked *)")
    for knobs in best:
        fn = fn_of[json.dumps(knobs, sort_keys=True)]
        print(f"knobs {knobs}{' (default)' if knobs == default else ''}")
        for batch, ctx in SHAPES:
            pick = choose_num_splits(batch, H, ctx, dev)
            line = []
            for splits in sorted(set(SPLITS.get(batch, [1, 2]) + [pick])):
                sec, how = run(fn, batch, ctx, splits)
                tbs = None if sec is None else cases[(batch, ctx)]["bytes"] / sec / 1e12
                results["phase2"].append({"knobs": knobs, "batch": batch, "ctx": ctx,
                                          "splits": splits, "tbs": tbs, "timing": how})
                mark = "*" if splits == pick else ""
                line.append(f"{splits}{mark}:{'-' if tbs is None else f'{tbs:.2f}'}")
            print(f"  {batch:>4}x{ctx:<6} " + " ".join(line), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
