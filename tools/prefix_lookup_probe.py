"""Cost of a peer's prefix lookup (``held_prefix_pages``) on a big prefix cache while pages
keep being cached between lookups, as in a server: fills ``--pages`` cached pages, then caches
one new page before each timed lookup of a 64-page chain. Median ms.

``python tools/prefix_lookup_probe.py [--pages 32768 --page-size 16 --repeat 10]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvtvm.inputs import BatchItem
from kvtvm.manager import PagedKVCacheManager
from kvtvm.manager.hashing import block_hashes
from kvtvm.params import KVCacheParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pages", type=int, default=32768)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    P, T = args.page_size, 64 * args.page_size
    params = KVCacheParams("float16", 1, 8, "paged", page_size=P, enable_prefix_caching=True)
    mgr = PagedKVCacheManager(params, 4, T + P, 1, devices=("cpu",),
                              num_pages=args.pages + 64)

    def cache(tokens):
        (s,) = mgr.claim(1)
        mgr.fetch([BatchItem(s, tokens)])
        mgr.step([BatchItem(s, tokens)])
        mgr.release(s)

    for r in range(-(-args.pages // 64)):
        cache([r * T + i for i in range(T)])
    probe = block_hashes(list(range(T)), P, mgr.hash_bits, mgr._root_chain()[0])
    times = []
    for r in range(args.repeat):
        cache([10**9 + r * 2 * P + i for i in range(P + 1)])  # one new cached page
        t0 = time.perf_counter()
        held = mgr.held_prefix_pages(probe)
        times.append(time.perf_counter() - t0)
    print(f"{mgr.stats().pages_cached} cached pages: a lookup of {len(probe)} hashes (held "
          f"{held}) after one new cached page: {1e3 * statistics.median(times):.3f} ms median")


if __name__ == "__main__":
    main()
