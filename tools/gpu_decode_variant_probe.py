"""Where the CUDA decode over an 8-bit cache should switch between its tuned kernel and its
``short_splits`` variant (the schedule's defaults): both, and the float16 cache's decode, at
batch x context shapes from one short sequence to a serving batch, each at the split count the
ops choose. Prints a table and the ratio tuned / short_splits per shape, with the variant the ops
pick today (``kvtvm.ops.decode.decode_variant``, threshold ``CUDA_SHORT_SPLIT_TOKENS``).

Run on the GPU machine after ``source tools/gpu-env.sh`` with the kit built by
``make gpu-kit`` (its int8 / float8_e4m3fn decode, 8 KV heads x 128, group 4, nhd, with both
variants): ``python3 tools/gpu_decode_variant_probe.py --json $OUT/decode-variant.json``.
Kernel time = CUDA-graph replays with the L2 cache flushed before each (kvtvm.bench.common).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from kvtvm.bench.common import timed
from kvtvm.bench.decode import make_case
from kvtvm.bench.quant_cases import cache_as
from kvtvm.ops import decode as decode_op

SHAPES = [(1, 1024), (1, 2048), (1, 4096), (1, 8192), (1, 16384), (1, 32768), (2, 4096),
          (4, 4096), (8, 4096), (16, 4096), (64, 4096), (256, 1024)]
H, G, D, PAGE = 8, 4, 128, 16


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--storages", nargs="+", default=["int8", "float8_e4m3fn"])
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--json")
    args = parser.parse_args()
    dev = torch.device("cuda")
    chosen = decode_op.decode_variant
    rows = []
    for batch, ctx in SHAPES:
        case = make_case(batch, ctx, H, G, D, PAGE, "float16", "cuda")
        q, lengths, table = case["q"], case["lengths"], case["table"]
        splits = decode_op.choose_num_splits(batch, H, table.shape[1] * PAGE, dev)
        row = {"batch": batch, "ctx": ctx, "splits": splits,
               "picked": chosen("cuda", True, table.shape[1] * PAGE, splits)}

        def call(k, v):
            return lambda: decode_op.decode_attention(q, k, v, lengths, table,
                                                      num_splits=splits)

        row["float16_ms"] = 1e3 * timed(call(case["k_cache"], case["v_cache"]), "cuda",
                                        args.repeat, 5, "graph")[0]
        for storage in args.storages:
            k, v = cache_as(case["k_cache"], storage), cache_as(case["v_cache"], storage)
            want = None
            for variant in ("", "short_splits"):
                decode_op.decode_variant = lambda *a, _v=variant: _v  # noqa: E731
                try:
                    out, _ = call(k, v)()
                    if want is None:
                        want = out.float()
                    err = (out.float() - want).abs().max().item()
                    assert err < 1e-2, f"{storage} {variant}: differs by {err}"
                    ms = 1e3 * timed(call(k, v), "cuda", args.repeat, 5, "graph")[0]
                finally:
                    decode_op.decode_variant = chosen
                row[f"{storage}_{variant or 'tuned'}_ms"] = ms
            del k, v
        rows.append(row)
        line = f"{batch:4d} x {ctx:6d} splits {splits:3d} picked {row['picked'] or 'tuned':12s}" \
               f" f16 {row['float16_ms']:.4f} ms"
        for storage in args.storages:
            t, s = row[f"{storage}_tuned_ms"], row[f"{storage}_short_splits_ms"]
            line += (f" | {storage} tuned {t:.4f} short {s:.4f} (f16/tuned "
                     f"{row['float16_ms'] / t:.2f}x, f16/short {row['float16_ms'] / s:.2f}x)")
        print(line, flush=True)
        del case
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "threshold": decode_op.CUDA_SHORT_SPLIT_TOKENS,
                       "device": torch.cuda.get_device_name(), "scale": 1 / math.sqrt(D)},
                      f, indent=1)


if __name__ == "__main__":
    main()
