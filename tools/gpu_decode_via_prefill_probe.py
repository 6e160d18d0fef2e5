"""Would decode over an 8-bit cache be faster through the tensor-core prefill kernel (one query
token per sequence, the GQA group's heads as MMA rows) than through the CUDA-core quantized
decode? (issue 16: fp8 decode at least 1.5x float16 at B>=16, 4K.) Times, at the decode
benchmark's shapes (8 KV heads x 128, GQA 4, pages of 16, float16 queries):
``decode_attention`` over float16 / int8 / e4m3 caches and ``prefill_attention`` with
``qo_indptr = arange(B + 1)`` over the same caches, each checked against the float16 decode.

On the GPU machine after ``source tools/gpu-env.sh``:
``python3 tools/gpu_decode_via_prefill_probe.py``
(needs the benchmarks' decode and prefill kernels, quantized too: make gpu-kit).
"""

from __future__ import annotations

import math

import torch

from kvtvm import ops
from kvtvm.bench.common import timed
from kvtvm.bench.decode import make_case
from kvtvm.bench.quant_cases import cache_as

SHAPES = [(16, 4096), (64, 4096), (128, 2048), (1, 32768)]
STORAGES = ("float16", "int8", "float8_e4m3fn")


def main() -> None:
    scale = 1.0 / math.sqrt(128)
    print(f"{'B x ctx':>10s} {'storage':>14s} {'decode ms':>10s} {'via prefill ms':>15s} "
          f"{'decode vs fp16':>15s} {'prefill vs fp16':>16s}")
    for batch, ctx in SHAPES:
        case = make_case(batch, ctx, 8, 4, 128, 16, "float16", "cuda")
        del case["k_dense"], case["v_dense"]
        q = case["q"]
        indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        base = None
        for storage in STORAGES:
            kc, vc = cache_as(case["k_cache"], storage), cache_as(case["v_cache"], storage)
            out_d, out_p = torch.empty_like(q), torch.empty_like(q)
            lse_d = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
            lse_p = torch.empty_like(lse_d)

            def dec():
                ops.decode_attention(q, kc, vc, case["lengths"], case["table"], sm_scale=scale,
                                     out=out_d, lse=lse_d, check_indices=False)

            def pre():
                ops.prefill_attention(q, kc, vc, indptr, case["lengths"], case["table"],
                                      causal=True, sm_scale=scale, out=out_p, lse=lse_p,
                                      check_indices=False)

            times = []
            for fn in (dec, pre):
                try:
                    times.append(timed(fn, "cuda", 20, 3, timing="graph")[0] * 1e3)
                except Exception as exc:  # noqa: BLE001 -- a missing kernel is reported
                    print(f"  {storage} {fn.__name__}: {type(exc).__name__}: {str(exc)[:100]}")
                    times.append(float("nan"))
            diff = (out_d.float() - out_p.float()).abs().max().item()
            if base is None:
                base = times[0]
            print(f"{batch:>4d}x{ctx:<5d} {storage:>14s} {times[0]:10.4f} {times[1]:15.4f} "
                  f"{base / times[0]:14.2f}x {base / times[1]:15.2f}x   max|decode-prefill| "
                  f"{diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
