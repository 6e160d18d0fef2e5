"""``python -m kvtvm.bench e2e``: one request set served several ways, end to end.

The same requests (``--requests`` prompts of each ``--prompt-lens`` length, random tokens,
``--new-tokens`` greedy tokens each, no early stop, all submitted at once) are served by

* ``engine``: kvtvm's reference engine (:class:`kvtvm.engine.Engine`, paged cache);
* ``hf-batch-sdpa`` / ``hf-batch-paged-eager``: transformers' continuous batching
  (``model.generate_batch``) with its own attention (``sdpa``, ``paged|eager``);
* ``hf-batch-kvtvm``: the same on kvtvm's kernels (:mod:`kvtvm.integrations.hf_batch`);
* ``hf-generate-sdpa``: transformers' ``generate`` with sdpa, one request at a time;
* ``hf-generate-kvtvm``: the same on kvtvm (:mod:`kvtvm.integrations.hf`).

``generate_batch`` gets a ``ContinuousBatchingConfig`` sized for the request set
(:func:`kvtvm.integrations.hf_batch.cb_config`): its default sizes the paged cache from free
memory, which on a CPU means most of the host's RAM and seconds of page faults per call.
Every way runs once untimed first (kernels loaded, allocator warm), then ``--repeat`` times,
interleaved (way A, B, ..., A, B, ...), and the median is reported. Reported per way:
generated tokens / wall time (prefill included), mean time to first token (from submission:
one at a time includes the wait for earlier requests) and mean time per output token after the
first; ratios against the best transformers path; for the engine, the share of its decode steps
spent in kvtvm's append + attention calls (timed around the step plan's calls, whose host-side
binding is included).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import time

import numpy as np
import torch

from .. import cliargs
from .common import plot_path

WAYS = ("engine", "hf-batch-sdpa", "hf-batch-paged-eager", "hf-batch-kvtvm",
        "hf-generate-sdpa", "hf-generate-kvtvm")


def _prompts(n, length, vocab, seed=0):
    """``n`` random prompts of ``length`` tokens, clear of the low ids where the special
    tokens usually are (ids >= 100, or the upper half of a vocabulary under 200)."""
    rng = np.random.default_rng(seed + length)
    low = min(100, vocab // 2)
    return [rng.integers(low, vocab - 1, length).tolist() for _ in range(n)]


@contextlib.contextmanager
def kernel_timer():
    """Time kvtvm's step-plan calls and the engine's decode steps: yields a dict whose
    ``kernel_s`` and ``step_s`` grow with every decode step run inside the block."""
    from ..engine.runner import ModelRunner
    from ..plan import StepPlan

    acc = {"kernel_s": 0.0, "step_s": 0.0, "steps": 0}
    live = {"on": False}
    orig = {n: getattr(StepPlan, n) for n in ("append_kv", "attention")}
    orig_step = ModelRunner.run_step

    def timed(fn):
        def wrapper(self, *a, **k):
            if not live["on"]:
                return fn(self, *a, **k)
            t0 = time.perf_counter()
            try:
                return fn(self, *a, **k)
            finally:
                acc["kernel_s"] += time.perf_counter() - t0
        return wrapper

    def step(self, kv, new_tokens, last_only=True):
        live["on"] = all(len(t) == 1 for t in new_tokens)
        t0 = time.perf_counter()
        try:
            return orig_step(self, kv, new_tokens, last_only)
        finally:
            if live["on"]:
                acc["step_s"] += time.perf_counter() - t0
                acc["steps"] += 1
            live["on"] = False

    for n, fn in orig.items():
        setattr(StepPlan, n, timed(fn))
    ModelRunner.run_step = step
    try:
        yield acc
    finally:
        for n, fn in orig.items():
            setattr(StepPlan, n, fn)
        ModelRunner.run_step = orig_step


def _engine(model, prompts, new, step_tokens):
    from ..engine import Engine, Request

    e = Engine(model, "paged", max_batch_size=len(prompts),
               max_seq_len=max(map(len, prompts)) + new, page_size=16, prefix_caching=False,
               eos_token_ids=(), max_step_tokens=step_tokens)
    e.log = lambda s: None
    reqs = [Request(i, p, new) for i, p in enumerate(prompts)]
    with kernel_timer() as acc:
        e.serve(reqs)
    share = acc["kernel_s"] / acc["step_s"] if acc["step_s"] else None
    return dict(tokens=e.stats.generated_tokens, seconds=e.stats.seconds,
                ttft=float(np.mean([r.ttft for r in reqs])),
                tpot=float(np.mean([r.tpot for r in reqs])), kernel_share=share,
                outputs=[list(r.output) for r in reqs],
                decode_step_ms=1e3 * acc["step_s"] / max(acc["steps"], 1))


def _hf_batch(model, prompts, new, attn):
    from transformers import GenerationConfig

    from ..integrations.hf_batch import cb_config, use_kvtvm_batch

    if attn == "kvtvm":
        use_kvtvm_batch(model)
    else:
        model.set_attn_implementation(attn)
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cfg = cb_config(max(map(len, prompts)), new, len(prompts))
    t0 = time.perf_counter()
    try:
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cfg,
                                   warmup=False, record_timestamps=True)
    finally:
        sec = time.perf_counter() - t0
        model.set_attn_implementation("sdpa")
    outs = [out[f"req_{i}"] for i in range(len(prompts))]
    ttft = [o.timestamps[0] - o.created_time for o in outs]
    # one new token has no time per output token after the first: 0, as Request.tpot
    tpot = [(o.timestamps[-1] - o.timestamps[0]) / max(len(o.timestamps) - 1, 1)
            for o in outs]
    return dict(tokens=sum(len(o.generated_tokens) for o in outs), seconds=sec,
                ttft=float(np.mean(ttft)), tpot=float(np.mean(tpot)),
                outputs=[list(o.generated_tokens) for o in outs])


class _Clock:
    """A logits processor that records when each token of ``generate`` is chosen."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def _hf_generate(model, prompts, new, kvtvm: bool):
    from transformers import LogitsProcessorList

    if kvtvm:
        from ..integrations.hf import KVTVMCache, use_kvtvm

        use_kvtvm(model)
    n, ttft, tpot, outputs, t0 = 0, [], [], [], time.perf_counter()
    try:
        for p in prompts:
            ids = torch.tensor([p])
            kw = {"cache": KVTVMCache(model, len(p) + new)} if kvtvm else {}
            clock = _Clock()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                                 logits_processor=LogitsProcessorList([clock]), **kw)
            n += out.shape[1] - ids.shape[1]
            outputs.append(out[0, ids.shape[1]:].tolist())
            ttft.append(clock.times[0] - t0)
            tpot.append((clock.times[-1] - clock.times[0]) / max(len(clock.times) - 1, 1))
    finally:
        model.set_attn_implementation("sdpa")
    return dict(tokens=n, seconds=time.perf_counter() - t0, ttft=float(np.mean(ttft)),
                tpot=float(np.mean(tpot)), outputs=outputs)


def run_way(way, model, prompts, new, args):
    """One timed run of ``way``; torch threads as the way's thread policy says."""
    from ..engine.threads import configure_threads

    if way == "engine" or (args.kvtvm_threads_one and way.endswith("kvtvm")):
        configure_threads(1)        # kvtvm's policy (kvtvm.engine.threads)
    else:
        torch.set_num_threads(args.hf_threads)
    cpu0 = _cpu_seconds()
    if way == "engine":
        res = _engine(model, prompts, new, args.step_tokens)
    elif way.startswith("hf-batch"):
        res = _hf_batch(model, prompts, new, {"hf-batch-sdpa": "sdpa", "hf-batch-kvtvm": "kvtvm",
                                              "hf-batch-paged-eager": "paged|eager"}[way])
    else:
        res = _hf_generate(model, prompts, new, way.endswith("kvtvm"))
    res["torch_threads"] = torch.get_num_threads()
    res["cpu_s"] = _cpu_seconds() - cpu0
    return res


def _cpu_seconds() -> float:
    """CPU seconds this process has used (all threads): on a shared machine, wall time also
    counts the time other processes held the cores."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _row(length, way, runs):
    sec = statistics.median(r["seconds"] for r in runs)
    mid = min(runs, key=lambda r: abs(r["seconds"] - sec))
    row = dict(prompt_len=length, way=way, tokens=mid["tokens"], seconds=sec,
               seconds_all=[round(r["seconds"], 3) for r in runs],
               tokens_per_s=mid["tokens"] / sec, ttft_ms=1e3 * mid["ttft"],
               tpot_ms=1e3 * mid["tpot"], torch_threads=mid["torch_threads"],
               cpu_s=mid["cpu_s"], outputs=mid["outputs"])
    if "kernel_share" in mid:
        row["kernel_share"] = mid["kernel_share"]
        row["decode_step_ms"] = mid["decode_step_ms"]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtvm.bench e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2', 'toy' or a directory")
    parser.add_argument("--requests", type=cliargs.positive_int, default=8)
    parser.add_argument("--prompt-lens", default=[128, 1024], type=cliargs.int_list)
    parser.add_argument("--new-tokens", type=cliargs.positive_int, default=32)
    parser.add_argument("--ways", default=",".join(WAYS), help=f"subset of {','.join(WAYS)}")
    parser.add_argument("--repeat", type=cliargs.positive_int, default=1,
                        help="timed runs per way (median)")
    parser.add_argument("--step-tokens", type=cliargs.positive_int, default=512,
                        help="the engine's max_step_tokens (chunked prefill budget; default "
                        "the engine's own)")
    parser.add_argument("--hf-threads", type=cliargs.positive_int, default=None,
                        help="torch threads of the transformers paths (default: torch's)")
    parser.add_argument("--kvtvm-threads-one", action=argparse.BooleanOptionalAction,
                        default=True, help="run the hf-*-kvtvm ways with torch on one thread, "
                        "as the engine (default yes)")
    parser.add_argument("--json", type=cliargs.output_file, default=None, metavar="PATH")
    parser.add_argument("--plot", type=plot_path, default=None, metavar="PATH.png",
                        help="also draw the results as a bar chart (needs matplotlib)")
    args = parser.parse_args(argv)
    from ..engine import load_model

    ways = list(dict.fromkeys(w.strip() for w in args.ways.split(",") if w.strip()))
    unknown = sorted(set(ways) - set(WAYS))
    if unknown or not ways:   # none: it loaded the model, ran nothing and exited 0
        parser.error(f"--ways: unknown {unknown}; known: {list(WAYS)}" if unknown else
                     f"--ways: expected comma-separated ways of {','.join(WAYS)}, got "
                     f"{args.ways!r}")
    args.hf_threads = args.hf_threads or torch.get_num_threads()
    model, _ = load_model(args.model)
    model.generation_config.eos_token_id = None
    rows = []
    print(f"load average {os.getloadavg()[0]:.1f} at start; {os.cpu_count()} cpus")
    for length in args.prompt_lens:
        prompts = _prompts(args.requests, length, model.config.vocab_size)
        for way in ways:                         # untimed: kernels, allocator, caches warm
            run_way(way, model, prompts[:2], 2, args)
        runs = {w: [] for w in ways}
        for _ in range(args.repeat):
            for way in ways:
                runs[way].append(run_way(way, model, prompts, args.new_tokens, args))
        for way in ways:
            r = _row(length, way, runs[way])
            rows.append(r)
            extra = (f"  kvtvm kernels {100 * r['kernel_share']:.0f}% of a "
                     f"{r['decode_step_ms']:.1f} ms decode step" if r.get("kernel_share") else "")
            print(f"prompt {length:>5} {way:<22} {r['tokens']:>5} tok {r['seconds']:7.2f} s "
                  f"{r['tokens_per_s']:7.1f} tok/s  TTFT {r['ttft_ms']:7.0f} ms  TPOT "
                  f"{r['tpot_ms']:6.1f} ms  cpu {r['cpu_s']:6.1f} s  (torch threads {r['torch_threads']}; runs "
                  f"{r['seconds_all']}){extra}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at end")
    same = True
    for length in sorted({r["prompt_len"] for r in rows}):
        same &= _check_tokens([r for r in rows if r["prompt_len"] == length], length)
    for length in sorted({r["prompt_len"] for r in rows}):
        mine = {r["way"]: r["tokens_per_s"] for r in rows if r["prompt_len"] == length}
        cpu = {r["way"]: r["cpu_s"] for r in rows if r["prompt_len"] == length}
        hf = {k: v for k, v in mine.items() if k.startswith("hf-") and "kvtvm" not in k}
        if hf and "engine" in mine:
            best = max(hf, key=hf.get)
            print(f"prompt {length}: engine / best transformers path ({best}) = "
                  f"{mine['engine'] / hf[best]:.2f}x (CPU seconds: "
                  f"{cpu[best] / cpu['engine']:.2f}x)")
        if "hf-batch-kvtvm" in mine and "hf-batch-sdpa" in mine:
            print(f"prompt {length}: generate_batch on kvtvm / on sdpa = "
                  f"{mine['hf-batch-kvtvm'] / mine['hf-batch-sdpa']:.2f}x (CPU seconds: "
                  f"{cpu['hf-batch-sdpa'] / cpu['hf-batch-kvtvm']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "e2e", "args": vars(args), "rows": rows}, f, indent=1)
    if args.plot:
        _plot(rows, ways, args.plot)
    return 0 if same else 1


def _check_tokens(rows, length) -> bool:
    """Print whether every way generated the tokens of the reference way (transformers'
    one-at-a-time ``generate`` with sdpa when it ran, else the first way); False on a
    difference."""
    ref = next((r for r in rows if r["way"] == "hf-generate-sdpa"), rows[0])
    diff = [r["way"] for r in rows if r["outputs"] != ref["outputs"]]
    if diff:
        print(f"prompt {length}: TOKENS DIFFER from {ref['way']}: {', '.join(diff)}")
    else:
        print(f"prompt {length}: every way's tokens equal {ref['way']}'s")
    return not diff


def _plot(rows, ways, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    lengths = sorted({r["prompt_len"] for r in rows})
    w = 0.8 / max(len(ways), 1)
    for i, way in enumerate(ways):
        vals = [next((r["tokens_per_s"] for r in rows if r["way"] == way and
                      r["prompt_len"] == n), 0) for n in lengths]
        ax.bar(np.arange(len(lengths)) + i * w, vals, w, label=way)
    ax.set_xticks(np.arange(len(lengths)) + 0.4 - w / 2, [f"prompt {n}" for n in lengths])
    ax.set_ylabel("generated tokens/s")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=100, bbox_inches="tight")
