"""Is the tensor-core decode over an 8-bit cache (``schedules/decode/cuda_quant_mma.py``, knob
``mma``, the default where it runs) right, and how do its knobs and the CUDA-core kernel (``mma``
0) compare? (2026-11-27, H100 and H200: docs/PERF.md.)

Here (compiler + nvcc): ``python tools/gpu_decode_mma_probe.py build build/probe-mma``
On the GPU machine, after ``source tools/gpu-env.sh`` (the kit's kernels on KVTVM_KERNEL_PATH):
``python3 tools/gpu_decode_mma_probe.py run build/probe-mma [--json FILE]``

- numerics: every NUMERICS spec (int8, e4m3 and mixed K/V; GQA 1-8; head_dim 64 and 128; nhd and
  hnd; pages of 1, 16 and 256; 1-4 KV splits; ragged lengths with an empty-ish sequence and
  sequences ending mid-tile) through ``ops.decode_attention`` with the probe's kernel, against
  the float64 numpy reference over the dequantized cache, relative to each output's size
  (attention over |V|);
- speed: the benchmark's Llama-3-8B layer (8 KV heads x 128, GQA 4, page 16) over int8 and e4m3
  at batch x context shapes, each knob set of TIMING against what the ops run (the tuned build
  or ``short_splits``) and the float16 cache; CUDA-graph replays, L2 flushed.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

#: (name, k_storage, v_storage, group, head_dim, layout, page_size, splits); queries float16, or
#: bfloat16 where the name starts "bf16"
NUMERICS = [
    ("i8 g4 d128 nhd p16 s1", "int8", "int8", 4, 128, "nhd", 16, 1),
    ("i8 g4 d128 nhd p1 s4", "int8", "int8", 4, 128, "nhd", 1, 4),
    ("i8 g4 d128 hnd p256 s2", "int8", "int8", 4, 128, "hnd", 256, 2),
    ("e4m3 g4 d128 nhd p16 s3", "float8_e4m3fn", "float8_e4m3fn", 4, 128, "nhd", 16, 3),
    ("e4m3 g8 d64 hnd p16 s1", "float8_e4m3fn", "float8_e4m3fn", 8, 64, "hnd", 16, 1),
    ("i8 g1 d128 nhd p16 s2", "int8", "int8", 1, 128, "nhd", 16, 2),
    ("i8/e4m3 g3 d64 nhd p16 s1", "int8", "float8_e4m3fn", 3, 64, "nhd", 16, 1),
    ("e4m3/i8 g8 d128 nhd p16 s2", "float8_e4m3fn", "int8", 8, 128, "nhd", 16, 2),
    ("i8 g4 d128 nhd p16 s1 single", "int8", "int8", 4, 128, "nhd", 16, 1),
    ("bf16 i8 g4 d128 nhd p16 s2", "int8", "int8", 4, 128, "nhd", 16, 2),
    ("bf16 e4m3 g8 d64 hnd p16 s1", "float8_e4m3fn", "float8_e4m3fn", 8, 64, "hnd", 16, 1),
    ("bf16 i8/e4m3 g1 d128 nhd p1 s3", "int8", "float8_e4m3fn", 1, 128, "nhd", 1, 3),
    # one side 16-bit (knob mma set; not yet the default: these cases are its first numerics)
    ("i8/f16 g4 d128 nhd p16 s2", "int8", "", 4, 128, "nhd", 16, 2),
    ("f16/e4m3 g4 d128 hnd p16 s1", "", "float8_e4m3fn", 4, 128, "hnd", 16, 1),
    ("e4m3/f16 g8 d64 nhd p1 s3", "float8_e4m3fn", "", 8, 64, "nhd", 1, 3),
    ("f16/i8 g1 d32 nhd p256 s2", "", "int8", 1, 32, "nhd", 256, 2),
    ("bf16 i8/bf16 g4 d128 nhd p16 s2", "int8", "", 4, 128, "nhd", 16, 2),
    ("bf16 bf16/e4m3 g3 d64 hnd p16 s1", "", "float8_e4m3fn", 3, 64, "hnd", 16, 1),
]

N_KV = 2
#: knob sets timed at the benchmark shape (threads -> warps, tile_tokens, stages; p_split: P
#: rounded to float16 once, or as hi + lo), and the CUDA-core kernel (mma 0, its tuning log)
TIMING = [{"threads": 128, "tile_tokens": 64, "stages": 2, "p_split": 1},
          {"threads": 64, "tile_tokens": 32, "stages": 3, "p_split": 1},
          {"threads": 128, "tile_tokens": 64, "stages": 2, "p_split": 0},
          {"threads": 64, "tile_tokens": 32, "stages": 3, "p_split": 0},
          {"mma": 0}]
#: K-only and V-only caches timed on the tensor cores (``one_sided_knobs``) and as the ops run them
ONE_SIDED = [("int8", None), (None, "float8_e4m3fn")]
SHAPES = [(1, 4096), (1, 32768), (16, 4096), (64, 4096), (256, 1024)]
H, G, D, PAGE = 8, 4, 128, 16


def _dtype(name: str) -> str:
    return "bfloat16" if name.startswith("bf16") else "float16"


def _spec(ks, vs, group, head_dim, layout, n_kv, knobs, dtype="float16"):
    from kvtvm import compiler

    return compiler.KernelSpec("decode", dtype, head_dim, n_kv, group, layout=layout,
                               target="cuda", arch="sm_90a", k_storage=ks, v_storage=vs,
                               knobs=dict({"mma": 1}, **knobs))


def build(out: Path) -> None:
    from kvtvm import compiler
    from kvtvm.schedules.decode.cuda_quant_mma import one_sided_knobs

    paths = {"numerics": {}, "timing": {}}
    for name, ks, vs, group, hd, layout, *_ in NUMERICS:
        # the knobs the ops use (defaults, tuning log), the single-rounding P for one case
        knobs = {"p_split": 0} if "single" in name else {}
        spec = _spec(ks or None, vs or None, group, hd, layout, N_KV, knobs, _dtype(name))
        if not (ks and vs):  # one side 16-bit: the knobs that take it to the tensor cores
            spec = _spec(ks or None, vs or None, group, hd, layout, N_KV,
                         one_sided_knobs(spec), _dtype(name))
        paths["numerics"][name] = [str(compiler.build_spec(spec, out).relative_to(out)),
                                   spec.func_name]
    for st in ("int8", "float8_e4m3fn"):
        for i, knobs in enumerate(TIMING):
            spec = _spec(st, st, G, D, "nhd", H, knobs)
            paths["timing"][f"{st} {i}"] = [str(compiler.build_spec(spec, out).relative_to(out)),
                                            spec.func_name]
    for ks, vs in ONE_SIDED:
        spec = _spec(ks, vs, G, D, "nhd", H, {})
        spec = _spec(ks, vs, G, D, "nhd", H, one_sided_knobs(spec))
        paths["timing"][f"{ks}/{vs}"] = [str(compiler.build_spec(spec, out).relative_to(out)),
                                         spec.func_name]
    (out / "mma.json").write_text(json.dumps(paths, indent=1))
    print(json.dumps(paths, indent=1))


class _Use:
    """``ops.decode_attention`` with the given loaded kernel (None: the kit's)."""

    def __init__(self, fn):
        self.fn = fn

    def __enter__(self):
        from kvtvm.ops import decode as decode_op

        self._old = decode_op.kernel_for
        if self.fn is not None:
            decode_op.kernel_for = lambda *a, **k: self.fn
        return self

    def __exit__(self, *exc):
        from kvtvm.ops import decode as decode_op

        decode_op.kernel_for = self._old


def _load(out: Path, entry: list):
    from kvtvm import runtime

    rel, func_name = entry
    mod = runtime.load_module(str(out / rel), needs_cuda=True)
    return mod, mod[func_name]


def numerics(out: Path, paths: dict) -> list:
    import ml_dtypes
    import numpy as np
    import torch

    from kvtvm import ops
    from kvtvm.kernels.reference import reference_decode
    from kvtvm.quant import dequantize_rows, quantize_rows

    rows = []
    for name, ks, vs, group, hd, layout, ps, splits in NUMERICS:
        rng = np.random.default_rng(7)
        lengths = [0, 1, 2 * ps - 1, 37, 300, 2600]
        need = [-(-(n + 1) // ps) for n in lengths]
        num_pages = sum(need) + 2
        perm = rng.permutation(num_pages)
        table = np.full((len(lengths), max(need)), 0, np.int32)
        at = 0
        for i, n in enumerate(need):
            table[i, :n] = perm[at:at + n]
            at += n
        shape = (num_pages, ps, N_KV, hd) if layout == "nhd" else (num_pages, N_KV, ps, hd)
        caches, host = [], []
        for st in (ks, vs):
            x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(
                0.05, 6, (num_pages,) + (1,) * 3).astype(np.float32)
            x[..., 3] *= 30  # an outlier channel
            if not st:  # a 16-bit side: the queries' dtype, as stored
                values = torch.from_numpy(x).to(getattr(torch, _dtype(name)))
                caches.append(values.cuda())
                host.append(values.float().numpy())
                continue
            raw = quantize_rows(x, st).view(np.int8)
            caches.append(torch.from_numpy(raw).cuda().view(getattr(torch, st)))
            host.append(raw.view(np.int8 if st == "int8" else ml_dtypes.float8_e4m3fn))
        q = torch.randn(len(lengths), N_KV * group, hd, dtype=getattr(torch, _dtype(name)),
                        device="cuda")
        lens = torch.tensor(lengths, dtype=torch.int32)
        want, want_lse = reference_decode(q.float().cpu().numpy(), *host, lens.numpy(), table,
                                          layout=layout)
        _, fn = _load(out, paths[name])
        with _Use(fn):
            got, lse = ops.decode_attention(q, *caches, lens.cuda(),
                                            torch.from_numpy(table).cuda(), layout=layout,
                                            num_splits=splits)
        torch.cuda.synchronize()
        got = got.float().cpu().numpy()
        err = float(np.abs(got - want).max())
        lse_err = float(np.abs(lse.cpu().numpy() - want_lse).max())
        # relative to each output's own size: attention over |V| (what a rounded P scales)
        mag, _ = reference_decode(q.float().cpu().numpy(), host[0], np.abs(
            dequantize_rows(host[1], hd) if vs else host[1]), lens.numpy(), table, layout=layout)
        rel = float((np.abs(got - want) / (np.abs(want) + mag + 1e-3)).max())
        # the float16 output's own rounding is half an ulp, 2**-12 relative (2.44e-4): the
        # split P stays within it (H100 and H200, 2026-11-27: 2.34-2.42e-4); a single float16
        # P adds its own 2**-12 per weight (4e-4); bfloat16's half ulp is 2**-9 (1.95e-3)
        bound = 2e-3 if name.startswith("bf16") else 1e-3 if "single" in name else 2.5e-4
        ok = rel < bound and lse_err < 1e-3
        rows.append(dict(case=name, max_abs_err=err, max_rel_err=rel, lse_err=lse_err, ok=ok))
        print(f"numerics {name:30s} max |out - ref| {err:.2e} (relative {rel:.2e})  "
              f"|lse - ref| {lse_err:.2e}  {'ok' if ok else 'WRONG'}", flush=True)
    return rows


def timing(out: Path, paths: dict, repeat: int) -> list:
    import torch

    from kvtvm.bench.common import timed
    from kvtvm.bench.decode import make_case
    from kvtvm.bench.quant_cases import cache_as
    from kvtvm.ops import decode as decode_op

    fns = {name: _load(out, rel) for name, rel in paths.items()}
    rows = []
    for batch, ctx in SHAPES:
        case = make_case(batch, ctx, H, G, D, PAGE, "float16", "cuda")
        q, lengths, table = case["q"], case["lengths"], case["table"]
        splits = decode_op.choose_num_splits(batch, H, table.shape[1] * PAGE, torch.device("cuda"))

        def call(k, v):
            return lambda: decode_op.decode_attention(q, k, v, lengths, table, num_splits=splits)

        row = {"batch": batch, "ctx": ctx, "splits": splits}
        row["float16_ms"] = 1e3 * timed(call(case["k_cache"], case["v_cache"]), "cuda", repeat,
                                        5, "graph")[0]
        line = f"{batch:4d} x {ctx:6d} splits {splits:3d} f16 {row['float16_ms']:.4f} ms"
        for st in ("int8", "float8_e4m3fn"):
            k, v = cache_as(case["k_cache"], st), cache_as(case["v_cache"], st)
            want, _ = call(k, v)()
            ms = 1e3 * timed(call(k, v), "cuda", repeat, 5, "graph")[0]
            row[f"{st}_ops_ms"] = ms
            line += f" | {st} ops {ms:.4f} ({row['float16_ms'] / ms:.2f}x)"
            for i in range(len(TIMING)):
                with _Use(fns[f"{st} {i}"][1]):
                    got, _ = call(k, v)()
                    err = (got.float() - want.float()).abs().max().item()
                    ms = 1e3 * timed(call(k, v), "cuda", repeat, 5, "graph")[0]
                row[f"{st}_mma{i}_ms"], row[f"{st}_mma{i}_err"] = ms, err
                line += f" mma{i} {ms:.4f} (f16/mma {row['float16_ms'] / ms:.2f}x, err {err:.1e})"
            del k, v
        for ks, vs in ONE_SIDED:  # the ops' CUDA-core kernel, then the tensor cores
            k = cache_as(case["k_cache"], ks) if ks else case["k_cache"]
            v = cache_as(case["v_cache"], vs) if vs else case["v_cache"]
            want, _ = call(k, v)()
            ops_ms = 1e3 * timed(call(k, v), "cuda", repeat, 5, "graph")[0]
            with _Use(fns[f"{ks}/{vs}"][1]):
                got, _ = call(k, v)()
                err = (got.float() - want.float()).abs().max().item()
                ms = 1e3 * timed(call(k, v), "cuda", repeat, 5, "graph")[0]
            row[f"{ks}/{vs}_ops_ms"], row[f"{ks}/{vs}_mma_ms"] = ops_ms, ms
            row[f"{ks}/{vs}_mma_err"] = err
            line += (f" | {ks}/{vs} ops {ops_ms:.4f} ({row['float16_ms'] / ops_ms:.2f}x) mma "
                     f"{ms:.4f} ({row['float16_ms'] / ms:.2f}x, err {err:.1e})")
            del k, v
        rows.append(row)
        print(line, flush=True)
        del case
        torch.cuda.empty_cache()
    return rows


def run(out: Path, json_path: str | None, repeat: int) -> None:
    import torch

    paths = json.loads((out / "mma.json").read_text())
    result = {"device": torch.cuda.get_device_name(), "timing_knobs": TIMING,
              "scale": 1 / math.sqrt(D)}
    result["numerics"] = numerics(out, paths["numerics"])
    if repeat:
        result["timing"] = timing(out, paths["timing"], repeat)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))
    bad = [r["case"] for r in result["numerics"] if not r["ok"]]
    print(f"numerics: {len(result['numerics']) - len(bad)} ok, {len(bad)} wrong {bad}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["build", "run"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--json")
    parser.add_argument("--repeat", type=int, default=30, help="0: numerics only")
    args = parser.parse_args()
    if args.mode == "build":
        build(args.out)
    else:
        run(args.out, args.json, args.repeat)


if __name__ == "__main__":
    main()
