"""``python -m kvtvm.bench manager``: host cost of the managers and paged memory efficiency.

1. **Host time per decode step** (``fetch`` + ``step`` of one token per sequence; no kernel
   runs) at several batch sizes, with every sequence at a ~4K-token context, page size 16:
   the paged manager with and without prefix caching, and the continuous-batching manager;
   the batch handed over as seed 002's list of ``BatchItem`` and as a ``TokenBatch`` of arrays.
   Median over ``--steps`` consecutive steps (so 1 in 16 steps of a sequence opens a page).
   Building the batch is the caller's and is not timed.
2. **Memory efficiency** under a synthetic workload with long-tailed (log-normal) prompt and
   output lengths, served with continuous batching through the real managers: the share of the
   KV bytes held by running sequences that hold live tokens, averaged over decode steps; paged
   (pages held) against continuous (one ``max_seq_len`` block per sequence).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from .. import cliargs
from ..inputs import BatchItem, TokenBatch
from ..params import KVCacheParams
from .common import log, progress


def _params(strategy, page_size, prefix=False):
    # a tiny head: the cache size does not change host cost, only memory use
    if strategy == "paged":
        return KVCacheParams("float16", 1, 8, "paged", page_size=page_size,
                             enable_prefix_caching=prefix)
    return KVCacheParams("float16", 1, 8, strategy)


def decode_step_us(kind: str, batch: int, context: int, page_size: int, steps: int,
                   seed: int = 0, form: str = "items") -> dict:
    """Median host microseconds of one decode step (fetch + step) for ``batch`` sequences
    whose context is about ``context`` tokens; ``form`` is ``"items"`` (a list of
    ``BatchItem``) or ``"arrays"`` (a ``TokenBatch``)."""
    from ..manager import ContinuousBatchingKVCacheManager, PagedKVCacheManager

    rng = np.random.default_rng(seed)
    max_len = context + steps + page_size
    if kind == "continuous":
        mgr = ContinuousBatchingKVCacheManager(_params("continuous", None), batch, max_len, 1)
    else:
        mgr = PagedKVCacheManager(_params("paged", page_size, kind == "paged+prefix"),
                                  batch, max_len, 1)
    ids = mgr.claim(batch)
    # prefill: contexts spread over a page so page crossings are spread over steps (over
    # fewer tokens for a context shorter than a page: every prompt has at least one token)
    lengths = context - rng.integers(0, min(page_size, context), batch)
    for s, n in zip(ids, lengths):
        prompt = rng.integers(0, 32000, int(n)).tolist()
        mgr.fetch([BatchItem(s, prompt)])
        mgr.step([BatchItem(s, prompt)])
    times, cpu = [], []
    for _ in range(steps):
        sampled = rng.integers(0, 32000, batch)
        if form == "arrays":
            batch_items = TokenBatch(ids, sampled)
        else:
            batch_items = [BatchItem(s, [int(t)]) for s, t in zip(ids, sampled)]
        c0, t0 = time.thread_time(), time.perf_counter()
        mgr.fetch(batch_items)
        mgr.step(batch_items)
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return {"median_us": 1e6 * statistics.median(times),
            "p90_us": 1e6 * float(np.percentile(times, 90)),
            "cpu_median_us": 1e6 * statistics.median(cpu)}


def memory_efficiency(num_requests: int, max_batch: int, max_seq_len: int, page_size: int,
                      seed: int = 0) -> dict:
    """Serve a long-tailed workload through both managers; time-averaged share of held KV
    bytes that hold live tokens."""
    from ..manager import ContinuousBatchingKVCacheManager, PagedKVCacheManager

    rng = np.random.default_rng(seed)
    half = max_seq_len // 2  # prompts up to half, outputs the rest (bounds never inverted:
    # at max_seq_len 2 they were [8, 1] and [1, 0], every output 0 tokens)
    prompts = np.clip(rng.lognormal(np.log(300), 1.0, num_requests), min(8, half), half)
    outputs = np.clip(rng.lognormal(np.log(150), 1.1, num_requests), 1,
                      max(1, max_seq_len - half - 1))
    prompts, outputs = prompts.astype(int), outputs.astype(int)
    result = {"prompt_len_mean": float(prompts.mean()), "prompt_len_p99": float(
        np.percentile(prompts, 99)), "output_len_mean": float(outputs.mean()),
        "output_len_p99": float(np.percentile(outputs, 99))}
    for kind in ("paged", "continuous"):
        if kind == "paged":
            mgr = PagedKVCacheManager(_params("paged", page_size), max_batch, max_seq_len, 1)
        else:
            mgr = ContinuousBatchingKVCacheManager(_params("continuous", None), max_batch,
                                                   max_seq_len, 1)
        queue = list(range(num_requests))
        running = {}  # seq -> [request, tokens left]
        shares, live_sum, held_sum = [], 0, 0
        while queue or running:
            while queue and mgr.slots_remaining:
                r = queue.pop(0)
                (s,) = mgr.claim(1)
                prompt = [1] * int(prompts[r])
                mgr.fetch([BatchItem(s, prompt)])
                mgr.step([BatchItem(s, prompt)])
                running[s] = [r, int(outputs[r])]
            items = [BatchItem(s, [1]) for s in running]
            mgr.fetch(items)
            mgr.step(items)
            live = sum(mgr.cache_length(s) for s in running)
            if kind == "paged":
                held = mgr.stats().pages_used * page_size
            else:
                held = len(running) * max_seq_len
            shares.append(live / held)
            live_sum += live
            held_sum += held
            for s in list(running):
                running[s][1] -= 1
                if running[s][1] <= 0:
                    mgr.release(s)
                    del running[s]
        result[kind] = {"mean_share": float(np.mean(shares)),
                        "token_weighted_share": live_sum / held_sum,
                        "min_share": float(np.min(shares)), "decode_steps": len(shares)}
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtvm.bench manager",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default=[1, 64, 256], type=cliargs.int_list,
                        help="decode batch sizes, comma-separated (default 1,64,256)")
    parser.add_argument("--context", type=cliargs.positive_int, default=4096,
                        help="context per sequence")
    parser.add_argument("--page-size", type=cliargs.positive_int, default=16)
    parser.add_argument("--steps", type=cliargs.positive_int, default=200,
                        help="timed decode steps per case")
    parser.add_argument("--requests", type=cliargs.positive_int, default=2000,
                        help="requests of the memory-efficiency workload")
    parser.add_argument("--max-batch", type=cliargs.positive_int, default=64,
                        help="running sequences of the memory-efficiency workload")
    parser.add_argument("--max-seq-len", type=cliargs.int_at_least(2), default=4096,
                        help="max_seq_len of the memory-efficiency workload (>= 2: a prompt "
                        "token and a generated one)")
    parser.add_argument("--json", type=cliargs.output_file, metavar="PATH",
                        help="also write the results as JSON")
    args = parser.parse_args(argv)

    kinds = ("paged", "paged+prefix", "continuous")
    batches = args.batches
    timing = {}
    print(f"host time per decode step (fetch + step), context ~{args.context}, page size "
          f"{args.page_size}, median of {args.steps} steps, microseconds: wall (thread CPU)")
    for form, title in (("items", "batch as a list of BatchItem (seed 002)"),
                        ("arrays", "batch as a TokenBatch (numpy arrays)")):
        print(f"{title}\n{'batch':>6}" + "".join(f"{k:>20}" for k in kinds))
        timing[form] = {}
        for b in progress(batches, desc=f"decode steps ({form})"):
            log.info("manager: decode steps at batch %d, %s", b, form)
            row = {k: decode_step_us(k, b, args.context, args.page_size, args.steps,
                                     form=form) for k in kinds}
            timing[form][b] = row
            print(f"{b:>6}" + "".join(
                f"{row[k]['median_us']:>12.1f} ({row[k]['cpu_median_us']:5.1f})"
                for k in kinds))
    log.info("manager: serving %d requests through both managers", args.requests)
    mem = memory_efficiency(args.requests, args.max_batch, args.max_seq_len, args.page_size)
    print(f"\nmemory efficiency: {args.requests} requests, prompt lengths log-normal (mean "
          f"{mem['prompt_len_mean']:.0f}, p99 {mem['prompt_len_p99']:.0f}), output lengths "
          f"log-normal (mean {mem['output_len_mean']:.0f}, p99 {mem['output_len_p99']:.0f}), "
          f"up to {min(args.max_batch, args.requests)} running, max_seq_len "
          f"{args.max_seq_len}, page size "
          f"{args.page_size}")
    print("share of the KV bytes held by running sequences that hold live tokens")
    for kind in ("paged", "continuous"):
        m = mem[kind]
        print(f"  {kind:<11} mean over steps {100 * m['mean_share']:6.2f}%   token-weighted "
              f"{100 * m['token_weighted_share']:6.2f}%   worst step {100 * m['min_share']:6.2f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"decode_step_us": timing, "memory_efficiency": mem,
                       "args": vars(args)}, f, indent=1)
    return 0
