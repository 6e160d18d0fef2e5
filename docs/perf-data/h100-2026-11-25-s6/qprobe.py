"""Quantized CUDA kernels: build candidates here (`build`), time/check them on the GPU (`run`).

    python .scratch/qprobe.py build              # here: build/qprobe/
    python3 .scratch/qprobe.py run --json $OUT/q.json   # there, after source tools/gpu-env.sh
"""
import argparse, json, math, sys, time, traceback
from pathlib import Path

ROOT = Path("build/qprobe")
FUNC = "kvtvm_decode"
STORAGES = ("int8", "float8_e4m3fn")
BASE = dict(threads=128, merge_threads=256)
DECODE_KNOBS = [
    dict(BASE, tile_tokens=32, stages=2, vec=8),
    dict(BASE, tile_tokens=64, stages=2, vec=8),
    dict(BASE, tile_tokens=32, stages=3, vec=8),
    dict(BASE, tile_tokens=32, stages=2, vec=4),
    dict(BASE, threads=256, tile_tokens=32, stages=2, vec=8),
    dict(BASE, threads=64, tile_tokens=32, stages=2, vec=8),
    dict(BASE, tile_tokens=16, stages=4, vec=8),
    dict(BASE, tile_tokens=64, stages=2, vec=4),
]


def specs():
    from kvtvm import compiler
    out = []
    for st in STORAGES:
        for i, kn in enumerate(DECODE_KNOBS):
            out.append((f"decode-{st}-{i}", compiler.KernelSpec(
                "decode", "float16", 128, 8, 4, layout="nhd", target="cuda", arch="sm_90a",
                k_storage=st, v_storage=st, knobs=kn)))
    out.append(("decode-fp16", compiler.KernelSpec("decode", "float16", 128, 8, 4, layout="nhd",
                                                   target="cuda", arch="sm_90a")))
    return out


def build_copy(index):
    """The CUDA copy kernel with 1, 2, 4 vectors per thread and, for the check's cost only,
    the same without its check."""
    from kvtvm import compiler
    from kvtvm.kernels._tvm import T
    for vpt in (1, 2, 4):
        knobs = {"vector_bytes": 16, "threads": 256, "vectors_per_thread": vpt}
        spec = compiler.KernelSpec("copy", "float16", 128, 1, 1, layout="nhd", target="cuda",
                                   arch="sm_90a", knobs=knobs)
        cuda = compiler.schedule_module(spec)
        index[f"copy-checked-v{vpt}"] = str(compiler.build_spec(spec, ROOT / f"copy-checked-v{vpt}"))
        keep = cuda._in_rows
        cuda._in_rows = lambda s, d, rows: T.bool(True)
        try:
            index[f"copy-nocheck-v{vpt}"] = str(compiler.build_spec(spec, ROOT / f"copy-nocheck-v{vpt}"))
        finally:
            cuda._in_rows = keep


def build(copy_only=False):
    from kvtvm import compiler
    index = {}
    build_copy(index)
    if copy_only:
        (ROOT / "index.json").write_text(json.dumps(index, indent=1))
        return
    for name, spec in specs():
        t = time.time()
        try:
            p = compiler.build_spec(spec, ROOT / name)
            index[name] = str(p)
            rep = p.with_suffix(".ptxas.txt").read_text()
            import re
            regs = re.findall(r"Used (\d+) registers", rep)
            spills = re.findall(r"(\d+) bytes spill stores", rep)
            print(name, f"{time.time()-t:.0f}s regs", regs, "spills", spills, flush=True)
        except Exception as e:
            print(name, "FAILED", str(e).splitlines()[-1][:300], flush=True)
    (ROOT / "index.json").write_text(json.dumps(index, indent=1))


def run(args):
    import torch
    from kvtvm import runtime
    from kvtvm.bench.common import timed
    from kvtvm.bench.decode import make_case
    from kvtvm.bench.quant_cases import cache_as
    from kvtvm.ops import quant as opq
    from kvtvm.ops.decode import choose_num_splits, split_workspace
    from kvtvm.quant import quant_row_bytes
    for key, val in {}.items():
        opq.QUANT_TARGETS[key] = val
    index = json.loads((ROOT / "index.json").read_text())
    res = {"device": torch.cuda.get_device_name(), "rows": []}
    dev = torch.device("cuda")
    H, G, D = 8, 4, 128
    copies = {k: index.pop(k) for k in list(index) if k.startswith("copy")}
    index = dict(sorted(index.items(), key=lambda kv: kv[0] != "decode-fp16"))  # fp16 first
    from kvtvm.bench.copy import make_case as copy_case
    for case, pages, n in [("cow 64 of 8192", 8192, 64), ("move 1024 of 8192", 8192, 1024),
                           ("cow 4 of 8192", 8192, 4)] * 2:
        blocks, src, dst = copy_case(pages, n, 8, 128, "float16", "cuda")
        moved = 2 * n * blocks[0].numel() * blocks.element_size()
        view = blocks.view(1, pages, -1, 128)
        want = blocks.clone(); want[dst.long()] = blocks[src.long()]
        sl, dl = src.long(), dst.long()
        def tc():
            blocks[dl] = blocks[sl]
        sec, _ = timed(tc, "cuda", 50, 5, "graph")
        print(f"copy {case:20s} torch   {sec*1e6:8.1f} us {moved/sec/1e12:.2f} TB/s", flush=True)
        res["rows"].append(dict(name="copy-torch", shape=case, us=sec * 1e6))
        for name, path in copies.items():
            fn = runtime.load_module(path, needs_cuda=True)["kvtvm_copy"]
            err = torch.zeros(4, dtype=torch.int32, device=dev)
            fn(view, src, dst, err)
            torch.cuda.synchronize()
            ok = torch.equal(blocks, want)
            sec, _ = timed(lambda: fn(view, src, dst, err), "cuda", 50, 5, "graph")
            print(f"copy {case:20s} {name:14s} {sec*1e6:8.1f} us {moved/sec/1e12:.2f} TB/s correct={ok}", flush=True)
            res["rows"].append(dict(name=name, shape=case, us=sec * 1e6, correct=ok))
    dev = torch.device("cuda")
    H, G, D = 8, 4, 128
    scale = 1 / math.sqrt(D)
    if not index:
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        return
    from kvtvm import ops
    for ntok, per_seq in [(64, 1), (16384, 1024)]:
        batch = ntok // per_seq
        pages = batch * (-(-(per_seq + 8) // 16))
        k = torch.randn(ntok, H, D, dtype=torch.float16, device=dev)
        v = torch.randn(ntok, H, D, dtype=torch.float16, device=dev)
        indptr = torch.arange(0, ntok + 1, per_seq, dtype=torch.int32, device=dev)
        lens = torch.full((batch,), 8, dtype=torch.int32, device=dev)
        table = torch.arange(pages, dtype=torch.int32, device=dev).view(batch, -1)
        for st in ("float16", "int8", "float8_e4m3fn"):
            w = D if st == "float16" else quant_row_bytes(D)
            dt = torch.float16 if st == "float16" else torch.int8
            kc = torch.zeros(pages, 16, H, w, dtype=dt, device=dev)
            vc = torch.zeros_like(kc)
            if st != "float16":
                kc, vc = kc.view(getattr(torch, st)), vc.view(getattr(torch, st))
            launch = ops.prepare_append_kv(kc, vc, k, v, indptr, lens, table, check_indices=False)
            launch.run(); torch.cuda.synchronize()
            sec, _ = timed(launch.run, "cuda", 50, 5, "graph")
            print(f"append {ntok:6d} tokens {st:14s} {sec*1e6:8.1f} us", flush=True)
            res["rows"].append(dict(name=f"append-{st}", shape=f"{ntok}", us=sec * 1e6))
    shapes = [(64, 4096), (16, 4096), (1, 32768), (128, 2048), (256, 1024)]
    for batch, ctx in shapes:
        case = make_case(batch, ctx, H, G, D, 16, "float16", "cuda")
        del case["k_dense"], case["v_dense"]
        caches = {"fp16": (case["k_cache"], case["v_cache"])}
        for st in STORAGES:
            caches[st] = (cache_as(case["k_cache"], st), cache_as(case["v_cache"], st))
        q = case["q"]
        # reference: fp16 kernel output through the op
        want = {}
        for name, path in index.items():
            st = "fp16" if name == "decode-fp16" else name.split("-")[1]
            kc, vc = caches[st]
            if st != "fp16":
                kc, vc = kc.view(torch.int8), vc.view(torch.int8)
            fn = runtime.load_module(path, needs_cuda=True)[FUNC]
            best = None
            for splits in sorted({choose_num_splits(batch, H, ctx, dev), 1, 2, 4, 8, 16, 32}):
                if batch * H * splits > 8192 or (splits > 1 and ctx // splits < 128):
                    continue
                o_part, lse_part = split_workspace(dev, splits, batch, H * G, D)
                out = torch.full_like(q, float("nan"))
                lse = torch.empty(q.shape[:2], dtype=torch.float32, device=dev)
                err = torch.zeros(4, dtype=torch.int32, device=dev)
                a = (q, kc, vc, case["lengths"], case["table"], out, lse, o_part, lse_part, scale, 0, err)
                try:
                    fn(*a)
                    torch.cuda.synchronize()
                except Exception as e:
                    res["rows"].append(dict(name=name, shape=f"{batch}x{ctx}", error=str(e)[:300]))
                    break
                if (batch, ctx, st) not in want:
                    want[(batch, ctx, st)] = out.float().clone()
                    if st != "fp16":
                        errv = (out.float() - want[(batch, ctx, "fp16")]).abs().max().item()
                        res["rows"].append(dict(name=name, shape=f"{batch}x{ctx}", err_vs_fp16=errv))
                else:
                    d = (out.float() - want[(batch, ctx, st)]).abs().max().item()
                    if not d < 2e-2:
                        res["rows"].append(dict(name=name, shape=f"{batch}x{ctx}", splits=splits, mismatch=d))
                        continue
                sec, how = timed(lambda: fn(*a), "cuda", 20, 3, "graph")
                if best is None or sec < best[0]:
                    best = (sec, splits)
            if best:
                row_b = 2 if st == "fp16" else 1
                stored = 2 * batch * ctx * H * (D * 2 if st == "fp16" else quant_row_bytes(D))
                res["rows"].append(dict(name=name, shape=f"{batch}x{ctx}", us=best[0] * 1e6,
                                        splits=best[1], tbs=stored / best[0] / 1e12))
                print(f"{batch}x{ctx} {name:22s} {best[0]*1e6:8.1f} us  splits {best[1]:3d}  {stored/best[0]/1e12:.2f} TB/s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["build", "build-copy", "run"])
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.what == "build-copy":
        build(copy_only=True)
    else:
        build() if a.what == "build" else run(a)
