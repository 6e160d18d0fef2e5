"""Fingerprints of a batch's tokens: what ``fetch`` keeps so that ``step`` can refuse tokens
other than the fetched ones (the cache holds K/V of the fetched tokens; committing others would
teach the prefix cache wrong pages)."""

from __future__ import annotations

import numpy as np

__all__ = ["fingerprints"]

_FP_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit multiplier (golden ratio)


def fingerprints(tokens: np.ndarray, counts: np.ndarray, use: np.ndarray) -> np.ndarray:
    """uint64 ``[batch]``: a fingerprint of the first ``use[b]`` of item ``b``'s tokens
    (``tokens`` flat int64, item after item, ``counts[b] >= 1`` and ``use[b] >= 1`` each): the
    first token itself plus a sum of mixed (token, position) words of the later ones, in
    wrapping 64-bit arithmetic, vectorized (no Python loop per item). A decode step (one token
    each) costs no arithmetic: its fingerprints are its tokens (a view, not a copy)."""
    n = counts.size
    if tokens.size == n:  # one token each (decode)
        return tokens.view(np.uint64) if tokens.dtype == np.int64 else tokens.astype(np.uint64)
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    pos = np.arange(tokens.size, dtype=np.int64) - np.repeat(starts, counts)
    # array arithmetic in uint64 wraps silently (numpy warns on scalar overflow only)
    mixed = (tokens.astype(np.uint64) + np.uint64(1)) * _FP_MULT
    mixed ^= pos.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
    mixed *= np.uint64(0x94D049BB133111EB)
    mixed[starts] = tokens[starts].view(np.uint64)  # position 0: the token itself
    if not np.array_equal(use, counts):
        mixed[pos >= np.repeat(use, counts)] = 0
    return np.add.reduceat(mixed, starts)
