"""How the engine reads a request's tokens and samples its next one.

:func:`sample` draws each request's next token from its row of logits: argmax at temperature 0,
else a draw from the softmax at that temperature restricted to the ``top_k`` most likely tokens
and then to the smallest set holding ``top_p`` of the mass (transformers' order), with the
request's own generator (:func:`make_generator`). :func:`token_list` and :func:`is_int` are the
checks of token ids the engine applies to prompts and stop tokens.
"""

from __future__ import annotations

import numbers
import zlib

import numpy as np
import torch

__all__ = ["sample", "make_generator", "token_list", "is_int", "SEED_RANGE"]


def sample(logits: torch.Tensor, reqs) -> list[int]:
    """Next token of each request from its row of ``logits`` (float ``[batch, vocab]``): argmax
    for ``temperature`` 0, else a draw from the softmax at that temperature restricted to the
    ``top_k`` most likely tokens (those tied with the k-th too; 0 or None: all), renormalized,
    then to the smallest set of tokens holding ``top_p`` of that mass."""
    greedy = logits.argmax(dim=-1).tolist()
    for i, r in enumerate(reqs):
        if r.temperature <= 0:
            continue
        # float64, max subtracted first: a temperature below float32's range (1e-40) would
        # divide to inf - inf = nan; here it tends to greedy as it should
        row = logits[i].double()
        probs = torch.softmax((row - row.max()) / float(r.temperature), dim=-1)
        top_k = getattr(r, "top_k", None)
        if top_k and top_k < probs.numel():
            probs = torch.where(probs >= probs.topk(int(top_k)).values[-1], probs, 0.0)
            probs = probs / probs.sum()
        if r.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < r.top_p       # always keeps the top token
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        greedy[i] = int(torch.multinomial(probs.cpu(), 1, generator=r.generator))
    return greedy


def is_int(x) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def token_list(tokens) -> list | None:
    """``tokens`` (a sequence of integer ids, a numpy array or an integer torch tensor) as a
    list of Python ints, or None if it is not one (floats and bools are not token ids)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            return None
        return tokens.tolist()
    if isinstance(tokens, np.ndarray):
        return tokens.tolist() if tokens.ndim == 1 and tokens.dtype.kind in "iu" else None
    if isinstance(tokens, (str, bytes)):
        return None
    try:
        out = list(tokens)
    except TypeError:
        return None
    return [int(t) for t in out] if all(is_int(t) for t in out) else None


#: the seeds ``torch.Generator.manual_seed`` takes
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)


def make_generator(seed, rid) -> torch.Generator:
    """The sampling generator of a request: seeded by ``seed`` (an int in :data:`SEED_RANGE`,
    numpy's too -- ``manual_seed`` takes Python ints only), else by ``rid`` (any int, or a
    CRC of the ``repr`` of a ``rid`` of another type, so that a string id samples too)."""
    if seed is None:
        seed = (int(rid) % (1 << 64) if is_int(rid) else
                zlib.crc32(repr(rid).encode("utf-8", "backslashreplace")))
    return torch.Generator().manual_seed(fold_seed(int(seed)))


def fold_seed(seed: int) -> int:
    """A 64-bit seed folded into the 32 bits torch's CPU generator keeps (it drops the high
    half: seeds 7 and 7 + 2**32 sampled alike): the high half xor-ed into the low one, so a
    seed below 2**32 is unchanged."""
    s = seed % (1 << 64)
    return (s ^ (s >> 32)) & 0xFFFFFFFF
