"""``python -m kvtvm.bench copy`` (and ``kvtvm.tune``'s workload for the copy kernel):
effective bandwidth of ``ops.copy_pages`` against torch's indexed copy of the same pages.

Effective bandwidth = 2 x (bytes of the pages copied) / median time (read + write).
"""

from __future__ import annotations

import argparse

from .. import cliargs
from .checks import kvtvm_failed
from .fits import check_fits
from .common import Row, add_common_args, log, progress, report, timed

# (name, pages in the pool, pages copied)
DEFAULT_CASES = {"cuda": [("cow 64 of 8192", 8192, 64), ("move 1024 of 8192", 8192, 1024)],
                 "cpu": [("cow 16 of 1024", 1024, 16), ("move 256 of 1024", 1024, 256)]}


def make_case(num_pages: int, n_copy: int, n_kv_heads: int, head_dim: int, dtype: str,
              device: str, num_layers: int = 4, page_size: int = 16, seed: int = 0):
    """A PAGED cache tensor and independent (src, dst) page lists."""
    import torch

    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_pages, generator=g)
    src, dst = perm[:n_copy], perm[n_copy:2 * n_copy]
    blocks = torch.randn(num_pages, 2, num_layers, page_size, n_kv_heads, head_dim,
                         generator=g).to(getattr(torch, dtype)).to(device)
    return blocks, src.to(torch.int32).to(device), dst.to(torch.int32).to(device)


def tuning_workload(spec, device: str):
    """``(args, outputs)`` of one direct call of the copy kernel: 64 of 1024 pages (CPU) or 512
    of 8192 (GPU), 4 layers, page 16, 8 KV heads of ``spec.head_dim``."""
    pages, n = (8192, 512) if device.startswith("cuda") else (1024, 64)
    blocks, src, dst = make_case(pages, n, 8, spec.head_dim, spec.dtype, device)
    view = blocks.view(1, pages, -1, spec.head_dim)
    return (view, src, dst), (view,)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtvm.bench copy", description=__doc__)
    add_common_args(parser)
    parser.add_argument("--dtype", default="float16", type=cliargs.float_dtype)
    parser.add_argument("--n-kv-heads", type=cliargs.positive_int, default=8)
    parser.add_argument("--head-dim", type=cliargs.positive_int, default=128)
    args = parser.parse_args(argv)
    import torch

    from .. import ops

    rows = []
    cases = DEFAULT_CASES["cuda" if args.device.startswith("cuda") else "cpu"]
    for name, pages, n in cases:  # the cache tensor: 4 layers of K and V pages of 16 tokens
        check_fits(parser, name, pages * 2 * 4 * 16 * args.n_kv_heads * args.head_dim * 4 * 2,
                   args.device, "--n-kv-heads or --head-dim")
    for name, pages, n in progress(cases, desc="copy cases"):
        log.info("copy %s", name)
        blocks, src, dst = make_case(pages, n, args.n_kv_heads, args.head_dim, args.dtype,
                                     args.device)
        moved = 2 * n * blocks[0].numel() * blocks.element_size()
        src_l, dst_l = src.long(), dst.long()

        def torch_copy():
            blocks[dst_l] = blocks[src_l]

        try:  # one untimed call (it builds or loads the kernel), checked: the destination
            # pages (random, unlike their sources) must now equal the sources
            ops.copy_pages(blocks, src, dst)
        except Exception as err:
            raise kvtvm_failed(name, "kvtvm", err) from err
        if not torch.equal(blocks[dst_l], blocks[src_l]):
            raise SystemExit(f"{name}: kvtvm's copy_pages left destination pages unlike "
                             "their sources")
        for impl, fn in (("kvtvm", lambda: ops.copy_pages(blocks, src, dst)),
                         ("torch", torch_copy)):
            sec, how = timed(fn, args.device, args.repeat, args.warmup, args.timing)
            rows.append(Row(name, impl, sec * 1e3, moved / sec / 1e12, {"timing": how}))
    report("page copy", rows, "TB/s", "kvtvm", args, args.device)
    return 0
