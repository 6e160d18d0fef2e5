"""Host cost of a step plan's rebind and of the ops' cache checks, one thread, 20000 calls
each (docs/PERF.md, sixteenth session):

    KVTVM_NUM_THREADS=1 python tools/rebind_cost_probe.py
"""

from __future__ import annotations

import time

import torch

from kvtvm import KVCacheParams
from kvtvm.manager import BatchItem, PagedKVCacheManager
from kvtvm.ops.checks import check_cache_owner, check_no_alias
from kvtvm.plan import plan_step

CALLS = 20000


def per_call_us(fn) -> float:
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    return (time.perf_counter() - t0) / CALLS * 1e6


def main() -> int:
    mgr = PagedKVCacheManager(KVCacheParams("float32", 2, 64, "paged", page_size=16), 4, 256,
                              32)
    seqs = mgr.claim(4)
    (inp,) = mgr.fetch([BatchItem(s, [1]) for s in seqs])
    plan = plan_step(inp)
    k, q = torch.randn(4, 2, 64), torch.randn(4, 8, 64)
    plan.append_kv(0, k, k)
    plan.attention(0, q)
    kc, vc = plan._caches[5]
    out, lse = torch.empty_like(q), torch.empty(4, 8)
    rows = {
        "append rebind": lambda: plan._append.rebind(k_cache=kc, v_cache=vc, k=k, v=k),
        "attention rebind": lambda: plan._attention.rebind(q=q, k_cache=kc, v_cache=vc,
                                                           out=out, lse=lse),
        "alias check (attention)": lambda: check_no_alias(
            {"out": out, "lse": lse}, {"q": q, "k_cache": kc, "v_cache": vc}),
        "ownership check (K/V pair)": lambda: check_cache_owner(
            inp.token, {"k_cache": kc, "v_cache": vc}),
    }
    for name, fn in rows.items():
        print(f"{name:28s} {per_call_us(fn):6.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
