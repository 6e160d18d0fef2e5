"""``python -m kvtvm.bench prefill``: ragged causal prefill attention over a paged cache.

Peers, side by side in one run: kvtvm; torch SDPA (causal, bottom-right aligned when a
cached prefix is present) on contiguous K/V (the non-paged ceiling); torch gather + SDPA (what
a torch user writes over a paged cache); TVM 0.27's built-in paged prefill kernel from
``tvm.relax.frontend.nn.llm`` built for the same target (its CPU variant on llvm); FlashInfer
when importable.

Shape: Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128), page 16.
FLOPs: ``4 * n_q_heads * head_dim * visible_pairs`` where ``visible_pairs`` counts the
(query, key) pairs the causal mask keeps: ``sum_b n_b * c_b + n_b * (n_b + 1) / 2`` for
``n_b`` new tokens over ``c_b`` cached ones (two matmuls, a multiply and an add each).
"""

from __future__ import annotations

import argparse
import itertools
import math

from .. import cliargs
from .common import (PEERS, Row, add_common_args, add_skip_arg, log, parse_skip, progress,
                     report, timed)
from .checks import check_prefill, kvtvm_failed
from ..params import DTYPE_SIZES
from .fits import check_fits
from .quant_cases import CACHE_DTYPES, cache_as, kernel_cache_arg, row_bytes, speedup_lines

N_Q_HEADS, N_KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
#: (batch, new tokens per sequence, cached tokens per sequence)
GPU_CASES = [(1, 8192, 0), (1, 4096, 0), (4, 2048, 0), (16, 512, 0), (8, 1024, 3072),
             (32, 128, 1920)]
CPU_CASES = [(1, 512, 0), (4, 128, 384), (16, 16, 240)]


def visible_pairs(batch, new, cached) -> int:
    return batch * (new * cached + new * (new + 1) // 2)


class Case:
    """One (batch, new, cached) problem: paged cache, contiguous copies, tables."""

    def __init__(self, batch, new, cached, dtype, device, seed=0):
        import torch

        g = torch.Generator().manual_seed(seed)
        tdt = getattr(torch, dtype)
        self.batch, self.new, self.cached = batch, new, cached
        kv_len = new + cached
        pages = -(-kv_len // PAGE)
        num_pages = batch * pages
        perm = torch.randperm(num_pages, generator=g).to(torch.int32)
        self.table = perm.reshape(batch, pages).contiguous()
        self.k_cache = torch.randn(num_pages, PAGE, N_KV_HEADS, HEAD_DIM, generator=g).to(tdt)
        self.v_cache = torch.randn(num_pages, PAGE, N_KV_HEADS, HEAD_DIM, generator=g).to(tdt)
        self.q = torch.randn(batch * new, N_Q_HEADS, HEAD_DIM, generator=g).to(tdt)
        self.indptr = torch.arange(0, batch * new + 1, new, dtype=torch.int32)
        self.lengths = torch.full((batch,), cached, dtype=torch.int32)
        # contiguous per-sequence K/V [batch, H, kv_len, D] and q [batch, HQ, new, D]
        idx = self.table.long()
        self.k_dense = self.k_cache[idx].reshape(batch, -1, N_KV_HEADS, HEAD_DIM)[:, :kv_len] \
            .transpose(1, 2).contiguous()
        self.v_dense = self.v_cache[idx].reshape(batch, -1, N_KV_HEADS, HEAD_DIM)[:, :kv_len] \
            .transpose(1, 2).contiguous()
        self.q_dense = self.q.reshape(batch, new, N_Q_HEADS, HEAD_DIM).transpose(1, 2) \
            .contiguous()
        for name in ("table", "k_cache", "v_cache", "q", "indptr", "lengths", "k_dense",
                     "v_dense", "q_dense"):
            setattr(self, name, getattr(self, name).to(device))
        self.out = torch.empty_like(self.q)
        self.lse = torch.empty(self.q.shape[:2], dtype=torch.float32, device=device)
        self.kv_len = kv_len

    @property
    def name(self) -> str:
        return f"b{self.batch} n{self.new} c{self.cached}"

    def flops(self) -> float:
        return 4.0 * N_Q_HEADS * HEAD_DIM * visible_pairs(self.batch, self.new, self.cached)


def _sdpa_mask(case):
    if case.cached == 0:
        return None, True
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(case.new, case.kv_len), False


def run_kvtvm(case):
    from kvtvm import ops

    def fn():
        ops.prefill_attention(case.q, case.k_cache, case.v_cache, case.indptr, case.lengths,
                              case.table, out=case.out, lse=case.lse, check_indices=False)
    fn.checked = (case.q, case.k_cache, case.v_cache, ("", ""), case.out)
    return fn


def run_kvtvm_stored(case, storage: str):
    """kvtvm prefill over the case's K/V stored as ``storage`` (q in the case's dtype, or in
    ``storage`` for a full-precision one)."""
    import torch

    from kvtvm import ops

    from ..quant import QUANT_DTYPES

    kc, vc = cache_as(case.k_cache, storage), cache_as(case.v_cache, storage)
    q = case.q if storage in QUANT_DTYPES else case.q.to(getattr(torch, storage))
    out = torch.empty_like(q)

    def fn():
        ops.prefill_attention(q, kc, vc, case.indptr, case.lengths, case.table, out=out,
                              lse=case.lse, check_indices=False)
    fn.checked = (q, kc, vc, (storage, storage) if storage in QUANT_DTYPES else ("", ""), out)
    return fn


def run_sdpa(case):
    import torch.nn.functional as F

    mask, is_causal = _sdpa_mask(case)

    def fn():
        return F.scaled_dot_product_attention(case.q_dense, case.k_dense, case.v_dense,
                                              attn_mask=mask, is_causal=is_causal,
                                              enable_gqa=True)
    return fn


def run_gather_sdpa(case):
    import torch.nn.functional as F

    mask, is_causal = _sdpa_mask(case)
    idx = case.table.long()

    def fn():
        k = case.k_cache[idx].reshape(case.batch, -1, N_KV_HEADS, HEAD_DIM)[:, :case.kv_len]
        v = case.v_cache[idx].reshape(case.batch, -1, N_KV_HEADS, HEAD_DIM)[:, :case.kv_len]
        q = case.q.reshape(case.batch, case.new, N_Q_HEADS, HEAD_DIM)
        F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                       v.transpose(1, 2), attn_mask=mask,
                                       is_causal=is_causal, enable_gqa=True)
    return fn


def run_tvm_builtin(case, dtype, device):
    """Its cache is ``[num_pages, 2, H, page, D]`` (K and V interleaved, head-major)."""
    import torch

    from .tvm_peer import load

    fn = load("prefill", dtype, N_KV_HEADS, N_Q_HEADS, HEAD_DIM, PAGE, device)
    pages = torch.stack([case.k_cache.transpose(1, 2), case.v_cache.transpose(1, 2)], 1) \
        .contiguous()
    n_pages = case.table.shape[1]
    page_indptr = torch.arange(0, case.batch * n_pages + 1, n_pages, dtype=torch.int32,
                               device=case.q.device)
    page_values = case.table.reshape(-1).contiguous()
    last_page_len = torch.full((case.batch,), case.kv_len - (n_pages - 1) * PAGE,
                               dtype=torch.int32, device=case.q.device)
    zeros_b = torch.zeros(case.batch, dtype=torch.int32, device=case.q.device)
    q_pos = torch.zeros(case.q.shape[0], dtype=torch.int32, device=case.q.device)
    out = torch.empty_like(case.q)
    lse = torch.empty(case.q.shape[:2], dtype=torch.float32, device=case.q.device)
    scale = 1.0 / math.sqrt(HEAD_DIM)

    def call():
        fn(case.q, case.indptr, pages, page_indptr, page_values, last_page_len, zeros_b, q_pos,
           out, lse, 1, 0, 1.0, 1e4, scale)
    return call, out


def run_flashinfer(case, dtype):
    import flashinfer  # noqa: F401
    import torch

    n_pages = case.table.shape[1]
    dev = case.q.device
    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(case.indptr, torch.arange(0, case.batch * n_pages + 1, n_pages,
                                           dtype=torch.int32, device=dev),
                 case.table.reshape(-1).contiguous(),
                 torch.full((case.batch,), case.kv_len - (n_pages - 1) * PAGE,
                            dtype=torch.int32, device=dev),
                 N_Q_HEADS, N_KV_HEADS, HEAD_DIM, PAGE, causal=True,
                 q_data_type=getattr(torch, dtype))

    def fn():
        wrapper.run(case.q, (case.k_cache, case.v_cache))
    return fn


#: (new tokens, cached tokens) per sequence of the tuning workload: a ragged serving mix of a
#: fresh prompt, chunked prefills over a cached prefix and short continuations, so a pick
#: holds across shapes rather than fitting one
TUNING_MIX = {"cpu": [(256, 0), (128, 384), (64, 192), (16, 240), (16, 496), (1, 1000)],
              "cuda": [(4096, 0), (2048, 2048), (1024, 3072), (128, 1920), (16, 4000),
                       (1, 8000)]}


def tuning_workload(spec, device: str):
    """``(args, outputs)`` of one direct call of ``spec``'s kernel for ``python -m kvtvm.tune``:
    the ragged mix :data:`TUNING_MIX` of the device, page 16, the spec's heads, dtype, layout,
    features and K/V storage."""
    import torch

    mix = TUNING_MIX["cuda" if str(device).startswith("cuda") else "cpu"]
    batch = len(mix)
    H, G, D = spec.n_kv_heads, spec.group_size, spec.head_dim
    tdt = getattr(torch, spec.dtype)
    g = torch.Generator().manual_seed(0)
    pages = max(-(-(new + cached) // PAGE) for new, cached in mix)
    table = torch.randperm(batch * pages, generator=g).to(torch.int32).reshape(batch, pages)
    cache = torch.randn(batch * pages, 2, PAGE, H, D, generator=g).to(tdt).to(device)
    kc = kernel_cache_arg(cache[:, 0], spec.k_storage, spec.layout)
    vc = kernel_cache_arg(cache[:, 1], spec.v_storage, spec.layout)
    counts = [new for new, _ in mix]
    q = torch.randn(sum(counts), H * G, D, generator=g).to(tdt).to(device)
    indptr = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32, device=device)
    lengths = torch.tensor([cached for _, cached in mix], dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=device)
    window = 1024 if "sliding_window" in spec.features else 0
    args = (q, kc, vc, indptr, lengths, table.to(device), out, lse, 1, 1.0 / math.sqrt(D),
            window)
    return args, (out, lse)


def batch_new_cached(text: str) -> list[tuple[int, int, int]]:
    """argparse ``type`` of ``--cases``: ``"1:512:0,4:128:1920"`` -> ``[(1, 512, 0), ...]``
    (batch and new tokens >= 1, cached tokens >= 0)."""
    cases = []
    for item in (c for c in text.split(",") if c):
        parts = item.split(":")
        try:
            if len(parts) != 3:
                raise ValueError
            cases.append((cliargs.positive_int(parts[0]), cliargs.positive_int(parts[1]),
                          cliargs.nonnegative_int(parts[2])))
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"expected batch:new:cached triples such as "
                                             f"1:512:0,4:128:1920, got {item!r}") from None
    if not cases:
        raise argparse.ArgumentTypeError(f"expected batch:new:cached triples, got {text!r}")
    return cases


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtvm.bench prefill",
                                     description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--dtype", default="float16", type=cliargs.float_dtype)
    parser.add_argument("--cases", type=batch_new_cached,
                        help="batch:new:cached,... (default: per device)")
    parser.add_argument("--cache-dtype", nargs="*", default=[], choices=CACHE_DTYPES,
                        metavar="STORAGE",
                        help="also run kvtvm over the same K/V stored as these types (int8, "
                             "float8_e4m3fn, or another full-precision type), side by side")
    add_skip_arg(parser)
    parser.set_defaults(repeat=None, warmup=None)  # per device: CPU runs are long
    for action in parser._actions:
        if action.dest in ("repeat", "warmup"):
            action.help += (" (default: 5 on the CPU, 20 on CUDA)" if action.dest == "repeat"
                            else " (default: 1 on the CPU, 3 on CUDA)")
    args = parser.parse_args(argv)
    device = args.device
    import torch

    cpu = not device.startswith("cuda")
    if args.repeat is None:
        args.repeat = 5 if cpu else 20
    if args.warmup is None:
        args.warmup = 1 if cpu else 3
    if cpu:
        torch.set_num_threads(max(1, __import__("os").cpu_count() or 1))
    cases = CPU_CASES if cpu else GPU_CASES
    if args.cases:
        cases = args.cases
    skip = parse_skip(args)
    item = DTYPE_SIZES[args.dtype]
    for batch, new, cached in cases:  # K/V pages (built in float32), dense copies, q, out
        elems = batch * (-(-(new + cached) // PAGE) * PAGE * N_KV_HEADS
                         + 2 * new * N_Q_HEADS) * HEAD_DIM
        check_fits(parser, f"{batch}:{new}:{cached}", elems * (4 + 4 * item + 2 * item * len(
            args.cache_dtype)), device, "--cases")
    rows: list[Row] = []
    notes = []
    for batch, new, cached in progress(cases, desc="prefill cases"):
        log.info("prefill %d:%d:%d: building the case", batch, new, cached)
        case = Case(batch, new, cached, args.dtype, device)
        peers = [("kvtvm", None, lambda: run_kvtvm(case)),
                 (PEERS["dense"], "dense", lambda: run_sdpa(case)),
                 (PEERS["gather"], "gather", lambda: run_gather_sdpa(case)),
                 (PEERS["tvm"], "tvm", lambda: run_tvm_builtin(case, args.dtype, device)[0])]
        if not cpu:  # a CUDA library: not tried on the CPU (as decode)
            peers.append((PEERS["flashinfer"], "flashinfer",
                          lambda: run_flashinfer(case, args.dtype)))
        peers[1:1] = [(f"kvtvm {st}", None, lambda st=st: run_kvtvm_stored(case, st))
                      for st in dict.fromkeys(args.cache_dtype) if st != args.dtype]
        for impl, key, make in peers:
            if key in skip:
                continue
            log.info("prefill %s: %s (the first call may build or load its kernel)",
                     case.name, impl)
            try:
                fn = make()
                fn()
            except Exception as err:  # a peer that cannot run here is reported, not fatal
                if impl.startswith("kvtvm"):  # ... but kvtvm itself failing is the result
                    raise kvtvm_failed(case.name, impl, err) from err
                note = f"{impl}: unavailable ({type(err).__name__}: {str(err)[:120]})"
                if note not in notes:
                    notes.append(note)
                continue
            if impl.startswith("kvtvm"):  # right before it is timed, whatever --skip says
                q, kc, vc, storages, got = fn.checked
                check_prefill(case.name, impl, q, kc, vc, storages, case.indptr, case.lengths,
                              case.table, got, 1.0 / math.sqrt(HEAD_DIM))
            sec, how = timed(fn, device, args.repeat, args.warmup, args.timing)
            storage = impl[6:] if impl.startswith("kvtvm ") else args.dtype
            stored = 2 * batch * case.kv_len * N_KV_HEADS * row_bytes(storage, HEAD_DIM)
            rows.append(Row(case.name, impl, sec * 1e3, case.flops() / sec / 1e12,
                            extra={"batch": batch, "new": new, "cached": cached,
                                   "stored_bytes": stored,
                                   "timing": how}))
            print(f"  {case.name:<18} {impl:<12} {sec * 1e3:10.3f} ms "
                  f"{case.flops() / sec / 1e12:8.3f} TFLOP/s", flush=True)
    report(f"prefill attention ({args.dtype}, {N_Q_HEADS}q/{N_KV_HEADS}kv heads, d{HEAD_DIM}, "
           f"page {PAGE}, causal)", rows, "TFLOP/s", "kvtvm", args, device)
    for line in speedup_lines(rows, "kvtvm", args.dtype):
        print(line)
    for note in notes:
        print(note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
