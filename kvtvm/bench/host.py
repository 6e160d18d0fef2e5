"""``python -m kvtvm.bench host``: host time of one model step's KV-cache calls, ops vs plan.

A decode step of a ``--layers``-layer model calls ``append_kv`` and ``decode_attention`` once
per layer. Timed here, side by side on the same manager: the plain ops (every argument checked
on every call) and a :class:`kvtvm.plan.StepPlan` (checked on the first layer, replayed on the
others). The default shape is small (batch 4, 64 cached tokens, 2 KV heads of 64) so that host
time, not the kernels, is what differs; ``--device cuda`` measures the same on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from .. import cliargs
from .common import log


def step_ms(planned: bool, layers: int, batch: int, context: int, n_kv_heads: int,
            group_size: int, head_dim: int, device: str, steps: int) -> float:
    """Median milliseconds of one decode step (fetch .. step) with ``layers`` appends and
    attentions."""
    import torch

    from .. import ops
    from ..plan import plan_step
    from ..inputs import BatchItem, TokenBatch
    from ..manager import PagedKVCacheManager
    from ..params import KVCacheParams
    from .common import synchronize

    params = KVCacheParams("float32", n_kv_heads, head_dim, "paged", page_size=16)
    mgr = PagedKVCacheManager(params, batch, context + 16, layers, devices=(device,))
    ids = mgr.claim(batch)
    prompts = [BatchItem(s, list(range(context))) for s in ids]
    mgr.fetch(prompts)
    mgr.step(prompts)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, n_kv_heads * group_size, head_dim, generator=gen).to(device)
    k = torch.randn(batch, n_kv_heads, head_dim, generator=gen).to(device)
    times = []
    for _ in range(steps):
        tb = TokenBatch(ids, [1] * batch)
        synchronize(device)
        t0 = time.perf_counter()
        (inp,) = mgr.fetch(tb)
        if planned:
            step_plan = plan_step(inp)
            for layer in range(layers):
                step_plan.append_kv(layer, k, k)
                step_plan.attention(layer, q)
        else:
            for layer in range(layers):
                kc, vc = inp.k_cache(layer), inp.v_cache(layer)
                ops.append_kv(kc, vc, k, k, inp.qo_indptr, inp.cache_lengths, inp.lookup_table)
                ops.decode_attention(q, kc, vc, inp.cache_lengths, inp.lookup_table)
        mgr.step(tb)
        synchronize(device)
        times.append(time.perf_counter() - t0)
        for s in ids:  # back to the same context: every step does the same work
            mgr.pop(s, 1)
    return 1e3 * statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtvm.bench host",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", type=cliargs.device)
    parser.add_argument("--layers", type=cliargs.positive_int, default=32)
    parser.add_argument("--batch", type=cliargs.positive_int, default=4)
    parser.add_argument("--context", type=cliargs.positive_int, default=64)
    parser.add_argument("--n-kv-heads", type=cliargs.positive_int, default=2)
    parser.add_argument("--group-size", type=cliargs.positive_int, default=4)
    parser.add_argument("--head-dim", type=cliargs.positive_int, default=64)
    parser.add_argument("--steps", type=cliargs.positive_int, default=30)
    parser.add_argument("--json", type=cliargs.output_file, metavar="PATH",
                        help="also write the results as JSON")
    args = parser.parse_args(argv)
    shape = (args.layers, args.batch, args.context, args.n_kv_heads, args.group_size,
             args.head_dim, args.device, args.steps)
    log.info("host: loading and warming the kernels")
    step_ms(True, *shape[:-1], 3)  # load and warm every kernel
    log.info("host: %d steps through the ops, then through plan_step", args.steps)
    ops_ms, plan_ms = step_ms(False, *shape), step_ms(True, *shape)
    per_call = 1e3 * (ops_ms - plan_ms) / (2 * args.layers)
    print(f"decode step of {args.layers} layers (append + attention each), batch {args.batch}, "
          f"context {args.context}, {args.n_kv_heads} kv heads x {args.head_dim}, group "
          f"{args.group_size}, float32, {args.device}, median of {args.steps} steps")
    print(f"  ops (checked every call)   {ops_ms:8.3f} ms")
    print(f"  plan_step (checked once)   {plan_ms:8.3f} ms   ops / plan {ops_ms / plan_ms:.2f}x, "
          f"{per_call:.1f} µs less host time per call")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ops_ms": ops_ms, "plan_ms": plan_ms, "per_call_saved_us": per_call,
                       "args": vars(args)}, f, indent=1)
    return 0
