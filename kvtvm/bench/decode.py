"""``python -m kvtvm.bench decode``: decode attention over a paged cache, side by side in one run.

Peers: kvtvm's ``decode_attention``; torch SDPA on a contiguous ``[batch, H, ctx, D]`` cache (the
non-paged ceiling); torch gather + SDPA (what a torch user writes for a paged cache); TVM 0.27's
built-in paged decode kernel from ``tvm.relax.frontend.nn.llm`` (its CPU variant on the CPU);
FlashInfer when importable (CUDA). Shape: Llama-3-8B (32 query heads, 8 KV heads, head_dim 128),
page 16. Effective bandwidth = K+V bytes of the attended tokens / median time.
"""

from __future__ import annotations

import argparse
import math
import time

from .. import cliargs
from .common import (PEERS, Row, add_common_args, add_skip_arg, log, parse_skip, progress,
                     report, timed)
from .checks import check_decode, kvtvm_failed
from ..params import DTYPE_SIZES
from .fits import check_fits
from .quant_cases import CACHE_DTYPES, cache_as, kernel_cache_arg, row_bytes, speedup_lines

#: (batch, context) cases.
DEFAULT_CASES = {
    "cuda": [(1, 4096), (1, 32768), (16, 4096), (64, 4096), (128, 2048), (256, 1024)],
    "cpu": [(1, 4096), (4, 2048), (16, 1024)],
}


def make_case(batch: int, ctx: int, n_kv_heads: int, group: int, head_dim: int,
              page_size: int, dtype: str, device: str, seed: int = 0) -> dict:
    """Random paged cache with permuted pages, each sequence ``ctx`` tokens long (the current
    token included), q, tables, and the same K/V as a contiguous tensor."""
    import torch

    from ..params import torch_dtype

    tdt = torch_dtype(dtype)
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = -(-ctx // page_size)
    num_pages = batch * pages_per_seq
    table = torch.randperm(num_pages, generator=gen).to(torch.int32).reshape(batch, -1)
    k_cache = torch.randn(num_pages, page_size, n_kv_heads, head_dim, generator=gen).to(tdt)
    v_cache = torch.randn(num_pages, page_size, n_kv_heads, head_dim, generator=gen).to(tdt)
    q = torch.randn(batch, n_kv_heads * group, head_dim, generator=gen).to(tdt)
    lengths = torch.full((batch,), ctx - 1, dtype=torch.int32)  # + the current token = ctx
    case = dict(k_cache=k_cache, v_cache=v_cache, q=q, lengths=lengths, table=table)
    case = {k: v.to(device) for k, v in case.items()}
    idx = case["table"].long()
    # contiguous [batch, H, ctx, D] copies for the SDPA ceiling
    case["k_dense"] = case["k_cache"][idx].reshape(batch, -1, n_kv_heads, head_dim)[:, :ctx] \
        .transpose(1, 2).contiguous()
    case["v_dense"] = case["v_cache"][idx].reshape(batch, -1, n_kv_heads, head_dim)[:, :ctx] \
        .transpose(1, 2).contiguous()
    return case


def _sdpa(q, k, v, scale):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)


def torch_dense(case, scale):
    q = case["q"].unsqueeze(2)  # [batch, Hq, 1, D]
    return lambda: _sdpa(q, case["k_dense"], case["v_dense"], scale)


def torch_gather(case, ctx, scale):
    """Gather the pages into a contiguous tensor, then SDPA."""
    q = case["q"].unsqueeze(2)
    idx = case["table"].long()
    batch, _, H, D = case["q"].shape[0], None, case["k_cache"].shape[2], case["q"].shape[2]

    def run():
        k = case["k_cache"][idx].reshape(batch, -1, H, D)[:, :ctx].transpose(1, 2)
        v = case["v_cache"][idx].reshape(batch, -1, H, D)[:, :ctx].transpose(1, 2)
        return _sdpa(q, k, v, scale)
    return run


def tvm_builtin(case, ctx, page_size, dtype, device, scale):
    """TVM 0.27's built-in paged decode kernel (relax.frontend.nn.llm), built for this target.

    Its cache layout is one ``[num_pages, 2, H, page_size, D]`` tensor (a copy is made here)."""
    import torch

    from .tvm_peer import load

    batch, Hq, D = case["q"].shape
    H = case["k_cache"].shape[2]
    fn = load("decode", dtype, H, Hq, D, page_size, device)
    pages = torch.stack([case["k_cache"], case["v_cache"]], 1).transpose(2, 3).contiguous()
    pages_per_seq = case["table"].shape[1]
    indptr = (torch.arange(batch + 1, dtype=torch.int32) * pages_per_seq).to(pages.device)
    values = case["table"].reshape(-1).contiguous()
    last = torch.full((batch,), ctx - (pages_per_seq - 1) * page_size, dtype=torch.int32,
                      device=pages.device)
    zeros = torch.zeros(batch, dtype=torch.int32, device=pages.device)
    out = torch.empty_like(case["q"])
    lse = torch.empty(batch, Hq, dtype=torch.float32, device=pages.device)
    return lambda: fn(case["q"], pages, indptr, values, last, zeros, zeros, out, lse, 0, 1.0,
                      1e4, scale)


def flashinfer_decode(case, ctx, page_size, scale):
    import flashinfer
    import torch

    batch, Hq, D = case["q"].shape
    H = case["k_cache"].shape[2]
    dev = case["q"].device
    pages_per_seq = case["table"].shape[1]
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    indptr = (torch.arange(batch + 1, dtype=torch.int32) * pages_per_seq).to(dev)
    last = torch.full((batch,), ctx - (pages_per_seq - 1) * page_size, dtype=torch.int32,
                      device=dev)
    wrapper.plan(indptr, case["table"].reshape(-1).contiguous(), last, Hq, H, D, page_size,
                 sm_scale=scale, q_data_type=case["q"].dtype, kv_data_type=case["q"].dtype)
    kv = (case["k_cache"], case["v_cache"])
    return lambda: wrapper.run(case["q"], kv)


def cache_choice(text: str) -> str:
    """argparse ``type`` of ``--cache-dtype``: one of :data:`CACHE_DTYPES` (K and V), or a
    ``K/V`` pair of 8-bit types and ``none`` (the run's dtype), e.g. ``int8/none`` (K-only)."""
    if "/" not in text and text in CACHE_DTYPES:
        return text
    if "/" in text:
        try:
            if any(cliargs.storage_pair(text)):
                return text
        except argparse.ArgumentTypeError:
            pass
    raise argparse.ArgumentTypeError(
        f"expected one of {', '.join(CACHE_DTYPES)}, or K/V such as int8/none or "
        f"int8/float8_e4m3fn (8-bit types and none), got {text!r}")


def kv_row_bytes(storage: str, dtype: str, head_dim: int) -> int:
    """Stored bytes of one token's K and V rows of a head for a ``--cache-dtype`` choice."""
    k, _, v = storage.partition("/")
    return sum(row_bytes(dtype if s == "none" else s, head_dim) for s in (k, v or k))


def in_layout(cache, layout: str):
    """The case's ``cache [pages, page_size, H, row]`` (nhd) laid out as ``layout``: itself, or
    an ``hnd`` copy ``[pages, H, page_size, row]`` (a head's rows of a page contiguous, as the
    linear cache keeps them; quantized rows move whole, scale and padding with their values)."""
    return cache if layout == "nhd" else cache.transpose(1, 2).contiguous()


def quantized_run(case, storage: str, dtype: str, scale: float, layout: str = "nhd"):
    """kvtvm decode over the case's K/V stored as ``storage`` (q in ``dtype``, or in
    ``storage`` for a full-precision one) in pages of ``layout``; ``"K/V"`` stores the sides
    apart (``none``: as the case's ``dtype``)."""
    import torch

    from .. import ops
    from ..quant import QUANT_DTYPES

    ks, sep, vs = storage.partition("/")
    if sep:
        kc, vc = (case[n] if s == "none" else cache_as(case[n], s)
                  for n, s in (("k_cache", ks), ("v_cache", vs)))
    else:
        kc, vc = cache_as(case["k_cache"], storage), cache_as(case["v_cache"], storage)
    q = case["q"] if sep or storage in QUANT_DTYPES else case["q"].to(getattr(torch, storage))
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    k_run, v_run = in_layout(kc, layout), in_layout(vc, layout)

    def run():
        ops.decode_attention(q, k_run, v_run, case["lengths"], case["table"], sm_scale=scale,
                             out=out, lse=lse, layout=layout, check_indices=False)
    sides = (ks, vs) if sep else (storage, storage)
    run.checked = (q, kc, vc, tuple("" if s == "none" else s for s in sides), out)
    return run


def tuning_workload(spec, device: str):
    """``(args, outputs)`` calling ``spec``'s kernel directly (for ``python -m kvtvm.tune``):
    a batch of 4 x 2K tokens on the CPU, 16 x 4K on a GPU, page 16, splits as the op picks,
    K and V stored as the spec says."""
    import torch

    from ..ops.decode import choose_num_splits, split_workspace

    batch, ctx = (16, 4096) if device.startswith("cuda") else (4, 2048)
    case = make_case(batch, ctx, spec.n_kv_heads, spec.group_size, spec.head_dim, 16,
                     spec.dtype, device)
    kc = kernel_cache_arg(case["k_cache"], spec.k_storage, spec.layout)
    vc = kernel_cache_arg(case["v_cache"], spec.v_storage, spec.layout)
    dev = torch.device(device)
    splits = choose_num_splits(batch, spec.n_kv_heads, ctx, dev, quantized=spec.quantized)
    o_part, lse_part = split_workspace(dev, splits, batch, case["q"].shape[1], spec.head_dim)
    out = torch.empty_like(case["q"])
    lse = torch.empty(case["q"].shape[:2], dtype=torch.float32, device=device)
    window = 1024 if "sliding_window" in spec.features else 0
    args = (case["q"], kc, vc, case["lengths"], case["table"], out, lse, o_part, lse_part,
            1.0 / math.sqrt(spec.head_dim), window)
    return args, (out, lse)


def batch_by_context(text: str) -> tuple[int, int]:
    """argparse ``type`` of ``--cases``: ``"64x4096"`` -> ``(64, 4096)``."""
    parts = text.lower().split("x")
    try:
        batch, ctx = (cliargs.positive_int(p) for p in parts)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"expected BATCHxCTX with positive ints such as "
                                         f"64x4096, got {text!r}") from None
    return batch, ctx


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtvm.bench decode", description=__doc__)
    add_common_args(parser)
    parser.add_argument("--dtype", default=None, type=cliargs.float_dtype,
                        help="float16 (default on CUDA) or float32 (default on the CPU, where "
                             "torch's float16 SDPA is emulated and slow)")
    parser.add_argument("--n-kv-heads", type=cliargs.positive_int, default=8)
    parser.add_argument("--group-size", type=cliargs.positive_int, default=4)
    parser.add_argument("--head-dim", type=cliargs.positive_int, default=128)
    parser.add_argument("--page-size", type=cliargs.positive_int, default=16)
    parser.add_argument("--layout", choices=("nhd", "hnd"), default="nhd",
                        help="kvtvm's pages: nhd [pages, page_size, H, D] (the paged cache's; "
                             "default) or hnd [pages, H, page_size, D] (a head's rows of a page "
                             "contiguous); the peers keep theirs")
    parser.add_argument("--cases", nargs="*", metavar="BATCHxCTX", type=batch_by_context,
                        help="e.g. 1x4096 64x4096 (default: a per-device set)")
    parser.add_argument("--cache-dtype", nargs="*", default=[], type=cache_choice,
                        metavar="STORAGE",
                        help="also run kvtvm over the same K/V stored as these types (int8, "
                             "float8_e4m3fn, or another full-precision type), side by side; "
                             f"choices: {', '.join(CACHE_DTYPES)}, or K/V pairs of 8-bit types "
                             "and none (the run's dtype), e.g. int8/none (K-only)")
    add_skip_arg(parser)
    args = parser.parse_args(argv)
    skip = parse_skip(args)

    import torch

    from .. import ops

    device = args.device
    cuda = device.startswith("cuda")
    dtype = args.dtype or ("float16" if cuda else "float32")
    if args.cases:
        cases = args.cases
    else:
        cases = DEFAULT_CASES["cuda" if cuda else "cpu"]
    scale = 1.0 / math.sqrt(args.head_dim)
    item = DTYPE_SIZES[dtype]
    for batch, ctx in cases:  # K/V pages (built in float32), dense copies, stored copies
        elems = batch * -(-ctx // args.page_size) * args.page_size * args.n_kv_heads \
            * args.head_dim
        check_fits(parser, f"{batch}x{ctx}", elems * (4 + 4 * item + 2 * item * len(
            args.cache_dtype)), device, "--cases, --n-kv-heads, --head-dim or --page-size")
    rows, notes = [], {}
    for batch, ctx in progress(cases, desc="decode cases"):
        name = f"b{batch} ctx{ctx}"
        log.info("decode %s: building the case", name)
        case = make_case(batch, ctx, args.n_kv_heads, args.group_size, args.head_dim,
                         args.page_size, dtype, device)
        kv_bytes = 2 * case["k_dense"].numel() * case["k_dense"].element_size()
        out = torch.empty_like(case["q"])
        lse = torch.empty(case["q"].shape[:2], dtype=torch.float32, device=device)
        k_run, v_run = (in_layout(case[n], args.layout) for n in ("k_cache", "v_cache"))

        def kvtvm_run():
            ops.decode_attention(case["q"], k_run, v_run, case["lengths"], case["table"],
                                 sm_scale=scale, out=out, lse=lse, layout=args.layout,
                                 check_indices=False)
        kvtvm_run.checked = (case["q"], case["k_cache"], case["v_cache"], ("", ""), out)

        peers = [("kvtvm", lambda: kvtvm_run)]
        for storage in dict.fromkeys(args.cache_dtype):
            if storage != dtype:
                peers.append((f"kvtvm {storage}",
                              lambda storage=storage: quantized_run(case, storage, dtype, scale,
                                                                   args.layout)))
        if "dense" not in skip:
            peers.append((PEERS["dense"], lambda: torch_dense(case, scale)))
        if "gather" not in skip:
            peers.append((PEERS["gather"], lambda: torch_gather(case, ctx, scale)))
        if "tvm" not in skip:
            peers.append((PEERS["tvm"], lambda: tvm_builtin(case, ctx, args.page_size, dtype,
                                                            device, scale)))
        if cuda and "flashinfer" not in skip:
            peers.append((PEERS["flashinfer"], lambda: flashinfer_decode(case, ctx,
                                                                         args.page_size,
                                                                         scale)))
        for impl, make in peers:
            log.info("decode %s: %s (the first call may build or load its kernel)", name, impl)
            try:
                fn = make()
                t0 = time.perf_counter()
                result = fn()
                if cuda:
                    torch.cuda.synchronize()
                once = time.perf_counter() - t0
            except Exception as exc:  # a peer that cannot run here is reported, not fatal
                if impl.startswith("kvtvm"):  # ... but kvtvm itself failing is the result
                    raise kvtvm_failed(name, impl, exc) from exc
                notes[impl] = f"unavailable: {type(exc).__name__}: {str(exc)[:120]}"
                continue
            if impl.startswith("kvtvm"):  # right before it is timed, whatever --skip says
                q_, kc, vc, storages, got = fn.checked
                check_decode(name, impl, q_, kc, vc, storages, case["lengths"], case["table"],
                             got, scale)
            # slow peers (TVM's serial CPU kernel) get fewer runs so the table stays quick
            repeat = args.repeat if once < 0.1 else max(3, min(args.repeat, int(2 / once)))
            warmup = args.warmup if once < 0.1 else 1
            sec, how = timed(fn, device, repeat, warmup, args.timing)
            nbytes = kv_bytes
            if impl.startswith("kvtvm "):  # the bytes that cache stores
                nbytes = batch * ctx * args.n_kv_heads * kv_row_bytes(impl[6:], dtype,
                                                                      args.head_dim)
            rows.append(Row(name, impl, sec * 1e3, nbytes / sec / 1e12,
                            {"batch": batch, "ctx": ctx, "kv_bytes": kv_bytes,
                             "stored_bytes": nbytes,
                             "dtype": dtype, "layout": args.layout, "timing": how}))
        del case, peers, k_run, v_run
        fn = result = None  # the peers' closures held the case's tensors
        if cuda:  # built into a larger case's freed blocks, 256 x 1K read its float16 cache
            # 15% slower after 256 x 4K than alone (H100, 2026-11-27): each case starts clean
            torch.cuda.empty_cache()
    report(f"decode attention, {args.n_kv_heads * args.group_size} q / {args.n_kv_heads} kv "
           f"heads x {args.head_dim}, {dtype}, page {args.page_size}, {args.layout}", rows,
           "TB/s", "kvtvm", args, device)
    for line in speedup_lines(rows, "kvtvm", dtype):
        print(line)
    if not cuda and args.dtype is None:
        print("(CPU default dtype float32: torch's CPU SDPA in float16 is far slower than in "
              "float32; pass --dtype float16 to compare at half precision)")
    for impl, note in notes.items():
        print(f"{impl}: {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
