"""Checking an engine's tokens against transformers' own ``generate`` on each request alone."""

from __future__ import annotations

import torch

__all__ = ["reference_tokens", "check_against_reference"]


@torch.no_grad()
def reference_tokens(model, prompt, max_new_tokens: int, stop_token_ids=()) -> list[int]:
    """Greedy tokens of ``transformers``' ``generate`` on this prompt alone (ending with the
    first stop token, if any)."""
    ids = torch.tensor([list(prompt)], dtype=torch.int64, device=model.device)
    stop = list(stop_token_ids or ())
    pad = model.generation_config.pad_token_id
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=stop or None,
                         pad_token_id=pad if pad is not None else 0, temperature=None,
                         top_p=None, top_k=None)
    return out[0, ids.shape[1]:].tolist()


def check_against_reference(model, requests) -> list[str]:
    """One message per served greedy request whose tokens differ from ``generate``'s (empty:
    all equal). The message names the request, the position and the expected and actual
    token."""
    problems = []
    for r in requests:
        if r.status != "done" or r.temperature > 0:
            continue
        want = reference_tokens(model, r.prompt, r.max_new_tokens, r.stop_token_ids)
        got = r.output
        if got == want:
            continue
        i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want),
                                                                               len(got)))
        exp = want[i] if i < len(want) else "<end>"
        act = got[i] if i < len(got) else "<end>"
        problems.append(f"request {r.rid}: generated token {i} (sequence position "
                        f"{len(r.prompt) + i}): expected {exp} (transformers), got {act} "
                        f"(kvtvm {len(got)} tokens: {got[:i + 1]}...)")
    return problems
