"""Decode attention over the same K/V stored in both cache layouts: ``nhd`` (paged: a token's
row holds every KV head, so one head's 256-byte rows are 2 KiB apart) and ``hnd`` (linear:
one head's page is contiguous), to see what the access pattern costs the nhd kernel.

Run on the GPU machine after ``source tools/gpu-env.sh``: ``python3 tools/gpu_decode_layouts.py``
(needs the fp16 8 x 128 GQA-4 decode kernels of both layouts in build/kernels: make gpu-kit).
"""

from __future__ import annotations

import math

import torch

from kvtvm import ops
from kvtvm.bench.common import timed
from kvtvm.bench.decode import make_case


def main() -> None:
    scale = 1.0 / math.sqrt(128)
    print("batch x ctx   nhd TB/s   hnd TB/s   hnd / nhd")
    for batch, ctx in [(64, 4096), (1, 32768), (16, 4096), (256, 1024)]:
        case = make_case(batch, ctx, 8, 4, 128, 16, "float16", "cuda")
        del case["k_dense"], case["v_dense"]
        nbytes = 2 * batch * ctx * 8 * 128 * 2
        out = torch.empty_like(case["q"])
        lse = torch.empty(case["q"].shape[:2], dtype=torch.float32, device="cuda")
        # the same pages, each laid out [H, page_size, D] (contiguous per head)
        k_hnd = case["k_cache"].transpose(1, 2).contiguous()
        v_hnd = case["v_cache"].transpose(1, 2).contiguous()
        res = {}
        for layout, kc, vc in [("nhd", case["k_cache"], case["v_cache"]), ("hnd", k_hnd, v_hnd)]:
            def call(kc=kc, vc=vc, layout=layout):
                ops.decode_attention(case["q"], kc, vc, case["lengths"], case["table"],
                                     layout=layout, sm_scale=scale, out=out, lse=lse,
                                     check_indices=False)
            call()
            want = out.clone()
            sec, _ = timed(call, "cuda", 20, 3, "graph")
            res[layout] = (nbytes / sec / 1e12, want)
        assert torch.allclose(res["nhd"][1].float(), res["hnd"][1].float(), atol=1e-2)
        print(f"{batch:>5} x {ctx:<6} {res['nhd'][0]:8.3f}   {res['hnd'][0]:8.3f}   "
              f"{res['hnd'][0] / res['nhd'][0]:6.2f}x", flush=True)


if __name__ == "__main__":
    main()
