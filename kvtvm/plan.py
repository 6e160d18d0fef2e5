"""Per-step plans: the KV-cache calls of every layer of one step, checked once.

Within a step an engine calls append and attention once per layer with the same tables and the
same shapes; only the layer's cache views and the step's q/k/v change. The ops check every
argument on every call (about 20 µs of host time per call). A :class:`StepPlan` made from the
step's fetched inputs runs the first call of each kind through the op (every check, index
ranges included), records its launch, and runs the other layers by replaying it with their
tensors after a cheap check that they have the recorded dtype, shape and device -- anything
else goes through the full op again, which raises its usual typed errors::

    (inputs,) = mgr.fetch(batch)
    plan = kvtvm.ops.plan_step(inputs)
    for layer in range(num_layers):
        plan.append_kv(layer, k, v)          # k, v: [num_tokens, n_kv_heads, head_dim]
        out, lse = plan.attention(layer, q)  # q: [num_tokens, n_q_heads, head_dim]

Attention is the decode kernel when every sequence adds one token this step, else the ragged
prefill kernel. A plan belongs to one step, one thread and one CUDA stream: the next ``fetch``
overwrites the tables it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .boundary import recording_launches, run_launch
from .errors import InvalidArgumentError, describe

__all__ = ["StepPlan", "plan_step"]


def _signature(t):
    """What a replay must match: dtype, shape and device of a contiguous torch tensor."""
    import torch

    if isinstance(t, torch.Tensor) and t.is_contiguous():
        return t.dtype, tuple(t.shape), t.device
    return None


@dataclass
class _Replay:
    fn: Any
    device: Any
    args: tuple
    slots: dict        # per-call name -> position in args
    signatures: dict   # per-call name -> _signature of the recorded tensor (caches excluded)


class StepPlan:
    """One step's append and attention calls for every layer, checked once.

    Parameters
    ----------
    inputs : RaggedKVCacheInputs
        One device's inputs of this step, from ``fetch`` (or ``step_inputs`` of a linear cache).
    causal, sm_scale, sliding_window
        As for :func:`kvtvm.ops.prefill_attention` / :func:`kvtvm.ops.decode_attention`.
    decode : bool, optional
        Force the kernel; by default decode exactly when every sequence adds one token.
    """

    def __init__(self, inputs, *, causal: bool = True, sm_scale=None, sliding_window=None,
                 decode: bool | None = None):
        qo = np.asarray(inputs.qo_indptr_host)
        one_each = bool(np.all(np.diff(qo) == 1))
        if decode is None:
            decode = one_each
        elif decode and not one_each:
            raise InvalidArgumentError(describe(
                "decode", "False when a sequence adds other than one token this step",
                f"True with new tokens per sequence {np.diff(qo).tolist()}"))
        self.inputs, self.decode = inputs, bool(decode)
        coll = inputs.collection()
        self._caches = [(coll.get_key_cache(i).blocks, coll.get_value_cache(i).blocks)
                        for i in range(inputs.num_layers)]
        self._attention_kwargs = dict(layout=inputs.layout, sm_scale=sm_scale,
                                      sliding_window=sliding_window)
        if not self.decode:
            self._attention_kwargs["causal"] = causal
        self._replays: dict[str, _Replay] = {}

    def _layer(self, layer) -> tuple:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) \
                or not 0 <= layer < len(self._caches):
            raise InvalidArgumentError(describe("layer", f"an int in [0, {len(self._caches)})",
                                                repr(layer)))
        return self._caches[layer]

    def _replayed(self, kind: str, tensors: dict) -> bool:
        """Launch the recorded ``kind`` with ``tensors`` if they match it; True when done."""
        rep = self._replays.get(kind)
        if rep is None:
            return False
        for name, sig in rep.signatures.items():
            if _signature(tensors[name]) != sig:
                return False
        args = list(rep.args)
        for name, t in tensors.items():
            args[rep.slots[name]] = t
        run_launch(rep.fn, rep.device, args)
        return True

    def _record(self, kind: str, calls: list, tensors: dict, caches=("k_cache", "v_cache")):
        """Keep the one launch of a full call if every per-call tensor is found in it."""
        if len(calls) != 1:
            return
        fn, device, args = calls[0]
        slots = {}
        for name, t in tensors.items():  # in argument order; one tensor may be passed twice
            where = [i for i, a in enumerate(args) if a is t and i not in slots.values()]
            if not where:
                return  # converted on the way in (e.g. a numpy array): not replayable
            slots[name] = where[0]
        signatures = {n: _signature(t) for n, t in tensors.items() if n not in caches}
        if None in signatures.values():
            return
        self._replays[kind] = _Replay(fn, device, args, slots, signatures)

    def append_kv(self, layer: int, k, v) -> None:
        """:func:`kvtvm.ops.append_kv` of this step's new rows into ``layer``'s cache.

        ``k``, ``v``: ``[num_tokens, n_kv_heads, head_dim]`` of the cache's dtype and device.
        """
        from .ops import append_kv

        kc, vc = self._layer(layer)
        tensors = {"k_cache": kc, "v_cache": vc, "k": k, "v": v}
        if self._replayed("append", tensors):
            return
        inp = self.inputs
        with recording_launches() as calls:
            append_kv(kc, vc, k, v, inp.qo_indptr, inp.cache_lengths, inp.lookup_table,
                      layout=inp.layout)
        self._record("append", calls, tensors)

    def attention(self, layer: int, q, *, out=None, lse=None):
        """Attention of this step's queries over ``layer``'s cache (after its append).

        ``q``: ``[num_tokens, n_q_heads, head_dim]`` (``n_q_heads`` a multiple of the cache's
        KV heads). Returns ``(out, lse)`` like
        :func:`kvtvm.ops.decode_attention` / :func:`kvtvm.ops.prefill_attention`; ``out`` and
        ``lse`` are new tensors unless given.
        """
        import torch

        kc, vc = self._layer(layer)
        rep = self._replays.get("attention")
        if rep is not None:
            q_sig = rep.signatures["q"]
            o = out if out is not None else torch.empty(q_sig[1], dtype=q_sig[0],
                                                        device=q_sig[2])
            ls = lse if lse is not None else torch.empty(
                q_sig[1][:2], dtype=torch.float32, device=q_sig[2])
            if self._replayed("attention", {"q": q, "k_cache": kc, "v_cache": vc,
                                            "out": o, "lse": ls}):
                return o, ls
        inp = self.inputs
        with recording_launches() as calls:
            if self.decode:
                from .ops import decode_attention

                o, ls = decode_attention(q, kc, vc, inp.cache_lengths, inp.lookup_table,
                                         out=out, lse=lse, **self._attention_kwargs)
            else:
                from .ops import prefill_attention

                o, ls = prefill_attention(q, kc, vc, inp.qo_indptr, inp.cache_lengths,
                                          inp.lookup_table, out=out, lse=lse,
                                          **self._attention_kwargs)
        self._record("attention", calls, {"q": q, "k_cache": kc, "v_cache": vc,
                                          "out": o, "lse": ls})
        return o, ls


def plan_step(inputs, **kwargs) -> StepPlan:
    """A :class:`StepPlan` for this step's ``inputs`` (keyword arguments as its
    constructor's)."""
    return StepPlan(inputs, **kwargs)
