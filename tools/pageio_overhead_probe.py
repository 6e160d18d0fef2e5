"""Host cost of one page export and import in one process, without a transport: export
(header, lease), checksums + header encode, header decode, import (checks, checksums, write,
register),
median ms over repeats. Small pages make the per-page Python cost show (the defaults: 8K
tokens in 512 pages of 8 KiB).

``python tools/pageio_overhead_probe.py [--tokens 8192 --page-size 16 --layers 1 --heads 2
--head-dim 64 --repeat 20]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvtvm.inputs import BatchItem
from kvtvm.manager import PagedKVCacheManager
from kvtvm.manager.pageio import PageHeader
from kvtvm.params import KVCacheParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    T, P = args.tokens, args.page_size

    def manager():
        params = KVCacheParams(args.dtype, args.heads, args.head_dim, "paged", page_size=P,
                               enable_prefix_caching=True)
        return PagedKVCacheManager(params, 2, T + P, args.layers, devices=("cpu",),
                                   num_pages=2 * (-(-T // P)) + 4)

    src, dst = manager(), manager()
    times = {"export": [], "sums+encode": [], "decode": [], "import": []}
    for rep in range(args.repeat + 2):
        tokens = [rep * T + i for i in range(T)]  # fresh hashes: nothing is held already
        (s,) = src.claim(1)
        src.fetch([BatchItem(s, tokens)])
        src.blocks[0].normal_()
        src.step([BatchItem(s, tokens)])
        t0 = time.perf_counter()
        export = src.export_pages(s, defer_checksums=True)
        t1 = time.perf_counter()
        raw = export.header.to_bytes()  # the checksums are computed here (deferred)
        t2 = time.perf_counter()
        header = PageHeader.from_bytes(raw)
        t3 = time.perf_counter()
        dst.import_pages(header, export.data)
        t4 = time.perf_counter()
        src.end_lease(export.lease_id)
        src.release(s)
        if rep >= 2:
            for key, a, b in (("export", t0, t1), ("sums+encode", t1, t2), ("decode", t2, t3),
                              ("import", t3, t4)):
                times[key].append(1e3 * (b - a))
    pages = -(-T // P)
    print(f"{T} tokens, {pages} pages of {src.params.bytes_per_page(args.layers)} bytes "
          f"({args.layers} layers, {args.heads} x {args.head_dim} {args.dtype}), "
          f"median of {args.repeat}:")
    for key, xs in times.items():
        print(f"  {key:<11} {statistics.median(xs):7.3f} ms")


if __name__ == "__main__":
    main()
