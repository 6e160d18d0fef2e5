"""transformers' continuous batching (``generate_batch``, ``init_continuous_batching``) meets
kvtvm's attention names: a typed refusal naming the cure instead of transformers' own.

``generate_batch`` runs on ``"kvtvm_flash"`` (:func:`kvtvm.integrations.hf_batch.use_kvtvm_batch`)
only. On ``"kvtvm"`` (``use_kvtvm``) transformers raised a bare ValueError naming its own
attentions; a GPT-NeoX model, which transformers' continuous batching cannot run on any
attention (its layers pass the paged cache no ``kwargs``), failed every request and only
logged it. Both are :class:`~kvtvm.errors.InvalidArgumentError` when the batching manager is
made, before a request runs; the model is unchanged. Installed once, on import of
:mod:`kvtvm.integrations.hf` or :mod:`~kvtvm.integrations.hf_batch`.
"""

from __future__ import annotations

from ..errors import InvalidArgumentError, describe

__all__ = ["KVTVM_ATTN", "KVTVM_FLASH", "check_batching_model"]

#: The attention of ``generate`` on a :class:`~kvtvm.integrations.hf.KVTVMCache`.
KVTVM_ATTN = "kvtvm"
#: The attention of transformers' continuous batching on kvtvm (it needs "flash" in the name).
KVTVM_FLASH = "kvtvm_flash"
#: Families transformers' continuous batching cannot run on any attention.
_NO_CONTINUOUS_BATCHING = ("gpt_neox",)


def check_batching_model(model) -> None:
    """Refuse, typed, a model transformers' continuous batching would fail on kvtvm."""
    config = getattr(model, "config", None)
    attn = getattr(config, "_attn_implementation", None)
    if attn == KVTVM_ATTN:
        raise InvalidArgumentError(describe(
            "model", "for generate_batch, kvtvm's continuous-batching attention: "
            "kvtvm.integrations.hf_batch.use_kvtvm_batch(model) ('kvtvm_flash')",
            "a model on 'kvtvm' attention (use_kvtvm: generate with a KVTVMCache)"))
    kind = getattr(getattr(config, "get_text_config", lambda: config)(), "model_type", None)
    if attn == KVTVM_FLASH and kind in _NO_CONTINUOUS_BATCHING:
        raise InvalidArgumentError(describe(
            "model", "a family transformers' continuous batching runs (its "
            f"{kind} layers pass the paged cache no kwargs, on any attention): "
            "model.generate serves it on 'kvtvm_flash'", f"model_type {kind!r}"))


def _install() -> None:
    try:
        from transformers.generation.continuous_batching.continuous_api import (
            ContinuousBatchingManager)
    except ImportError:  # pragma: no cover - a transformers without continuous batching
        return
    original = ContinuousBatchingManager.switch_to_cb_friendly_attn
    if getattr(original, "_kvtvm_guard", False):
        return

    def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
        check_batching_model(model)
        return original(self, model, *args, **kwargs)
    switch_to_cb_friendly_attn._kvtvm_guard = True
    ContinuousBatchingManager.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn


_install()
