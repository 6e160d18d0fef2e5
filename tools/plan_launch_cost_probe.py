"""Host cost of a step plan's launches, one thread: rebinding the prepared append and
attention launches to each of 32 layers' cache views, running them, and the decode kernel
called bare (docs/PERF.md, eighteenth session). Compare two trees by running it under each
(``PYTHONPATH=<worktree>``; link the worktree's ``schedules/`` into its ``kvtvm/``):

    KVTVM_NUM_THREADS=1 python tools/plan_launch_cost_probe.py
"""

from __future__ import annotations

import statistics
import time

import torch

from kvtvm import KVCacheParams, runtime
from kvtvm.manager import BatchItem, PagedKVCacheManager
from kvtvm.plan import plan_step

LAYERS = 32


def main() -> int:
    params = KVCacheParams("float32", 2, 64, "paged", page_size=16)
    mgr = PagedKVCacheManager(params, 4, 80, LAYERS)
    ids = mgr.claim(4)
    prompts = [BatchItem(s, list(range(64))) for s in ids]
    mgr.fetch(prompts)
    mgr.step(prompts)
    (inp,) = mgr.fetch([BatchItem(s, [1]) for s in ids])
    plan = plan_step(inp)
    q, k = torch.randn(4, 8, 64), torch.randn(4, 2, 64)
    plan.append_kv(0, k, k)
    plan.attention(0, q)
    append, attend = plan._append, plan._attention
    views = [(inp.k_cache(layer), inp.v_cache(layer)) for layer in range(LAYERS)]
    out, lse = torch.empty(4, 8, 64), torch.empty(4, 8)

    def rebinds() -> float:
        t0 = time.perf_counter()
        for kc, vc in views:
            append.rebind(k_cache=kc, v_cache=vc, k=k, v=k)
            attend.rebind(q=q, k_cache=kc, v_cache=vc, out=torch.empty_like(out),
                          lse=torch.empty_like(lse))
        return (time.perf_counter() - t0) / (2 * LAYERS) * 1e6

    def per_call(fn, calls=3000) -> float:
        for _ in range(200):
            fn()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls * 1e6

    for _ in range(50):
        rebinds()
    print(f"rebind               {statistics.median(rebinds() for _ in range(300)):7.2f} us")
    print(f"append launch        {per_call(append.run):7.2f} us")
    layer3 = attend.rebind(q=q, k_cache=views[3][0], v_cache=views[3][1], out=out, lse=lse)
    print(f"attention launch     {per_call(layer3.run):7.2f} us")
    args = tuple(layer3.slots.values())
    print(f"decode kernel, bare  "
          f"{per_call(lambda: runtime.call_cpu_kernel(layer3.fn, args, layer3.parallel)):7.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
