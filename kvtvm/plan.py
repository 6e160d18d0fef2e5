"""Per-step plans: the KV-cache calls of every layer of one step, checked once.

Within a step an engine calls append and attention once per layer with the same tables and the
same shapes; only the layer's cache views and the step's q/k/v change. The ops check every
argument on every call (about 20 µs of host time per call). A :class:`StepPlan` made from the
step's fetched inputs prepares the first call of each kind through the op
(``kvtvm.ops.prepare_*``: every check, index ranges included), keeps its
:class:`~kvtvm.ops.Launch`, and runs the other layers by rebinding that launch's tensor slots
(``k_cache``, ``v_cache``, ``k``, ``v``, ``q``, ``out``, ``lse``) after a cheap check that each
new tensor has the dtype, shape, strides and device of the one it replaces -- anything else goes
through the full op again, which raises its usual typed errors::

    (inputs,) = mgr.fetch(batch)
    plan = kvtvm.plan.plan_step(inputs)
    for layer in range(num_layers):
        plan.append_kv(layer, k, v)          # k, v: [num_tokens, n_kv_heads, head_dim]
        out, lse = plan.attention(layer, q)  # q: [num_tokens, n_q_heads, head_dim]

Attention is the decode kernel when every sequence adds one token this step, else the ragged
prefill kernel. The plan owns the decode split workspace its launches use (freed with it). A plan
belongs to one step, one thread and one CUDA stream: the next ``fetch`` overwrites the tables it
holds.
"""

from __future__ import annotations

import numpy as np

from .errors import InvalidArgumentError, describe
from .ops import (Launch, SplitWorkspace, prepare_append_kv, prepare_decode_attention,
                  prepare_prefill_attention)
from .inputs import RaggedKVCacheInputs, check_live
from .ops.errflag import check as check_device
from .ops.checks import as_tensor, check_flag

__all__ = ["StepPlan", "plan_step"]


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

    Raises
    ------
    InvalidArgumentError
        ``inputs`` is not one device's RaggedKVCacheInputs (e.g. the list ``fetch``
        returns), or ``decode=True`` while a sequence adds other than one token.
    """

    def __init__(self, inputs, *, causal: bool = True, sm_scale=None, sliding_window=None,
                 decode: bool | None = None):
        if not isinstance(inputs, RaggedKVCacheInputs):
            hint = (" (fetch returns one per device: pass inputs[0])"
                    if isinstance(inputs, (list, tuple)) else "")
            raise InvalidArgumentError(describe(
                "inputs", "RaggedKVCacheInputs of one device" + hint, type(inputs).__name__))
        decode = check_flag("decode", decode)
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
        self._workspace = None
        self._append: Launch | None = None
        self._attention: Launch | None = None

    def __repr__(self) -> str:
        kind = "decode" if self.decode else "prefill"
        new = np.diff(np.asarray(self.inputs.qo_indptr_host)).tolist()
        return (f"StepPlan({kind}, layers={len(self._caches)}, seq_ids="
                f"{list(self.inputs.seq_ids)}, new_tokens={new})")

    def _layer(self, layer) -> tuple:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) \
                or not 0 <= layer < len(self._caches):
            raise InvalidArgumentError(describe("layer", f"an int in [0, {len(self._caches)})",
                                                repr(layer)))
        return self._caches[layer]

    @staticmethod
    def _rebound(launch: Launch | None, _fresh: tuple = (), **tensors) -> Launch | None:
        """``launch`` with ``tensors`` in its slots, or None when they don't fit it."""
        if launch is None:
            return None
        try:
            return launch.rebind(_fresh, **tensors)
        except InvalidArgumentError:
            return None

    def append_kv(self, layer: int, k, v) -> None:
        """:func:`kvtvm.ops.append_kv` of this step's new rows into ``layer``'s cache.

        Parameters
        ----------
        layer : int
            In ``[0, num_layers)``.
        k, v : Tensor
            ``[num_tokens, n_kv_heads, head_dim]``, contiguous, the cache's dtype and device
            (``num_tokens = inputs.qo_indptr[-1]``).

        Raises
        ------
        InvalidArgumentError, DTypeMismatchError, DeviceMismatchError, StaleInputsError
            A bad ``layer``, or as :func:`kvtvm.ops.prepare_append_kv` (nothing written);
            ``KernelIndexError`` as :meth:`kvtvm.ops.Launch.run`.
        """
        kc, vc = self._layer(layer)
        k, v = as_tensor("k", k), as_tensor("v", v)
        launch = self._rebound(self._append, k_cache=kc, v_cache=vc, k=k, v=v)
        if launch is None:
            inp = self.inputs
            launch = self._append = prepare_append_kv(
                kc, vc, k, v, inp.qo_indptr, inp.cache_lengths, inp.lookup_table,
                layout=inp.layout)
        launch.run()

    def attention(self, layer: int, q, *, out=None, lse=None):
        """Attention of this step's queries over ``layer``'s cache (after its append).

        Parameters
        ----------
        layer : int
            In ``[0, num_layers)``.
        q : Tensor
            ``[num_tokens, n_q_heads, head_dim]`` (``n_q_heads`` a multiple of the cache's KV
            heads; decode: ``num_tokens == batch``), contiguous, the cache's dtype.
        out : Tensor, optional
            ``[num_tokens, n_q_heads, head_dim]`` in q's dtype, written in place.
        lse : Tensor, optional
            float32 ``[num_tokens, n_q_heads]``, written in place.

        Returns
        -------
        (out, lse)
            As :func:`kvtvm.ops.decode_attention` / :func:`kvtvm.ops.prefill_attention`:
            ``out`` like ``q``, ``lse`` float32 ``[num_tokens, n_q_heads]``; new tensors
            unless given.

        Raises
        ------
        InvalidArgumentError, DTypeMismatchError, DeviceMismatchError, StaleInputsError
            A bad ``layer``, or as the op's ``prepare_*`` (nothing written);
            ``KernelIndexError`` as :meth:`kvtvm.ops.Launch.run`.
        """
        import torch

        kc, vc = self._layer(layer)
        q = as_tensor("q", q)
        launch = None
        prev = self._attention
        if prev is not None:
            p_out, p_lse = prev.slots["out"], prev.slots["lse"]
            o = as_tensor("out", out) if out is not None else torch.empty_like(p_out)
            ls = as_tensor("lse", lse) if lse is not None else torch.empty_like(p_lse)
            fresh = tuple(n for n, given in (("out", out), ("lse", lse)) if given is None)
            launch = self._rebound(prev, _fresh=fresh, q=q, k_cache=kc, v_cache=vc, out=o,
                                   lse=ls)
        if launch is None:
            inp = self.inputs
            if self.decode:
                if self._workspace is None:
                    self._workspace = SplitWorkspace(kc.device)
                launch = prepare_decode_attention(
                    q, kc, vc, inp.cache_lengths, inp.lookup_table, out=out, lse=lse,
                    workspace=self._workspace, **self._attention_kwargs)
            else:
                launch = prepare_prefill_attention(
                    q, kc, vc, inp.qo_indptr, inp.cache_lengths, inp.lookup_table, out=out,
                    lse=lse, **self._attention_kwargs)
            self._attention = launch
        return launch.run()


    def check(self) -> None:
        """Report what this step's GPU kernels skipped so far (synchronizes with the device;
        a no-op on the CPU, where every launch reports at once).

        Raises
        ------
        KernelIndexError
            A kernel skipped an out-of-range index (see :func:`kvtvm.ops.check`).
        StaleInputsError
            The plan's inputs were superseded by a later fetch, their step or a release.
        """
        check_live("inputs", getattr(self.inputs, "token", None))
        check_device(self._caches[0][0].device if self._caches else None)


def plan_step(inputs, **kwargs) -> StepPlan:
    """A :class:`StepPlan` for this step's ``inputs`` (keyword arguments as its
    constructor's: ``causal``, ``sm_scale``, ``sliding_window``, ``decode``).

    Per layer, after the model's projections (``T`` = the step's new tokens of every
    sequence, ``inputs.qo_indptr[-1]``)::

        plan = plan_step(inputs)                  # inputs: one device's fetched inputs
        for layer in range(num_layers):
            plan.append_kv(layer, k, v)           # k, v: [T, n_kv_heads, head_dim]
            out, lse = plan.attention(layer, q)   # q: [T, n_q_heads, head_dim] -> out like q,
                                                  # lse: float32 [T, n_q_heads]
    """
    return StepPlan(inputs, **kwargs)
