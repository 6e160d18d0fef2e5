"""Where the 8-bit decode's bandwidth goes at large batches (GPU, issue 16): layout and split count.

On the H100 (2026-11-27) the tensor-core 8-bit decode reads 2.29-2.32 TB/s of stored bytes at
64 x 4K and 256 x 1K, the float16 cache's kernel 2.74, and every knob set of the 8-bit kernel
gave the same time there (within 2%): not the bytes in flight. Two suspects remain, which this
probe separates with the kernels' default knobs:

- the page layout: an 8-bit row is 144 bytes (128 codes, scale, padding), so in ``nhd`` half
  the rows start in the middle of a 32-byte sector and a head's rows lie 1152 bytes apart;
  in ``hnd`` a page's 16 rows of one head are 2304 contiguous bytes (the float16 kernel's
  256-byte rows read alike in both layouts: ``tools/gpu_decode_layouts.py``, docs/PERF.md);
- the split count: ``choose_num_splits`` gives 4096 CTAs of 512 positions at 64 x 4K, 4.4
  waves of the 8-bit kernel's 7 resident CTAs per SM, so the last wave runs 43% full.

    python tools/gpu_decode_layout_probe.py build build/probe-layout    # here (TVM + nvcc)
    python3 tools/gpu_decode_layout_probe.py run build/probe-layout --json out.json  # on the GPU

``run`` times float16, int8 and e4m3 caches in both layouts at each shape (``--shapes``), at
the split counts the ops choose (``*`` full precision, ``8`` an 8-bit cache) and at the others
of :data:`SPLITS` (``--splits``) (CUDA graphs, L2 flushed; 8 KV heads x 128,
GQA 4, page 16), and checks each 8-bit result against the float16 cache's within the
quantization's error.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SHAPES = [(16, 4096), (64, 4096), (256, 1024)]
SPLITS = [2, 4, 6, 7, 8, 9, 12, 16]
CACHES = ["float16", "int8", "float8_e4m3fn"]
SHORT = {"float16": "f16", "int8": "i8", "float8_e4m3fn": "e4m3"}
LAYOUTS = ["nhd", "hnd"]
H, G, D, PAGE = 8, 4, 128, 16


def _spec(storage: str, layout: str):
    from kvtvm import compiler

    quant = storage != "float16"
    return compiler.KernelSpec("decode", "float16", D, H, G, layout=layout, target="cuda",
                               arch="sm_90a", k_storage=storage if quant else None,
                               v_storage=storage if quant else None)


def build(out: Path) -> None:
    from kvtvm import compiler

    paths = {}
    for storage in CACHES:
        for layout in LAYOUTS:
            spec = _spec(storage, layout)
            paths[f"{storage} {layout}"] = [str(compiler.build_spec(spec, out).relative_to(out)),
                                            spec.func_name]
    (out / "layout.json").write_text(json.dumps(paths, indent=1))
    print(json.dumps(paths, indent=1))


def _caches(case, storage: str, layout: str):
    """The case's nhd float16 K and V stored as ``storage`` in ``layout`` (rows unchanged)."""
    from kvtvm.bench.quant_cases import cache_as

    k, v = cache_as(case["k_cache"], storage), cache_as(case["v_cache"], storage)
    if layout == "hnd":
        k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    return k, v


def timing(out: Path, paths: dict, repeat: int, shapes=SHAPES, splits_list=SPLITS) -> list:
    import torch

    from kvtvm import runtime
    from kvtvm.bench.common import timed
    from kvtvm.bench.decode import make_case
    from kvtvm.ops import decode as decode_op

    fns = {}
    for name, (rel, func) in paths.items():
        fns[name] = runtime.load_module(str(out / rel), needs_cuda=True)[func]
    rows = []
    old = decode_op.kernel_for
    try:
        for batch, ctx in shapes:
            case = make_case(batch, ctx, H, G, D, PAGE, "float16", "cuda")
            q, lengths, table = case["q"], case["lengths"], case["table"]
            auto = decode_op.choose_num_splits(batch, H, table.shape[1] * PAGE,
                                               torch.device("cuda"))
            auto8 = decode_op.choose_num_splits(batch, H, table.shape[1] * PAGE,
                                                torch.device("cuda"), quantized=True)
            stored = {}
            for storage in CACHES:
                for layout in LAYOUTS:
                    stored[storage, layout] = _caches(case, storage, layout)
            ref = None
            for splits in sorted(set(splits_list) | {auto, auto8}):
                row = {"batch": batch, "ctx": ctx, "splits": splits, "auto": splits == auto,
                       "auto_8bit": splits == auto8}
                mark = ("*" if splits == auto else " ") + ("8" if splits == auto8 else " ")
                line = f"{batch:4d} x {ctx:5d} splits {splits:3d}{mark}"
                for (storage, layout), (k, v) in stored.items():
                    fn = fns[f"{storage} {layout}"]
                    decode_op.kernel_for = lambda *a, _fn=fn, **kw: _fn

                    def call(k=k, v=v, layout=layout):
                        return decode_op.decode_attention(q, k, v, lengths, table, layout=layout,
                                                          num_splits=splits)

                    got = call()[0].float()
                    if ref is None:
                        ref = got
                    err = (got - ref).abs().max().item()
                    ms = 1e3 * timed(call, "cuda", repeat, 5, "graph")[0]
                    key = f"{storage}_{layout}"
                    row[f"{key}_ms"], row[f"{key}_err"] = ms, err
                    line += f" | {SHORT[storage]} {layout} {ms:.4f}"
                    if err > 0.05:
                        line += f" (err {err:.2e})"
                for layout in LAYOUTS:
                    f16 = row[f"float16_{layout}_ms"]
                    line += f" || {layout} i8 {f16 / row[f'int8_{layout}_ms']:.2f}x" \
                            f" e4m3 {f16 / row[f'float8_e4m3fn_{layout}_ms']:.2f}x"
                rows.append(row)
                print(line, flush=True)
            del case, stored
            torch.cuda.empty_cache()
    finally:
        decode_op.kernel_for = old
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["build", "run"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--json")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--shapes", nargs="+", default=None,
                        help="BATCHxCTX shapes (default: %s)" % " ".join(
                            f"{b}x{c}" for b, c in SHAPES))
    parser.add_argument("--splits", nargs="+", type=int, default=SPLITS)
    args = parser.parse_args()
    if args.mode == "build":
        build(args.out)
        return
    import torch

    paths = json.loads((args.out / "layout.json").read_text())
    shapes = [tuple(int(v) for v in t.lower().split("x")) for t in args.shapes] \
        if args.shapes else SHAPES
    result = {"device": torch.cuda.get_device_name(), "splits": args.splits,
              "timing": timing(args.out, paths, args.repeat, shapes, args.splits)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
