"""``python -m kvtvm.bench append``: effective bandwidth of append_kv against torch's own
indexed copy into the same paged layout, side by side in one run.

Effective bandwidth = (bytes of new K and V read + the same bytes written) / median time.
"""

from __future__ import annotations

import argparse

import numpy as np

from .. import cliargs
from ..quant import QUANT_DTYPES, quant_row_bytes, quantize_rows
from .checks import kvtvm_failed
from .fits import check_fits
from .common import Row, add_common_args, log, progress, report, timed

# (name, tokens per sequence, sequences): prefill of one long prompt, a batch of decode steps
DEFAULT_CASES = {
    "cuda": [("prefill 5000x1", 5000, 1), ("prefill 512x16", 512, 16),
             ("decode 1x256", 1, 256), ("decode 1x64", 1, 64)],
    "cpu": [("prefill 5000x1", 5000, 1), ("prefill 512x8", 512, 8), ("decode 1x64", 1, 64)],
}


def make_case(tokens_per_seq: int, batch: int, n_kv_heads: int, head_dim: int, page_size: int,
              dtype: str, device: str, seed: int = 0):
    """Random paged cache (one Llama layer), new rows and tables for one append."""
    import torch

    from ..params import torch_dtype

    rng = np.random.default_rng(seed)
    start = rng.integers(0, 4 * page_size, batch)  # sequences start mid-page
    final = start + tokens_per_seq
    pages = -(-final // page_size)
    num_pages = int(pages.sum()) + 8
    max_pages = int(pages.max())
    perm = rng.permutation(num_pages)
    table = np.zeros((batch, max_pages), np.int32)
    cursor = 0
    for b in range(batch):
        table[b, :pages[b]] = perm[cursor:cursor + pages[b]]
        cursor += pages[b]
    tdt = torch_dtype(dtype)
    cache = torch.randn(num_pages, 2, 1, page_size, n_kv_heads, head_dim).to(tdt).to(device)
    total = tokens_per_seq * batch
    k = torch.randn(total, n_kv_heads, head_dim).to(tdt).to(device)
    v = torch.randn(total, n_kv_heads, head_dim).to(tdt).to(device)
    indptr = torch.arange(0, total + 1, tokens_per_seq, dtype=torch.int32)
    return dict(cache=cache, k=k, v=v, indptr=indptr.to(device),
                lengths=torch.tensor(start, dtype=torch.int32).to(device),
                table=torch.from_numpy(table).to(device))


def row_index(case, page_size: int):
    """``(pages, slots)``: where each new row of the case lands (int64 tensors)."""
    import torch

    indptr, lengths, table = case["indptr"], case["lengths"], case["table"]
    counts = indptr[1:] - indptr[:-1]
    seq = torch.repeat_interleave(torch.arange(len(counts), device=table.device), counts)
    pos = lengths[seq] + torch.arange(indptr[-1].item(), device=table.device) - indptr[seq]
    return table[seq, pos // page_size].long(), (pos % page_size).long()


def torch_indexed_copy(case, page_size: int):
    """What a torch user writes: (page, slot) of every row, then ``index_put_`` into the
    per-layer views."""
    import torch

    cache = case["cache"]
    index = row_index(case, page_size)
    k_view, v_view = cache[:, 0, 0], cache[:, 1, 0]  # [num_pages, page_size, H, D] views

    def run():
        k_view.index_put_(index, case["k"])
        v_view.index_put_(index, case["v"])
    return run


def quantizing_run(case, storage: str, name: str, page_size: int):
    """The quantizing append of the case's rows into a ``storage`` cache of the same pages
    (its TB/s column counts the plain append's bytes, so the ratio column is its cost), called
    once before it is returned, and checked: the rows it wrote are the reference quantizer's
    bytes (:func:`kvtvm.quant.quantize_rows`)."""
    import torch

    from .. import ops

    shape = case["cache"][:, 0, 0].shape[:-1] + (quant_row_bytes(case["k"].shape[-1]),)
    kc, vc = (torch.zeros(shape, dtype=torch.int8, device=case["k"].device)
              .view(getattr(torch, storage)) for _ in range(2))

    def run():
        ops.append_kv(kc, vc, case["k"], case["v"], case["indptr"], case["lengths"],
                      case["table"], check_indices=False)
    try:  # untimed, as the plain columns' first call: it may build or load the kernel
        run()
    except Exception as err:
        raise kvtvm_failed(name, f"kvtvm {storage}", err) from err
    index = row_index(case, page_size)
    for side, rows in ((kc, case["k"]), (vc, case["v"])):
        want = quantize_rows(rows.float().cpu().numpy(), storage).view(np.int8)
        if not np.array_equal(side[index].view(torch.int8).cpu().numpy(), want):
            raise SystemExit(f"{name}: kvtvm {storage} wrote other bytes than the reference "
                             "quantizer")
    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtvm.bench append", description=__doc__)
    add_common_args(parser)
    parser.add_argument("--dtype", default="float16", type=cliargs.float_dtype)
    parser.add_argument("--n-kv-heads", type=cliargs.positive_int, default=8)
    parser.add_argument("--head-dim", type=cliargs.positive_int, default=128)
    parser.add_argument("--page-size", type=cliargs.positive_int, default=16)
    parser.add_argument("--cache-dtype", nargs="*", default=[], choices=QUANT_DTYPES,
                        metavar="STORAGE",
                        help="also time the quantizing append into an int8 / float8_e4m3fn "
                             "cache of the same rows (its cost beside the plain copy)")
    args = parser.parse_args(argv)

    import torch

    from .. import ops

    device = args.device
    rows = []
    cases = DEFAULT_CASES["cuda" if device.startswith("cuda") else "cpu"]
    for name, per_seq, batch in cases:  # the pages (built in float32, at most 4 pages of
        # start per sequence) and the new rows, a copy of them per stored type
        elems = (batch * (per_seq + 5 * args.page_size) + 8 * args.page_size) * 2 \
            * args.n_kv_heads * args.head_dim
        check_fits(parser, name, elems * 4 * (3 + len(args.cache_dtype)), device,
                   "--n-kv-heads, --head-dim or --page-size")
    for name, per_seq, batch in progress(cases, desc="append cases"):
        log.info("append %s", name)
        case = make_case(per_seq, batch, args.n_kv_heads, args.head_dim, args.page_size,
                         args.dtype, device)
        moved = 2 * 2 * case["k"].numel() * case["k"].element_size()  # K+V, read+write
        kc, vc = case["cache"][:, 0, 0], case["cache"][:, 1, 0]

        def kvtvm_run():
            ops.append_kv(kc, vc, case["k"], case["v"], case["indptr"], case["lengths"],
                          case["table"], check_indices=False)
        torch_run = torch_indexed_copy(case, args.page_size)
        # both must write the same cache before we time them
        initial = case["cache"].clone()
        kvtvm_run()
        by_kvtvm = case["cache"].clone()
        case["cache"].copy_(initial)
        torch_run()
        if not torch.equal(by_kvtvm, case["cache"]):
            raise SystemExit(f"{name}: kvtvm and torch wrote different caches")
        runs = [("kvtvm", kvtvm_run)]
        for storage in dict.fromkeys(args.cache_dtype):
            runs.append((f"kvtvm {storage}",
                         quantizing_run(case, storage, name, args.page_size)))
        runs.append(("torch index_put_", torch_run))
        for impl, fn in runs:
            sec, how = timed(fn, device, args.repeat, args.warmup, args.timing)
            rows.append(Row(name, impl, sec * 1e3, moved / sec / 1e12,
                            {"bytes": moved, "tokens": per_seq * batch, "timing": how}))
    report(f"append_kv, {args.n_kv_heads} kv heads x {args.head_dim}, {args.dtype}, "
           f"page {args.page_size}", rows, "TB/s", "kvtvm", args, device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
