"""Profile one prefill step of kvtvm's engine (SmolLM2, one prompt chunk) with torch.profiler,
and time the step for each torch / kernel thread count, interleaved.

    .venv/bin/python tools/profile_engine_step.py [--tokens 1024] [--rounds 5]

Prints the profiler table (kvtvm's append and attention calls as their own rows, torch's
``aten::mm`` for the linear layers) and, per thread setting, the median and every time.
"""

import argparse
import os
import statistics
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import kvtvm.plan as plan
from kvtvm.engine import Engine, Request, load_model


def engine(model, prompt, tokens, torch_threads, kernel_threads):
    e = Engine(model, "paged", max_batch_size=1, max_seq_len=len(prompt) + 8, page_size=16,
               prefix_caching=False, eos_token_ids=(), max_step_tokens=tokens,
               torch_threads=torch_threads, kernel_threads=kernel_threads)
    e.log = lambda s: None
    e.submit(Request(0, prompt, 1))
    return e


def labelled(fn, name):
    def wrapper(self, *a, **k):
        with torch.profiler.record_function(name):
            return fn(self, *a, **k)
    return wrapper


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    model, _ = load_model("smollm2")
    prompt = np.random.default_rng(0).integers(100, 40000, args.tokens).tolist()
    engine(model, prompt[:64], 64, 1, 1).step()                     # kernels loaded
    times = {}
    for _ in range(args.rounds):
        for setting in ((1, 1), (2, 1), (2, 2), (1, 2)):
            e = engine(model, prompt, args.tokens, *setting)
            t0 = time.perf_counter()
            e.step()
            times.setdefault(setting, []).append(time.perf_counter() - t0)
    print(f"load average {os.getloadavg()}")
    for (tt, kt), ts in times.items():
        print(f"torch threads {tt}, kernel threads {kt}: median {1e3 * statistics.median(ts):.0f}"
              f" ms, all {[round(1e3 * t) for t in ts]}")
    orig = plan.StepPlan.append_kv, plan.StepPlan.attention
    plan.StepPlan.append_kv = labelled(orig[0], "kvtvm append_kv")
    plan.StepPlan.attention = labelled(orig[1], "kvtvm attention")
    try:
        e = engine(model, prompt, args.tokens, 1, 1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with torch.profiler.record_function(f"engine step ({args.tokens} tokens)"):
                e.step()
    finally:
        plan.StepPlan.append_kv, plan.StepPlan.attention = orig
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=16,
                                    max_name_column_width=40))


if __name__ == "__main__":
    main()
