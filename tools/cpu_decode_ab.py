"""A/B of CPU decode kernels in one process: each variant's kernel called directly over its own
copy of the same K/V (full precision or quantized), the variants interleaved round by round,
best of ``--rounds`` x 3 calls. ``--cpu-time`` times with ``time.process_time`` (CPU time of
all threads: steadier than wall time on a shared machine; run it with KVTVM_NUM_THREADS=1).

    KVTVM_NUM_THREADS=1 python tools/cpu_decode_ab.py --cpu-time \\
        f32:float32: i8:float32:int8 i8_noprefetch:float32:int8:prefetch=0

A variant is ``name:dtype:storage[:knob=value...]`` (storage "" = full precision; K and V
stored alike, or ``K/V`` for two, e.g. ``int8/`` for K-only); knob values are ints (0/1 for
booleans).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from kvtvm import compiler, runtime
from kvtvm.quant import quantize_rows


def _side(sides: dict, x, i: int, storage: str, dtype: str):
    """Side ``i`` (K 0, V 1) of ``x`` stored as ``storage`` (or ``dtype``), made once."""
    key = (i, storage or dtype)
    if key not in sides:
        sides[key] = (torch.from_numpy(quantize_rows(x[i], storage).view(np.int8)) if storage
                      else torch.from_numpy(x[i]).to(getattr(torch, dtype)))
    return sides[key]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--cpu-time", action="store_true")
    args = parser.parse_args(argv)
    B, H, G, D, PS = args.batch, args.heads, args.group, args.head_dim, args.page_size
    clock = time.process_time if args.cpu_time else time.perf_counter
    rng = np.random.default_rng(0)
    pages = B * (-(-args.ctx // PS))
    table = torch.from_numpy(rng.permutation(pages).reshape(B, -1).astype(np.int32))
    lengths = torch.full((B,), args.ctx - 1, dtype=torch.int32)
    x = rng.standard_normal((2, pages, PS, H, D)).astype(np.float32)
    q32 = torch.from_numpy(rng.standard_normal((B, H * G, D)).astype(np.float32))
    runs, sides = {}, {}
    for text in args.variants:
        name, dtype, storage, *knobs = text.split(":")
        knobs = {k: int(v) for k, v in (kv.split("=") for kv in knobs)}
        k_storage, _, v_storage = storage.partition("/") if "/" in storage else (storage,) * 3
        spec = compiler.KernelSpec("decode", dtype, D, H, G, "nhd", knobs=knobs,
                                   k_storage=k_storage, v_storage=v_storage)
        # variants of the same storage share one copy: identical kernels over two copies
        # measured up to 20% apart (where the buffers landed), more than most knobs move
        k, v = (_side(sides, x, i, st, dtype) for i, st in ((0, k_storage), (1, v_storage)))
        q = q32.to(getattr(torch, dtype))
        bufs = (torch.empty_like(q), torch.empty(q.shape[:2]), torch.zeros((1,) + q.shape),
                torch.zeros((1,) + q.shape[:2]))
        runs[name] = (compiler.get_kernel(spec), q, k, v, bufs)
    runtime.configure_cpu_threads()  # KVTVM_NUM_THREADS, else the cores (TVM loaded now)
    best = {name: math.inf for name in runs}
    for _ in range(args.rounds):
        for name, (fn, q, k, v, (out, lse, o_part, lse_part)) in runs.items():
            for _ in range(3):
                err = torch.zeros(4, dtype=torch.int32)
                t0 = clock()
                fn(q, k, v, lengths, table, out, lse, o_part, lse_part, 1 / math.sqrt(D), 0, err)
                best[name] = min(best[name], clock() - t0)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"decode {B} x {args.ctx}, {H} kv heads x {G} x {D}, page {PS}; best of "
          f"{args.rounds} x 3 {'CPU' if args.cpu_time else 'wall'} ms; load average {load}")
    for name, t in best.items():
        print(f"  {name:24s} {t * 1e3:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
