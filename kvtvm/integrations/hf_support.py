"""Which transformers models :mod:`kvtvm.integrations.hf` serves (``use_kvtvm``, ``KVTVMCache``).

The integration replaces only a model's attention: transformers computes the embeddings,
projections, norms, RoPE (partial, interleaved, per layer type), MLP and logits, then each layer
hands its new K/V to ``cache.update(k, v, layer_idx)`` and calls the attention function
registered as ``"kvtvm"`` with ``(query, key, value, mask, scaling=, sliding_window=)``.
kvtvm's kernels compute causal softmax attention over each row's own sequence with a scale and
an optional causal window of ``w`` keys (the query's own included: transformers'
``sliding_window_overlay``, ``kv_idx > q_idx - w``). So a model is served exactly when

* its attention modules go through ``AttentionInterface`` and its cache through ``update``
  per layer (transformers' own marks: ``_supports_attention_backend`` and
  ``_can_set_attn_implementation``, which reads the module's source for
  ``ALL_ATTENTION_FUNCTIONS.get_interface(``);
* every layer is causal self-attention over its own K/V, full or windowed (``layer_types`` of
  ``full_attention`` / ``sliding_attention`` only), with K and V of one head_dim;
* the attention score is ``scaling * q.k`` and nothing else: no logit softcap, no sink
  logits, no ALiBi bias, no chunked (block-local) mask, no bidirectional mask.

Config properties say most of that (each refusal below names the property), but not that a
family's attention module calls the interface in the standard way with nothing else on the
side (a few pass ``s_aux`` sinks, read another layer's cache, or keep a recurrent state in the
cache), so a model is accepted only if its ``model_type`` is also in
:data:`VERIFIED_MODEL_TYPES`: families whose modeling code was read and whose ``generate``
(greedy, left-padded batch, sampling, beam search; paged and continuous caches) gives
transformers' sdpa tokens in ``tests/integrations/test_hf_families.py`` (Llama-family ones in
``test_hf*.py``). A family that passes the property checks but is not on the list is refused
naming its ``model_type``; adding one is a one-line change plus a test there.
"""

from __future__ import annotations

import torch

from ..engine.runner import UnsupportedModelError
from ..errors import InvalidArgumentError, describe
from ..params import hf_geometry_refusal
from .hf_cb_guard import KVTVM_ATTN

__all__ = ["VERIFIED_MODEL_TYPES", "check_model", "UnsupportedModelError"]

#: ``config.model_type`` values verified token for token against transformers' sdpa (see the
#: module docstring); any of them is still refused when a property below says so (Gemma2 with
#: its default ``attn_logit_softcapping=50.0``).
VERIFIED_MODEL_TYPES = ("llama", "mistral", "qwen2", "smollm3", "qwen3", "qwen3_moe", "gemma",
                        "gemma2", "gemma3_text", "phi", "phi3", "olmo", "olmo2", "olmo3",
                        "granite", "starcoder2", "cohere", "cohere2", "helium", "glm", "glm4",
                        "gpt_neox", "exaone4", "ministral", "mixtral")

_ATTENTION_LAYERS = ("full_attention", "sliding_attention")
#: config attributes of recurrent (Mamba / linear-attention / short-conv) hybrids
_RECURRENT_ATTRS = ("layers_block_type", "mamba_d_state", "mamba_n_heads", "ssm_state_size",
                    "linear_num_key_heads", "linear_num_value_heads", "conv_L_cache")


def _refusal(config, kind) -> str | None:
    """Why the decoder ``config`` (a text config) cannot run on kvtvm attention, or None."""
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        return (f"attn_logit_softcapping={softcap}: kvtvm's attention kernels have no logit "
                "softcap")
    if getattr(config, "alibi", False) or getattr(getattr(config, "attn_config", None),
                                                    "alibi", False) or kind == "bloom":
        return "ALiBi position bias: kvtvm's attention kernels add no bias to the scores"
    if getattr(config, "attention_chunk_size", None):
        return (f"chunked attention (attention_chunk_size={config.attention_chunk_size}): "
                "kvtvm's kernels have a causal window, not block-local chunks")
    if getattr(config, "num_kv_shared_layers", 0):
        return (f"KV shared between layers (num_kv_shared_layers="
                f"{config.num_kv_shared_layers}): a kvtvm cache holds each layer's own K/V")
    types = getattr(config, "layer_types", None) or ()
    other = sorted({t for t in types if t not in _ATTENTION_LAYERS})
    if other:
        return (f"layer_types {other}: kvtvm serves attention layers only "
                f"({', '.join(_ATTENTION_LAYERS)}), not recurrent or hybrid ones")
    recurrent = [a for a in _RECURRENT_ATTRS if getattr(config, a, None) is not None]
    if recurrent:
        return (f"hybrid recurrent layers ({', '.join(recurrent)}): kvtvm serves attention "
                "layers only")
    geometry = hf_geometry_refusal(config)
    if geometry:
        return geometry
    if getattr(config, "use_bidirectional_attention", False) or \
            getattr(config, "is_causal", True) is False:
        return "bidirectional attention: kvtvm's kernels are causal"
    return None


def check_model(model):
    """The text config of ``model`` if the transformers integration can serve it.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A decoder-only ``*ForCausalLM`` (or its base model).

    Returns
    -------
    transformers.PretrainedConfig
        ``model.config.get_text_config()``.

    Raises
    ------
    InvalidArgumentError
        ``model`` is not a transformers model (naming ``model``).
    UnsupportedModelError
        (an ``InvalidArgumentError``) naming the model_type and what is unsupported; nothing
        about ``model`` changes.
    """
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config") \
            or not hasattr(model, "set_attn_implementation"):
        raise InvalidArgumentError(describe("model", "a transformers model (PreTrainedModel)",
                                            type(model).__name__))
    top = model.config
    kind = getattr(top, "model_type", None)
    config = top.get_text_config()

    def refuse(why: str):
        raise UnsupportedModelError(f"model_type {kind!r} is not supported on kvtvm attention: "
                                    f"{why}; use transformers' own attention (sdpa, eager)")

    if getattr(top, "is_encoder_decoder", False) or getattr(config, "add_cross_attention",
                                                            False) \
            or getattr(config, "cross_attention_layers", None):
        refuse("cross-attention / encoder-decoder (kvtvm serves decoder-only self-attention)")
    if any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in model.named_parameters()):
        refuse("attention sinks (a learned sink logit per head): kvtvm's softmax has none")
    why = _refusal(config, kind)
    if why:
        refuse(why)
    cls = type(model)
    if not getattr(cls, "_supports_attention_backend", False) or \
            not cls._can_set_attn_implementation():
        refuse("its attention does not run through transformers' AttentionInterface "
               "(transformers' _supports_attention_backend / _can_set_attn_implementation)")
    if kind not in VERIFIED_MODEL_TYPES:
        refuse(f"not among the families verified on kvtvm attention "
               f"({', '.join(VERIFIED_MODEL_TYPES)})")
    return config


def caller_attention(frame) -> str | None:
    """The attention implementation of the module whose ``forward`` is running in ``frame``
    (the caller of ``KVTVMCache.update``: transformers' attention modules call
    ``past_key_values.update(k, v, self.layer_idx)``), or None when it is no such module.
    A cache knows the config of the model it was built for, not of the model that calls it:
    another model still on sdpa would read back only each forward's own K/V."""
    module = frame.f_locals.get("self") if frame is not None else None
    impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
    return impl if isinstance(impl, str) else None


def not_on_kvtvm(impl: str | None, untaken: list) -> InvalidArgumentError:
    """The error for a KVTVMCache called by a model whose attention is ``impl``, not kvtvm
    (``untaken``: earlier layers whose K/V no kvtvm attention took): that attention would read
    back only this forward's K/V (a KVTVMCache returns no history) and silently attend to
    nothing before it."""
    runs = f"it runs {impl!r}" if impl != KVTVM_ATTN else \
        f"no kvtvm attention took layer {untaken[0]}'s K/V"
    return InvalidArgumentError(
        "past_key_values: a KVTVMCache needs the attention of the model calling it on kvtvm; "
        f"{runs}: call kvtvm.integrations.hf.use_kvtvm(model) first (and give each model its "
        "own cache)")
