"""``python -m kvtvm.bench transfer``: KV transfer between two processes, and the host tier.

1. *Transfer*: two processes (``torch.multiprocessing``, ``torch.distributed`` over loopback:
   gloo on CPU, ``--backend nccl --device cuda`` on a GPU). Side by side, on the same bytes:
   kvtvm's export + send + import of one sequence's pages (the header, the checksums on both
   sides, the page runs received straight into the receiver's pages, the acknowledgement;
   also with the lookup by hashes first, as :func:`kvtvm.transfer.send_sequence` does)
   against a plain ``torch.distributed`` send of one contiguous tensor of the same size into a
   preallocated buffer, acknowledged the same way. Reported: GB/s of each and kvtvm / plain (target: at least 0.8).
2. *Host tier*: demotion (what an eviction runs: the evicted cached pages copied to the host
   pool together) and promotion (what a prefix hit on the host tier runs: content checks,
   one copy back, one scatter, register) of a whole sequence's pages, against a plain
   ``copy_`` of the same bytes each way.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

from .. import cliargs
from ..errors import KVCacheError
from .common import log

__all__ = ["main"]


def _params(args):
    from ..params import KVCacheParams

    return KVCacheParams(args.dtype, args.n_kv_heads, args.head_dim, "paged",
                         page_size=args.page_size, enable_prefix_caching=True,
                         **args.cache_storage)


def _manager(args, device):
    from ..manager import PagedKVCacheManager

    pages = 2 * (-(-args.tokens // args.page_size)) + 4
    return PagedKVCacheManager(_params(args), 2, args.tokens + args.page_size, args.layers,
                               devices=(device,), num_pages=pages)


def _prefill(mgr, tokens):
    """A sequence holding ``tokens`` (its pages filled with random K/V)."""
    import torch

    from ..inputs import BatchItem

    (s,) = mgr.claim(1)
    mgr.fetch([BatchItem(s, tokens)])
    for p in mgr.pages_of(s):
        mgr.blocks[0][p].copy_(torch.randn(mgr.blocks[0][p].shape))
    mgr.step([BatchItem(s, tokens)])
    return s


def _worker(rank, args, port, out):
    import torch
    import torch.distributed as dist

    from ..transfer import DistributedTransport

    torch.set_num_threads(max(1, args.threads))
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        device = args.device
        if device.startswith("cuda"):  # one GPU per rank when there are two (NCCL refuses
            # two ranks on one device); on a single GPU both share it (gloo only)
            device = f"cuda:{rank % torch.cuda.device_count()}"
            torch.cuda.set_device(device)
        mgr = _manager(args, device)
        tr = DistributedTransport(timeout=300.0)
        tr.register(mgr)
        nbytes = -(-args.tokens // args.page_size) * mgr.params.bytes_per_page(args.layers)
        buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).to(tr.device)
        ack = torch.zeros(1, dtype=torch.int64, device=tr.device)
        plain, kvtvm, data_only = [], [], []
        cpu = {"plain": [], "kvtvm": []}  # this process's CPU seconds (all its threads)
        for rep in range(args.warmup + args.repeat):
            tokens = [rep * args.tokens + i for i in range(args.tokens)]  # fresh hashes
            # -- plain: one contiguous tensor of the same bytes, acknowledged -------------
            dist.barrier()
            c0 = time.process_time()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(ack, 1)
            else:
                dist.recv(buf, 0)
                dist.send(ack, 0)
            plain.append(time.perf_counter() - t0)
            cpu["plain"].append(time.process_time() - c0)
            # -- kvtvm: export + lookup + send + import + ack ----------------------------
            s = _prefill(mgr, tokens) if rank == 0 else None
            dist.barrier()
            c0 = time.process_time()
            t0 = time.perf_counter()
            if rank == 0:  # what send_sequence does, timed in two parts
                have = tr.lookup(1, mgr.block_hashes_of(s))
                t1 = time.perf_counter()
                export = mgr.export_pages(s, first_page=have, defer_checksums=True)
                tr.send(1, export).wait(300.0)
                data_only.append(time.perf_counter() - t1)
            else:
                seqs = []
                while True:
                    msg = tr.handle(0, lambda h, tag: seqs.append(mgr.claim(1)[0]) or seqs[-1])
                    if msg.kind == "pages":
                        break
                if msg.error is not None:
                    raise msg.error
            kvtvm.append(time.perf_counter() - t0)
            cpu["kvtvm"].append(time.process_time() - c0)
            if rank == 0:
                mgr.release(s)
            else:
                mgr.release(seqs[-1])
            mgr.expire_leases(now=float("inf"))
        k = args.warmup
        cpu_med = {name: statistics.median(xs[k:]) for name, xs in cpu.items()}
        out.put((rank, cpu_med))
        if rank == 0:
            res = {"nbytes": nbytes}
            for name, xs in (("plain", plain), ("kvtvm", data_only), ("kvtvm_lookup", kvtvm)):
                res[f"{name}_s"] = statistics.median(xs[k:])
                res[f"{name}_best_s"] = min(xs[k:])
            out.put(res)
    finally:
        dist.destroy_process_group()


def transfer(args) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, args.threads)))
    mp.start_processes(_worker, args=(args, port, out), nprocs=2, start_method="spawn",
                       join=True)
    res, cpu = None, {}
    for _ in range(3):  # each rank's CPU seconds, and rank 0's timings
        got = out.get()
        if isinstance(got, dict):
            res = got
        else:
            for name, s in got[1].items():
                cpu[name] = cpu.get(name, 0.0) + s
    for name, s in cpu.items():  # both processes, median per repeat (lookup included)
        res[f"{name}_cpu_s"] = s
    return res


def host_tier(args) -> dict:
    """Median seconds to demote / promote one sequence's pages, and of plain copies of the
    same bytes (device to host, host to device; pinned host memory on CUDA).

    Demote runs what an allocation in a full pool runs: ``_take(n)`` evicting the sequence's
    n cached pages, which demotes them together (one gather, one copy into the host tier).
    Promote runs what a fresh sequence's prefix hit on the host tier runs: ``_promote`` (the
    content checks, one copy per run of host slots to the device, one scatter, register)."""
    import numpy as np
    import torch

    torch.set_num_threads(max(1, args.threads))
    mgr = _manager(args, args.device)
    n = -(-args.tokens // args.page_size)
    mgr.attach_tiers(host_pages=n + 2)
    # the tiers move whole cached pages: the sequence's n pages, its last one filled up, and
    # a token past them on a page of its own (a partial page is never cached; with pages of
    # one token that page would be whole, and cached: no token past them then)
    tokens = list(range(n * args.page_size + (args.page_size > 1)))
    mgr.release(_prefill(mgr, tokens))
    P = args.page_size
    chunks = [np.asarray(tokens[i * P:(i + 1) * P], np.int64).tobytes() for i in range(n)]
    src = torch.cat([mgr.blocks[0][p][None] for p in range(mgr.num_pages)][:n]).clone()
    on_cuda = src.device.type == "cuda"
    # the plain peer: the same bytes between the device and (pinned, on CUDA) host memory
    dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=on_cuda)

    junk = torch.empty(args.cold_mib << 20, dtype=torch.uint8)  # larger than the L3 cache

    def sync():
        if on_cuda:
            torch.cuda.synchronize(src.device)

    def cold():  # --cold-mib: each timed copy starts with its bytes out of the host's caches
        junk.fill_(1)
        sync()

    demote, promote, plain, plain_back = [], [], [], []
    for _ in range(args.warmup + args.repeat):
        with mgr._lock:
            assert len(mgr._prefix.lru) == n, "the sequence's pages are not all cached"
            spare = list(mgr._free)
            mgr._free.clear()  # a full pool: the allocation evicts the n cached pages
            cold()
            t0 = time.perf_counter()
            taken = mgr._take(n)  # what eviction runs: they are demoted together
            sync()
            demote.append(time.perf_counter() - t0)
            assert not mgr._prefix.lru and len(taken) == n
            mgr._free[:] = sorted(spare + taken, reverse=True)  # back to the free list
        cold()
        t0 = time.perf_counter()
        got = mgr._promote(chunks)  # what a prefix hit on the host tier runs
        sync()
        promote.append(time.perf_counter() - t0)
        assert got == n, f"promoted {got} of {n} pages"
        cold()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        plain.append(time.perf_counter() - t0)
        cold()
        t0 = time.perf_counter()
        src.copy_(dst)
        sync()
        plain_back.append(time.perf_counter() - t0)
    mgr.check_invariants()
    st = mgr.stats().tiers["host"]
    assert st["hits"] == st["promotions"] == n * (args.warmup + args.repeat), st
    k = args.warmup
    return {"nbytes": src.numel() * src.element_size(), "demote_s": statistics.median(demote[k:]),
            "promote_s": statistics.median(promote[k:]), "copy_s": statistics.median(plain[k:]),
            "copy_back_s": statistics.median(plain_back[k:])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtvm.bench transfer",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", type=cliargs.device)
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--tokens", type=cliargs.positive_int, default=512,
                        help="tokens of the sequence sent (the host tier moves its pages, "
                             "the last one whole)")
    parser.add_argument("--page-size", type=cliargs.positive_int, default=16)
    parser.add_argument("--layers", type=cliargs.positive_int, default=8)
    parser.add_argument("--n-kv-heads", type=cliargs.positive_int, default=8)
    parser.add_argument("--head-dim", type=cliargs.positive_int, default=128)
    parser.add_argument("--dtype", default="float16", type=cliargs.float_dtype)
    cliargs.add_cache_storage_options(parser)
    parser.add_argument("--repeat", type=cliargs.positive_int, default=10)
    parser.add_argument("--warmup", type=cliargs.nonnegative_int, default=2)
    parser.add_argument("--threads", type=cliargs.positive_int, default=1,
                        help="torch threads per process")
    parser.add_argument("--cold-mib", type=cliargs.nonnegative_int, default=0,
                        help="host tier: write this many MiB before each timed copy (more "
                             "than the last-level cache: every copy starts cold)")
    parser.add_argument("--skip", default="", help="comma list of: transfer, host")
    parser.add_argument("--json", type=cliargs.output_file, metavar="PATH",
                        help="also write the results as JSON")
    args = parser.parse_args(argv)
    args.cache_storage = cliargs.cache_storage_kwargs(parser, args)
    skip = {s for s in args.skip.split(",") if s}
    if skip - {"transfer", "host"}:
        parser.error(f"--skip: unknown {sorted(skip - {'transfer', 'host'})}; "
                     "known: transfer, host")
    if skip == {"transfer", "host"}:
        parser.error("--skip transfer,host leaves nothing to measure: skip one of them at most")
    if args.backend == "nccl":
        import torch.distributed as dist

        if not args.device.startswith("cuda"):
            parser.error("--backend nccl needs --device cuda")
        if not dist.is_nccl_available():
            parser.error("--backend nccl: this torch build has no NCCL")
    res = {"args": vars(args)}
    try:
        params = _params(args)
        params.resolve_skip_layers(args.layers)
    except KVCacheError as err:  # e.g. --skip-layers past --layers: a usage error
        parser.error(str(err))
    shape = (f"{args.tokens} tokens, pages of {args.page_size}, {args.layers} layers, "
             f"{params.summary()}, {args.device}")
    if "transfer" not in skip:
        log.info("transfer: two processes over %s, %d repeats", args.backend, args.repeat)
        load0 = os.getloadavg()[0]
        t = res["transfer"] = transfer(args)
        t["loadavg"] = (load0, os.getloadavg()[0])
        gb = t["nbytes"] / 1e9
        print(f"transfer between two processes ({args.backend}, loopback): {shape}, "
              f"{t['nbytes'] / 2**20:.1f} MiB, {args.repeat} interleaved repeats, load average "
              f"{load0:.1f} -> {t['loadavg'][1]:.1f}; median | best")
        rows = (("plain send of one tensor", "plain"), ("kvtvm export+send+import", "kvtvm"),
                ("kvtvm lookup+export+send+import", "kvtvm_lookup"))
        print(f"  CPU time of both processes per transfer (median, all threads): plain "
              f"{1e3 * t['plain_cpu_s']:.2f} ms, kvtvm (lookup included) "
              f"{1e3 * t['kvtvm_cpu_s']:.2f} ms, on {os.cpu_count()} cores")
        for label, key in rows:
            med, best = t[f"{key}_s"], t[f"{key}_best_s"]
            line = (f"  {label:<33} {1e3 * med:8.2f} ms {gb / med:6.2f} GB/s | "
                    f"{1e3 * best:8.2f} ms {gb / best:6.2f} GB/s")
            if key != "plain":
                line += (f"   kvtvm / plain {t['plain_s'] / med:.2f}x | "
                         f"{t['plain_best_s'] / best:.2f}x")
            print(line)
    if "host" not in skip:
        log.info("host tier: demote and promote %d tokens", args.tokens)
        h = res["host"] = host_tier(args)
        gb = h["nbytes"] / 1e9
        print(f"host tier: {shape}, {h['nbytes'] / 2**20:.1f} MiB, median of {args.repeat} "
              f"interleaved repeats" + (f", caches flushed ({args.cold_mib} MiB written) "
                                        "before each" if args.cold_mib else ""))
        for name, plain, label in (("demote", "copy_s", "device -> host"),
                                   ("promote", "copy_back_s", "host -> device")):
            p, s = h[plain], h[f"{name}_s"]
            print(f"  plain copy_ {label}      {1e3 * p:8.2f} ms {gb / p:6.2f} GB/s")
            print(f"  {name:<8} (batched, LRU, checks) {1e3 * s:8.2f} ms {gb / s:6.2f} GB/s"
                  f"   / plain {p / s:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
