"""Tune the kernels examples/serve.py runs on its toy workload (``--model toy``: the random
4-layer Llama, 2 KV heads of 32, GQA 4, float32), on the shapes it runs them with, and show
the serving speed before and after. Not SmolLM2's kernels (``make demo``: 3 KV heads of 64,
GQA 3): tune those with ``python -m kvtvm tune --op decode --dtype float32 --head-dim 64
--kv-heads 3 --group-size 3`` (and ``--op prefill`` / ``append``).

1. Serve the demo workload once while recording every kernel launch: which specs are loaded
   (append, prefill, decode, copy for the linear cache) and, per spec, the arguments of its
   largest call in the run (the real cache views, tables and queries of a serving step).
2. ``kvtvm.tune.tune(spec, "cpu", ...)`` each spec on that recorded call: every knob setting of
   the spec's schedule is built, checked against the default build's output and timed.
3. Measure serving tokens/s with the knobs in use before tuning and with the tuned ones, each
   in a fresh process (the check against transformers off), alternating ``--rounds`` times
   so a busy machine slows both alike; the best figure of each counts.

By default the tuning logs go to a temporary copy of ``tuning_logs/`` that only this script's
processes read; ``--write`` writes them into the package's ``tuning_logs/`` instead, so every
later build uses them.

    python examples/autotune.py                     # the paged cache's specs, logs in /tmp
    python examples/autotune.py --cache linear --max-trials 12
    python examples/autotune.py --write             # keep the tuned knobs
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def _serve_module():
    spec = importlib.util.spec_from_file_location("kvtvm_example_serve", HERE / "serve.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def use_tuning_logs(root: Path) -> None:
    """Make this process read (and digest) tuning logs under ``root`` instead of the
    package's ``tuning_logs/``."""
    os.environ["KVTVM_TUNING_LOGS"] = str(root)


# ------------------------------------------------------------------------------------------
# Recording the kernels a serving run launches
# ------------------------------------------------------------------------------------------

#: Which launch arguments each op writes (compared between tuning candidates).
OUTPUTS = {"append": (0, 1), "prefill": (6, 7), "decode": (5,), "copy": (0,)}


def _clone(x):
    """A copy of a launch argument with the same sizes *and strides* (cache views stay
    strided views, as the kernels see them when serving)."""
    if isinstance(x, torch.Tensor):
        c = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
        c.copy_(x)
        return c
    return x


def _work(op: str, args) -> int:
    """Size of a call, to keep the largest: rows of new tokens (queries, or K rows)."""
    t = args[2] if op == "append" else args[0]
    return int(t.shape[0]) if isinstance(t, torch.Tensor) else 0


def record_serving_kernels(serve, cache: str, model):
    """Serve the demo workload; return ``({KernelSpec: args of its largest call},
    seconds in kernel launches, seconds serving)``."""
    import time

    import kvtvm.ops  # noqa: F401  (loads every op module)
    from kvtvm import compiler
    from kvtvm.ops import launch

    recorded, spec_of = {}, {}
    in_kernels = [0.0]
    original_kernel, original_run = launch._kernel, launch.Launch.run

    def kernel_spy(spec_items, target, search_key):
        fn = original_kernel(spec_items, target, search_key)
        spec_of[id(fn)] = (fn, spec_items)  # fn kept alive: its id stays its own
        return fn

    def run_spy(self):
        known = spec_of.get(id(self.fn))
        if known is not None:
            key, args = known[1], tuple(self.slots.values())
            op = dict(key)["op"]
            if key not in recorded or _work(op, args) >= _work(op, recorded[key]):
                recorded[key] = tuple(_clone(a) for a in args)
        t0 = time.perf_counter()
        try:
            return original_run(self)
        finally:
            in_kernels[0] += time.perf_counter() - t0

    launch._kernel = kernel_spy
    engine = serve.Engine(model, cache, num_pages=20)   # the demo's cache geometry
    engine.log = lambda msg: None
    engine.warmup()                           # load (or build) the kernels before timing
    launch.Launch.run = run_spy
    try:
        engine.serve(serve.demo_requests(model.config.vocab_size, engine.max_seq_len))
    finally:
        launch._kernel, launch.Launch.run = original_kernel, original_run
    specs = {compiler.KernelSpec(target="llvm", **dict(k)): v for k, v in recorded.items()}
    return specs, in_kernels[0], engine.stats.seconds


# ------------------------------------------------------------------------------------------
# Measuring serving speed (in a fresh process, so freshly built kernels are loaded)
# ------------------------------------------------------------------------------------------


def measure(cache: str, runs: int, log_root: str | None, threads: int) -> float:
    """Best serving tokens/s of ``runs`` runs in a child process reading ``log_root``."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure-only", "--cache", cache,
           "--runs", str(runs), "--torch-threads", str(threads)]
    if log_root:
        cmd += ["--log-root", log_root]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"serving measurement failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["tokens_per_second"]


def _measure_here(cache: str, runs: int) -> float:
    serve = _serve_module()
    model = serve.build_model()
    best = 0.0
    for _ in range(runs):
        engine, _, _ = serve.run(cache, model=model, quiet=True, verify=False)
        best = max(best, engine.stats.tokens_per_second)
    return best


def tune_recorded(recorded: dict, max_trials: int, repeat: int, log_root):
    """Yield ``(spec, entry)`` for each recorded spec: ``kvtvm.tune.tune`` run on the spec's
    recorded serving call (``entry`` None when its schedule declares no knobs)."""
    from kvtvm import compiler
    from kvtvm import tune as kvtune

    def serving_inputs(spec):
        call = tuple(_clone(a) for a in recorded[spec])
        return call, tuple(call[i] for i in OUTPUTS[spec.op])

    for spec in recorded:  # tune each kernel on its recorded serving call
        if spec.op not in OUTPUTS or not compiler.knob_space(spec):
            yield spec, None
            continue
        print(f"tuning {spec.uri} ({max_trials} candidates)", flush=True)
        yield spec, kvtune.tune(spec, "cpu", max_trials=max_trials, repeat=repeat,
                                log_root=log_root, write=True, inputs=serving_inputs(spec))


def package_logs_dir() -> Path:
    """The package's ``tuning_logs/`` directory."""
    from kvtvm import compiler

    return compiler.tuning_logs_dir()


# ------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default="paged", choices=("paged", "continuous", "linear"),
                        help="serve with this manager (picks the specs: nhd or hnd layout)")
    parser.add_argument("--max-trials", type=int, default=8,
                        help="knob settings tried per spec (the default first)")
    parser.add_argument("--repeat", type=int, default=20, help="timed runs per candidate")
    parser.add_argument("--runs", type=int, default=2, help="serving runs per measurement")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating before/after measurements (the best of each counts)")
    parser.add_argument("--write", action="store_true",
                        help="write the logs into the package's tuning_logs/ (default: a "
                             "temporary directory)")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--log-root", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.torch_threads)

    if args.measure_only:   # child process: report tokens/s as JSON
        if args.log_root:
            use_tuning_logs(Path(args.log_root))
        tps = _measure_here(args.cache, args.runs)
        print(json.dumps({"tokens_per_second": tps}))
        return 0

    tmp = None
    if args.write:
        log_root = None
        print("tuning logs: writing into the package's tuning_logs/")
    else:
        tmp = tempfile.mkdtemp(prefix="kvtvm-autotune-")
        log_root = Path(tmp) / "tuning_logs"
        if package_logs_dir().is_dir():
            shutil.copytree(package_logs_dir(), log_root)
        else:
            log_root.mkdir(parents=True)
        print(f"tuning logs: {log_root} (temporary; --write keeps them in the package)")

    # the knobs in use now (for the "before" figure): a copy of the logs as they are
    before_root = Path(tempfile.mkdtemp(prefix="kvtvm-autotune-before-")) / "tuning_logs"
    if package_logs_dir().is_dir():
        shutil.copytree(package_logs_dir(), before_root)
    else:
        before_root.mkdir(parents=True)

    if log_root is not None:
        use_tuning_logs(log_root)
    serve = _serve_module()
    model = serve.build_model()
    recorded, kernel_s, serving_s = record_serving_kernels(serve, args.cache, model)
    print(f"the serving run loads {len(recorded)} kernels: "
          + ", ".join(s.uri for s in recorded))
    print(f"kernel launches take {1e3 * kernel_s:.0f} ms of its {1e3 * serving_s:.0f} ms "
          f"({100 * kernel_s / serving_s:.0f}%; the rest is the torch model and Python)")

    results = []
    for spec, entry in tune_recorded(recorded, args.max_trials, args.repeat, log_root):
        if entry is None:
            print(f"{spec.uri}: no knob space, skipped")
            continue
        failed = [t for t in entry["trials"] if "error" in t]
        results.append((spec.uri, entry["default_ms"], entry["median_ms"], entry["knobs"]))
        print(f"  default {entry['default_ms']:.4f} ms -> best {entry['median_ms']:.4f} ms "
              f"{entry['knobs']} ({len(failed)} candidates skipped); {entry['path']}")

    print(f"serving speed, default vs tuned knobs, alternating ({args.rounds} rounds of best of "
          f"{args.runs} runs, {args.cache} cache) ...", flush=True)
    before, after = 0.0, 0.0
    for i in range(args.rounds):
        b = measure(args.cache, args.runs, str(before_root), args.torch_threads)
        a = measure(args.cache, args.runs, str(log_root) if log_root else None,
                    args.torch_threads)
        print(f"  round {i + 1}: {b:.1f} tokens/s before, {a:.1f} after", flush=True)
        before, after = max(before, b), max(after, a)
    print()
    print(f"{'kernel':<40} {'default ms':>11} {'tuned ms':>9}")
    for uri, d, b, _ in results:
        print(f"{uri:<40} {d:>11.4f} {b:>9.4f}")
    print(f"serving ({args.cache}): {before:.1f} tokens/s before, {after:.1f} tokens/s after "
          f"({after / before:.2f}x)")
    print("(on a shared or busy CPU the run-to-run spread of the serving figure can exceed "
          "what the kernels gain; compare the per-kernel times above)")
    shutil.rmtree(before_root.parent, ignore_errors=True)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
