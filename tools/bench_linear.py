"""Time SmolLM2's linear layers (30 layers x q, k, v, o, gate, up, down; float32, one torch
thread) for a number of rows: torch's ``F.linear`` (MKL ``sgemm``) against oneDNN with packed
weights (what ``kvtvm.engine.linear`` uses) and oneDNN with plain weights. Weights are 30
layers' worth (425 MB), so a decode-sized call streams them from memory as a real step does.

    .venv/bin/python tools/bench_linear.py [--rows 1,8,64,256,512,2048] [--repeat 2]

Prints per row count the best wall time of each way, CPU/wall (below 1: the process lost the
core to others) and GFLOP/s.
"""

import argparse
import os
import resource
import time

import torch

F = torch.nn.functional
SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def _cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,64,256,512,2048")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    ws = [[torch.randn(n, k, generator=gen) for n, k in SHAPES] for _ in range(30)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w) for w in layer] for layer in ws]
    flop_per_row = 2 * sum(n * k for n, k in SHAPES) * 30
    ways = {
        "torch F.linear (MKL)": lambda x, w, p: F.linear(x, w),
        "oneDNN packed": lambda x, w, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none",
                                                                            [], ""),
        "oneDNN plain": lambda x, w, p: torch.ops.mkldnn._linear_pointwise(x, w, None, "none",
                                                                           [], ""),
    }
    print(f"load average {os.getloadavg()}")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {576: torch.randn(m, 576, generator=gen), 1536: torch.randn(m, 1536, generator=gen)}
        best = {}
        for _ in range(args.repeat):
            for name, fn in ways.items():
                t0, c0 = time.perf_counter(), _cpu()
                for layer, players in zip(ws, packed):
                    for w, p in zip(layer, players):
                        fn(xs[w.shape[1]], w, p)
                t, c = time.perf_counter() - t0, _cpu() - c0
                if name not in best or t < best[name][0]:
                    best[name] = (t, c)
        cells = [f"{name} {1e3 * t:7.1f} ms (cpu/wall {c / t:.2f}, "
                 f"{flop_per_row * m / t / 1e9:4.0f} GFLOP/s)" for name, (t, c) in best.items()]
        print(f"rows {m:5d}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
