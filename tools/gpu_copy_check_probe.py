"""What the CUDA copy kernel's in-kernel bounds check costs (issue 14: under 2%), per
``vectors_per_thread``: the shipped kernel against the same kernel built with the check taken
out (``_in_rows`` always true -- a probe-only build, never shipped or loadable through
kvtvm's kernel lookup).

Here (compiler + nvcc): ``python tools/gpu_copy_check_probe.py build build/probe``
On the GPU machine, after ``source tools/gpu-env.sh``:
``python3 tools/gpu_copy_check_probe.py run build/probe``

Each case is timed as a CUDA graph of 50 launches (no host overhead), variants interleaved,
median of 9 rounds; float16 pages of 16 tokens x 8 heads x 128, 4 layers (the copy benchmark's).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

VPTS = (1, 2)
CASES = [("cow 4 of 8192", 8192, 4), ("cow 64 of 8192", 8192, 64),
         ("move 1024 of 8192", 8192, 1024)]


def _spec(vpt):
    from kvtvm import compiler

    return compiler.KernelSpec("copy", "float16", 128, 1, 1, layout="nhd", target="cuda",
                               arch="sm_90a", knobs={"vectors_per_thread": vpt})


def build(out: Path) -> None:
    from kvtvm import compiler
    from kvtvm.kernels._tvm import tir
    from schedules.copy import cuda

    paths = {}
    for vpt in VPTS:
        paths[f"check-vpt{vpt}"] = str(compiler.build_spec(_spec(vpt), out / "check")
                                       .relative_to(out))
    cuda._in_rows = lambda s, d, rows: tir.const(True, "bool")  # the probe's unchecked build
    for vpt in VPTS:
        paths[f"nocheck-vpt{vpt}"] = str(compiler.build_spec(_spec(vpt), out / "nocheck")
                                         .relative_to(out))
    (out / "variants.json").write_text(json.dumps(paths, indent=1))
    print(json.dumps(paths, indent=1))


def run(out: Path) -> None:
    import torch

    from kvtvm import runtime
    from kvtvm.bench.copy import make_case
    from kvtvm.ops.launch import Launch

    paths = json.loads((out / "variants.json").read_text())
    fns = {}
    for name, path in paths.items():
        mod = runtime.load_module(str(out / path), needs_cuda=True)
        fns[name] = (mod, mod[_spec(1).func_name])
    print(f"{'case':20s}" + "".join(f"{n:>16s}" for n in fns) + "   check cost per vpt")
    for label, pages, n in CASES:
        blocks, src, dst = make_case(pages, n, 8, 128, "float16", "cuda")
        view = blocks.view(1, pages, -1, 128)
        src, dst = src.cuda(), dst.cuda()
        want = blocks.clone()
        want[dst.long()] = blocks[src.long()]
        graphs = {}
        for name, (_, fn) in fns.items():
            launch = Launch(fn, view.device, dict(blocks=view, src=src, dst=dst))
            launch.run()
            torch.cuda.synchronize()
            assert torch.equal(blocks, want), f"{name}: wrong pages"
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(50):
                    launch.run()
            graphs[name] = g
        times = {name: [] for name in graphs}
        for _ in range(9):
            for name, g in graphs.items():
                start, stop = torch.cuda.Event(True), torch.cuda.Event(True)
                g.replay()
                start.record()
                g.replay()
                stop.record()
                stop.synchronize()
                times[name].append(start.elapsed_time(stop) * 1000 / 50)  # us per launch
        med = {name: statistics.median(v) for name, v in times.items()}
        cost = "  ".join(f"vpt{v} {100 * (med[f'check-vpt{v}'] / med[f'nocheck-vpt{v}'] - 1):+.1f}%"
                         for v in VPTS)
        print(f"{label:20s}" + "".join(f"{med[n]:13.2f} us" for n in graphs) + "   " + cost)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["build", "run"])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    (build if args.mode == "build" else run)(args.out)


if __name__ == "__main__":
    main()
