"""The reference of an 8-bit kvtvm cache in transformers: an attention function whose K and V
are quantized and dequantized row by row (per token and head) by kvtvm's numpy reference
quantizer (:mod:`kvtvm.quant`) before transformers' own sdpa attention.

:func:`quantize_attention` registers it and switches a model to it; :data:`state` holds the
storage of K and V and the layers left at full precision (one setting at a time, for every model
using it). Used by the engine's token check (:func:`kvtvm.engine.check.quantized_reference`)
and the quality benchmark (``python -m kvtvm.bench quality``).
"""

from __future__ import annotations

from ..quant import dequantize_rows, quantize_rows

__all__ = ["ATTN_NAME", "state", "fake_quantize", "attention", "quantize_attention"]

#: the name the attention function is registered under with transformers
ATTN_NAME = "kvtvm_quantized_reference"
#: K storage, V storage (None: full precision) and the skipped layer indices (in [0, layers))
state = {"k": None, "v": None, "skip": ()}


def fake_quantize(x, storage):
    """``x [B, H, T, D]`` (torch) quantized and dequantized row by row with the reference;
    ``x`` itself for ``storage`` None."""
    import torch

    if storage is None:
        return x
    rows = x.detach().to(torch.float32).cpu().numpy()
    deq = dequantize_rows(quantize_rows(rows, storage), rows.shape[-1], storage)
    return torch.from_numpy(deq).to(device=x.device, dtype=x.dtype)


def attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention over K/V quantized as :data:`state` says (a transformers
    ``AttentionInterface`` function)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if getattr(module, "layer_idx", None) not in state["skip"]:
        key, value = fake_quantize(key, state["k"]), fake_quantize(value, state["v"])
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def quantize_attention(model, k_storage, v_storage, skip_layers=()) -> None:
    """Make ``model`` (transformers) attend through :func:`attention`: K (V) quantized and
    dequantized to ``k_storage`` (``v_storage``; None: kept) at every layer but
    ``skip_layers`` (indices in ``[0, num_layers)``). Sets :data:`state`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, attention)
    # sdpa's mask too: a name without a mask function gets no mask at all from transformers,
    # and sdpa then attends to a padded batch's pads
    AttentionMaskInterface.register(ATTN_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    state.update(k=k_storage, v=v_storage, skip=tuple(skip_layers))
    model.set_attn_implementation(ATTN_NAME)
