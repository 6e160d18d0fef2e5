"""``python -m kvtvm.bench e2e``: one request set served several ways, end to end.

The same requests (``--requests`` prompts of each ``--prompt-lens`` length, random tokens,
``--new-tokens`` greedy tokens each, no early stop) are served by

* ``engine``: kvtvm's reference engine (:class:`kvtvm.engine.Engine`, paged cache, every request
  submitted at once);
* ``hf-batch-sdpa`` / ``hf-batch-paged-eager``: transformers' continuous batching
  (``model.generate_batch``) with its own attention (``sdpa``, ``paged|eager``);
* ``hf-generate-sdpa``: transformers' ``generate`` with sdpa, one request at a time;
* ``hf-generate-kvtvm``: the same on kvtvm (:mod:`kvtvm.integrations.hf`).

Reported per way: generated tokens / wall time (prefill included), and for the engine the mean
time to first token and time per output token; ratios against the best transformers path.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

WAYS = ("engine", "hf-batch-sdpa", "hf-batch-paged-eager", "hf-generate-sdpa",
        "hf-generate-kvtvm")


def _prompts(n, length, vocab, seed=0):
    rng = np.random.default_rng(seed + length)
    return [rng.integers(100, vocab - 1, length).tolist() for _ in range(n)]


def _engine(model, prompts, new, batch):
    from ..engine import Engine, Request

    e = Engine(model, "paged", max_batch_size=batch, max_seq_len=len(prompts[0]) + new,
               page_size=16, prefix_caching=False, eos_token_ids=(), max_step_tokens=2048)
    e.log = lambda s: None
    e.warmup()
    reqs = [Request(i, p, new) for i, p in enumerate(prompts)]
    e.serve(reqs)
    return (e.stats.generated_tokens, e.stats.seconds,
            float(np.mean([r.ttft for r in reqs])), float(np.mean([r.tpot for r in reqs])))


def _hf_batch(model, prompts, new, attn):
    from transformers import GenerationConfig

    model.set_attn_implementation(attn)
    cfg = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    t0 = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=cfg, warmup=False)
    sec = time.perf_counter() - t0
    model.set_attn_implementation("sdpa")
    return sum(len(o.generated_tokens) for o in out.values()), sec, None, None


def _hf_generate(model, prompts, new, kvtvm: bool):
    kw = {}
    if kvtvm:
        from ..integrations.hf import KVTVMCache, use_kvtvm

        use_kvtvm(model)
    n, t0 = 0, time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p])
        if kvtvm:
            kw = {"cache": KVTVMCache(model, len(p) + new)}
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new, min_new_tokens=new, pad_token_id=0, **kw)
        n += out.shape[1] - ids.shape[1]
    sec = time.perf_counter() - t0
    model.set_attn_implementation("sdpa")
    return n, sec, None, None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtvm.bench e2e", description=__doc__)
    parser.add_argument("--model", default="smollm2", help="'smollm2', 'toy' or a directory")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-lens", default="128,1024")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--ways", default=",".join(WAYS), help=f"subset of {','.join(WAYS)}")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch threads of the transformers paths (default: torch's)")
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--plot", default=None, metavar="PATH.png")
    args = parser.parse_args(argv)
    from ..engine import load_model

    ways = [w for w in args.ways.split(",") if w]
    unknown = sorted(set(ways) - set(WAYS))
    if unknown:
        parser.error(f"--ways: unknown {unknown}; known: {list(WAYS)}")
    model, _ = load_model(args.model)
    model.generation_config.eos_token_id = None
    hf_threads = args.torch_threads or torch.get_num_threads()
    rows = []
    for length in (int(x) for x in args.prompt_lens.split(",")):
        prompts = _prompts(args.requests, length, model.config.vocab_size)
        for way in ways:
            if way == "engine":
                res = _engine(model, prompts, args.new_tokens, args.requests)
            else:
                torch.set_num_threads(hf_threads)
                if way.startswith("hf-batch"):
                    res = _hf_batch(model, prompts, args.new_tokens,
                                    "sdpa" if way.endswith("sdpa") else "paged|eager")
                else:
                    res = _hf_generate(model, prompts, args.new_tokens, way.endswith("kvtvm"))
            n, sec, ttft, tpot = res
            rows.append(dict(prompt_len=length, way=way, tokens=n, seconds=sec,
                             tokens_per_s=n / sec, ttft_ms=ttft and 1e3 * ttft,
                             tpot_ms=tpot and 1e3 * tpot,
                             torch_threads=torch.get_num_threads()))
            r = rows[-1]
            print(f"prompt {length:>5} {way:<22} {n:>5} tokens {sec:7.2f} s "
                  f"{r['tokens_per_s']:7.1f} tok/s"
                  + (f"  TTFT {r['ttft_ms']:.0f} ms TPOT {r['tpot_ms']:.1f} ms" if ttft else ""),
                  flush=True)
    for length in sorted({r["prompt_len"] for r in rows}):
        mine = {r["way"]: r["tokens_per_s"] for r in rows if r["prompt_len"] == length}
        hf_best = max((v for k, v in mine.items() if k.startswith("hf-") and "kvtvm" not in k),
                      default=None)
        if hf_best and "engine" in mine:
            print(f"prompt {length}: engine / best transformers path = "
                  f"{mine['engine'] / hf_best:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "e2e", "args": vars(args), "rows": rows}, f, indent=1)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        lengths = sorted({r["prompt_len"] for r in rows})
        for i, way in enumerate(ways):
            vals = [next((r["tokens_per_s"] for r in rows if r["way"] == way and
                          r["prompt_len"] == n), 0) for n in lengths]
            ax.bar(np.arange(len(lengths)) + i * 0.15, vals, 0.15, label=way)
        ax.set_xticks(np.arange(len(lengths)) + 0.3, [f"prompt {n}" for n in lengths])
        ax.set_ylabel("generated tokens/s")
        ax.legend(fontsize=7)
        fig.savefig(args.plot, dpi=100, bbox_inches="tight")
    return 0
