"""Checking an engine's tokens against transformers' own ``generate`` on each request alone.

In float32 the greedy tokens must be equal. In bfloat16/float16 two correct implementations
pick different tokens wherever the top logits are closer than the rounding (transformers' own
sdpa and eager differ on 16 of the toy demo's 24 requests in bfloat16), so there a request whose
tokens differ passes when every token it chose is, teacher-forced through transformers on the
same prefix, within ``rel_tol`` of the logit range of transformers' best token
(:func:`near_greedy_gap`). An engine over an 8-bit cache is checked against transformers whose
attention quantizes K/V the same way (:func:`quantized_reference`); there even float32 tokens
may differ at near-ties, since a last-bit difference of a K/V value before quantization can move
it to the next 8-bit code (:func:`reference_tolerance`).
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["reference_tokens", "check_against_reference", "near_greedy_gap", "LOW_PRECISION_TOL",
           "QUANTIZED_TOL", "quantized_reference", "reference_tolerance"]

#: Largest teacher-forced logit gap (a fraction of the logit range) a low-precision token may
#: have: 0.65% measured at most on the toy demo in bfloat16 (CPU); a wrong attention gives tens
#: of percent.
LOW_PRECISION_TOL = 0.02
#: The same for a float32 model over an 8-bit cache: a last-bit difference of a K/V value before
#: quantization (the engine's oneDNN projections vs transformers' MKL; kvtvm's attention vs
#: sdpa in the layers before) moves it to the next 8-bit code and the logits by tenths. Measured
#: on SmolLM2 (session 14's off-grid sweep; tokens teacher-forced through the reference):
#: "東京の天気は？" over a float8_e4m3fn cache (the engine) differs at its 5th token, gap 0.125%;
#: "Count to ten:" over float8 K alone, layers 0 and -1 kept (generate on KVTVMCache), 0.52%;
#: "Qu'est-ce que la photosynthèse ?" over int8 (KVTVMCache), 0.79% -- each a near-tie the
#: reference flips itself when K/V are scaled by ``1 + 5e-7 * noise`` before the quantization
#: (margins swing by +-0.5 logits). The toy demo's K-only float8 gap: 0.0044%. Checked against
#: transformers without the quantization, the int8 cache's tokens reach gaps of 1.7% and
#: float8's 12%.
QUANTIZED_TOL = 2e-2


def reference_tolerance(model, params) -> float | None:
    """The ``rel_tol`` of :func:`check_against_reference` for an engine with cache ``params``
    serving ``model``: None (exact) for float32 over a full-precision cache, else
    :data:`LOW_PRECISION_TOL` (bfloat16/float16), :data:`QUANTIZED_TOL` (8-bit cache), or
    their sum for both (a bfloat16 model over a float8 K cache measured a 2.3% gap on "What
    is 17 times 23?": each error source moves the logits on its own)."""
    low = next(model.parameters()).dtype in (torch.bfloat16, torch.float16)
    if low and params.quantized:
        return LOW_PRECISION_TOL + QUANTIZED_TOL
    if low:
        return LOW_PRECISION_TOL
    return QUANTIZED_TOL if params.quantized else None


@contextlib.contextmanager
def quantized_reference(model, params):
    """Within the block, ``model`` (transformers) attends with K/V quantized and dequantized
    row by row by kvtvm's reference quantizer as the cache of ``params``
    (:class:`~kvtvm.params.KVCacheParams`) stores them -- K and V each in its storage type,
    the ``skip_layers`` untouched (:func:`kvtvm.engine.quantref.quantize_attention`) -- so
    :func:`reference_tokens` and :func:`check_against_reference` are the reference of an
    engine over that cache. A full-precision ``params`` changes nothing. The model's attention
    implementation is restored afterwards."""
    if not params.quantized:
        yield model
        return
    from ..quant import QUANT_DTYPES
    from . import quantref

    def storage(dtype):
        return dtype if dtype in QUANT_DTYPES else None

    before, state = model.config._attn_implementation, dict(quantref.state)
    quantref.quantize_attention(model, storage(params.k_cache_dtype),
                               storage(params.v_cache_dtype),
                               params.resolve_skip_layers(model.config.num_hidden_layers))
    try:
        yield model
    finally:
        model.set_attn_implementation(before)
        quantref.state.update(state)


@torch.no_grad()
def near_greedy_gap(model, prompt, output) -> tuple[float, int]:
    """The largest ``(max logit - logit of the chosen token) / logit range`` over ``output``,
    teacher-forced through ``model`` on ``prompt + output``, and the position where it is."""
    ids = torch.tensor([list(prompt) + list(output[:-1])], device=model.device)
    logits = model(ids).logits[0, len(prompt) - 1:].float()
    chosen = logits[torch.arange(len(output)), torch.tensor(list(output), device=model.device)]
    top, low = logits.max(-1).values, logits.min(-1).values
    gap = (top - chosen) / (top - low).clamp_min(1e-6)
    i = int(gap.argmax())
    return float(gap[i]), i


@torch.no_grad()
def reference_tokens(model, prompt, max_new_tokens: int, stop_token_ids=()) -> list[int]:
    """Greedy tokens of ``transformers``' ``generate`` on this prompt alone (ending with the
    first stop token, if any). Without a cache where the config holds a ``sliding_window`` no
    layer applies (a stray key): transformers' DynamicCache keeps only that many tokens of
    such a config, and decodes wrong tokens itself."""
    from .runner import attention_windows

    ids = torch.tensor([list(prompt)], dtype=torch.int64, device=model.device)
    stop = list(stop_token_ids or ())
    pad = model.generation_config.pad_token_id
    stray = getattr(model.config, "sliding_window", None) and \
        not any(attention_windows(model))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         use_cache=not stray,
                         max_new_tokens=max_new_tokens, eos_token_id=stop or None,
                         pad_token_id=pad if pad is not None else 0, temperature=None,
                         top_p=None, top_k=None)
    return out[0, ids.shape[1]:].tolist()


def check_against_reference(model, requests, rel_tol: float | None = None) -> list[str]:
    """One message per served greedy request whose tokens differ from ``generate``'s (empty:
    all equal). The message names the request, the position and the expected and actual
    token. ``rel_tol`` (default :data:`LOW_PRECISION_TOL` for a bfloat16/float16 model, None:
    exact, for float32) accepts differing tokens that are near-greedy (:func:`near_greedy_gap`).
    """
    if rel_tol is None and next(model.parameters()).dtype in (torch.bfloat16, torch.float16):
        rel_tol = LOW_PRECISION_TOL
    problems = []
    for r in requests:
        if r.status != "done" or r.temperature > 0:
            continue
        want = reference_tokens(model, r.prompt, r.max_new_tokens, r.stop_token_ids)
        got = r.output
        if got == want:
            continue
        note = ""
        if rel_tol is not None and got:
            gap, at = near_greedy_gap(model, r.prompt, got)
            if gap <= rel_tol:
                continue
            note = (f"; teacher-forced, token {at} is {100 * gap:.3g}% of the logit range below "
                    f"transformers' best (tolerance {100 * rel_tol:.3g}%)")
        i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want),
                                                                               len(got)))
        exp = want[i] if i < len(want) else "<end>"
        act = got[i] if i < len(got) else "<end>"
        problems.append(f"request {r.rid}: generated token {i} (sequence position "
                        f"{len(r.prompt) + i}): expected {exp} (transformers), got {act} "
                        f"(kvtvm {len(got)} tokens: {got[:i + 1]}...){note}")
    return problems
