"""kvtvm's attention under autograd: a forward works, a backward through it fails loudly.

kvtvm's kernels have no backward. An attention output computed by them carries no autograd
history, so ``loss.backward()`` after a forward with grad enabled (a notebook's plain
``model(ids, cache=kv, labels=ids)``) would silently leave the attention's inputs -- the
Q/K/V projections of every layer -- without gradients. :func:`no_backward` gives the output
an autograd node that raises instead, so inference without ``torch.no_grad()`` still works and
a backward is refused with a typed error.
"""

from __future__ import annotations

import torch

from ..errors import InvalidArgumentError

__all__ = ["no_backward"]


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, *inputs):
        return out.clone()

    @staticmethod
    def backward(ctx, *grads):
        raise InvalidArgumentError(
            "kvtvm attention has no backward: its kernels compute inference only (gradients "
            "of the attention's query/key/value would be missing); train or take gradients "
            "with model.set_attn_implementation('sdpa'), run kvtvm under torch.no_grad()")


def no_backward(out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """``out`` (computed from ``inputs`` by a kvtvm kernel, no autograd history), made to
    raise :class:`~kvtvm.errors.InvalidArgumentError` on backward when grad is enabled and an
    input requires grad; otherwise ``out`` itself (no copy)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return _NoBackward.apply(out, *[t for t in inputs if t is not None])
    return out
