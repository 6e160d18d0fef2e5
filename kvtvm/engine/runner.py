"""The model runner: a transformers Llama-family forward pass with kvtvm as its KV cache.

torch runs the embeddings, RMSNorm, projections, RoPE, MLP and LM head with the model's own
modules and weights; kvtvm appends each layer's new K/V into the manager's cache and attends over
it through one :func:`kvtvm.plan.plan_step` per step. :class:`ModelRunner` is the piece another
engine reuses (``examples/serve.py``'s engine, a disaggregated prefill/decode worker): fetch the
step's inputs from any kvtvm manager, call :meth:`ModelRunner.run_step`, commit the step.

Supported: decoder-only models whose layers are transformers' Llama layout (``self_attn`` with
``q_proj``/``k_proj``/``v_proj``/``o_proj``, ``mlp``, ``input_layernorm``,
``post_attention_layernorm``; ``model.rotary_emb``): Llama, Mistral, Qwen2, SmolLM, with GQA and
an optional sliding window. Anything else raises :class:`UnsupportedModelError`.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ..plan import plan_step
from .linear import backend_for

__all__ = ["ModelRunner", "UnsupportedModelError", "check_supported", "check_engine_model",
           "rotate_half", "SUPPORTED_MODEL_TYPES"]

#: ``config.model_type`` values whose layers this runner computes exactly like transformers.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "smollm3")
#: RoPE types whose frequencies transformers recomputes from each forward's longest position
#: (``dynamic_rope_update``): the engine refuses them
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class UnsupportedModelError(InvalidArgumentError):
    """The model is not one :class:`ModelRunner` can run (says what it is and what to use)."""


def check_supported(config) -> None:
    """Raise :class:`UnsupportedModelError` unless ``config`` (a transformers config) is a
    Llama-family decoder this runner computes exactly."""
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {kind!r} is not supported: kvtvm's engine runs Llama-family decoders "
            f"({', '.join(SUPPORTED_MODEL_TYPES)}); for other models use kvtvm's managers and ops "
            "directly, or transformers on kvtvm (kvtvm.integrations.hf)")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None):
            raise UnsupportedModelError(f"{name}={getattr(config, name)}: kvtvm's attention "
                                        "kernels have no logit softcap")
    if getattr(config, "kv_lora_rank", None) or getattr(config, "q_lora_rank", None):
        raise UnsupportedModelError("multi-head latent attention (MLA) is not supported")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("mrope_section"):
        raise UnsupportedModelError("multimodal RoPE (mrope) is not supported")


def check_engine_model(model) -> None:
    """Raise :class:`UnsupportedModelError` naming ``model`` unless it is a transformers
    ``*ForCausalLM`` (a torch module with ``config``, ``model.layers`` and ``lm_head``) of a
    family :func:`check_supported` takes -- not None, a name, or the base model without its
    head."""
    config = getattr(model, "config", None)
    if not isinstance(model, torch.nn.Module) or config is None:
        raise UnsupportedModelError(
            f"model: expected a transformers *ForCausalLM model (kvtvm.engine.load_model gives "
            f"one), got {type(model).__name__}")
    check_supported(config)
    if not hasattr(getattr(model, "model", None), "layers") or not hasattr(model, "lm_head"):
        raise UnsupportedModelError(
            f"model: {type(model).__name__} has no language-model head (model.layers and "
            "lm_head): pass the *ForCausalLM model, not its base model")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' RoPE convention: the two halves of the head, ``(-x2, x1)``."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


#: Families whose attention passes the config's ``sliding_window`` as it is (transformers
#: windows them by that key alone, whatever ``use_sliding_window`` says).
_CONFIG_WINDOW_TYPES = ("mistral", "mixtral", "phi3", "starcoder2")


def attention_windows(hf_model, config=None) -> list:
    """Each layer's window as transformers' attention of ``hf_model`` applies it (None: full):
    what each attention module passes to the attention function -- its own
    ``sliding_window`` where it has one (Qwen2, Gemma 2/3, SmolLM3, ...: per layer; EXAONE 4
    only on its sliding layers), the config's (Mistral, Mixtral, Phi-3, StarCoder2), or none
    (Llama and the other full-attention families: a ``sliding_window`` key left in their
    config is ignored by transformers, and so here). ``config``: the text config (default
    ``hf_model.config``)."""
    cfg = config if config is not None else hf_model.config
    n = cfg.num_hidden_layers
    windows: list = [None] * n
    for module in hf_model.modules():
        idx = getattr(module, "layer_idx", None)
        if type(idx) is not int or not 0 <= idx < n \
                or not type(module).__name__.endswith("Attention"):
            continue
        if hasattr(module, "sliding_window"):
            window = module.sliding_window if getattr(module, "is_sliding", True) else None
        elif cfg.model_type in _CONFIG_WINDOW_TYPES:
            window = getattr(cfg, "sliding_window", None)
        else:
            window = None
        windows[idx] = int(window) if window else None
    return windows


class ModelRunner:
    """The forward pass of a transformers Llama-family model over a ragged batch.

    The batch is ragged: the new tokens of every sequence are concatenated into one
    ``[num_tokens]`` row dimension and ``kv.qo_indptr`` says which rows belong to which sequence.
    Each layer projects q, k, v, rotates them by position, appends k and v to the cache and
    attends over the cache -- decode attention when every sequence adds exactly one token,
    prefill attention otherwise.

    Parameters
    ----------
    hf_model : transformers.PreTrainedModel
        A ``*ForCausalLM`` of a supported family (see :func:`check_supported`), in eval mode.
    linear : {"auto", "onednn", "torch"}
        How the projections, MLP and LM head multiply (:mod:`kvtvm.engine.linear`): "auto"
        uses oneDNN with packed weights on the CPU in float32 (about 2x MKL's ``sgemm`` here),
        torch's ``nn.Linear`` elsewhere.
    """

    def __init__(self, hf_model, linear: str = "auto"):
        check_engine_model(hf_model)
        cfg = hf_model.config
        self.hf_model = hf_model
        self.model = hf_model.model          # embed_tokens, layers, norm, rotary_emb
        self.lm_head = hf_model.lm_head
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.num_layers = cfg.num_hidden_layers
        windows = attention_windows(hf_model)
        # the layers' window, not the config's: SmolLM3 with use_sliding_window and no
        # sliding layer in layer_types attends in full; a Llama ignores a sliding_window key
        self.sliding_window = windows[0]
        if len(set(windows)) > 1:
            raise UnsupportedModelError(
                f"layer_types {list(cfg.layer_types)}: full and sliding-window layers mixed; "
                "kvtvm's engine runs one window for every layer (transformers on kvtvm, "
                "kvtvm.integrations.hf, runs each layer's own)")
        rope = getattr(getattr(self.model, "rotary_emb", None), "rope_type", "default")
        if rope in LENGTH_DEPENDENT_ROPE:
            raise UnsupportedModelError(
                f"rope_type {rope!r}: transformers picks its frequencies from the longest "
                "position of each forward pass, so a served token's RoPE would depend on the "
                "requests batched and the prompt chunks with it; kvtvm's engine runs RoPE "
                "types whose frequencies are fixed (default, linear, llama3, yarn, ...)")
        self.dtype = next(hf_model.parameters()).dtype
        self.device = next(hf_model.parameters()).device
        self.use_decode_kernel = True
        self.linear = backend_for(hf_model, self.dtype, self.device, linear)
        self._plain_mlp = all(
            all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
            for layer in self.model.layers)

    def _mlp(self, mlp, h):
        if not self._plain_mlp:
            return mlp(h)
        lin = self.linear
        return lin(mlp.down_proj, mlp.act_fn(lin(mlp.gate_proj, h)) * lin(mlp.up_proj, h))

    @torch.no_grad()
    def forward(self, token_ids, positions, kv, decode: bool, last_only: bool = True):
        """Logits of the new tokens.

        Parameters
        ----------
        token_ids, positions : torch.Tensor
            int64 ``[num_tokens]``: the new tokens and their positions in their sequence.
        kv : kvtvm.inputs.RaggedKVCacheInputs
            This step's cache inputs from the manager.
        decode : bool
            Every sequence adds exactly one token (use the decode kernel).
        last_only : bool
            Logits of the last new token of each sequence only (else of every new token).

        Returns
        -------
        torch.Tensor
            float32 ``[batch, vocab_size]`` (``[num_tokens, vocab_size]`` without
            ``last_only``).
        """
        T, Hq, Hkv, D = token_ids.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        x = self.model.embed_tokens(token_ids)                            # [T, hidden]
        cos, sin = self.model.rotary_emb(x, positions[None])              # [1, T, D]
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]                 # [T, 1, D]
        # kvtvm: this step's append + attention for every layer, arguments checked once
        plan = plan_step(kv, decode=decode and self.use_decode_kernel,
                         sliding_window=self.sliding_window)
        lin = self.linear
        last = None
        if last_only:
            last = torch.from_numpy(kv.qo_indptr_host[1:].astype(np.int64) - 1).to(x.device)
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = lin(attn.q_proj, h).view(T, Hq, D)
            k = lin(attn.k_proj, h).view(T, Hkv, D)
            v = lin(attn.v_proj, h).view(T, Hkv, D)
            if getattr(attn, "use_rope", True):     # SmolLM3's no_rope_layers have none
                q = q * cos + rotate_half(q) * sin                      # RoPE (contiguous)
                k = k * cos + rotate_half(k) * sin
            plan.append_kv(i, k, v)      # write this step's K/V into layer i's cache
            o, _ = plan.attention(i, q)  # attend over it: decode or causal prefill kernel
            o = o.reshape(T, Hq * D)
            if last is not None and i == self.num_layers - 1 and T > last.shape[0]:
                # the last layer's output feeds only the logits: keep each sequence's last row
                o, x = o[last], x[last]
            x = x + lin(attn.o_proj, o)
            x = x + self._mlp(layer.mlp, layer.post_attention_layernorm(x))
        if last is not None and x.shape[0] != last.shape[0]:
            x = x[last]
        return lin(self.lm_head, self.model.norm(x)).float()

    def run_step(self, kv, new_tokens, last_only: bool = True):
        """One model step for a manager's fetched inputs: the way to drive the model from any
        loop over kvtvm's managers (fetch -> ``run_step`` -> step/commit).

        Parameters
        ----------
        kv : kvtvm.inputs.RaggedKVCacheInputs
            From ``mgr.fetch(batch)[0]`` (or ``LinearKVCache.step_inputs``).
        new_tokens : list of list of int
            Per sequence, in batch order, the tokens to compute this step: the fetched tokens
            less the ``kv.num_cached_tokens`` prefix-cache hits at their front.
        last_only : bool
            As for :meth:`forward`.

        Returns
        -------
        torch.Tensor
            float32 logits ``[batch, vocab_size]`` of each sequence's last new token
            (``[num_tokens, vocab_size]`` without ``last_only``).

        Raises
        ------
        InvalidArgumentError
            The token counts differ from ``kv``'s ``qo_indptr``; the ops' errors as for
            :class:`~kvtvm.plan.StepPlan`.
        """
        counts = np.array([len(t) for t in new_tokens], dtype=np.int64)
        qo = np.asarray(kv.qo_indptr_host, dtype=np.int64)
        if counts.shape[0] != qo.shape[0] - 1 or not np.array_equal(np.diff(qo), counts):
            raise InvalidArgumentError(
                f"new_tokens: expected per-sequence counts {np.diff(qo).tolist()} (the "
                f"fetched inputs' qo_indptr), got {counts.tolist()}")
        start = np.asarray(kv.cache_lengths_host, dtype=np.int64)
        offsets = np.arange(int(counts.sum())) - np.repeat(qo[:-1], counts)
        positions = np.repeat(start, counts) + offsets
        ids = [t for seq in new_tokens for t in seq]
        dev = self.device
        return self.forward(torch.tensor(ids, dtype=torch.int64, device=dev),
                            torch.from_numpy(positions).to(dev), kv,
                            decode=bool(np.all(counts == 1)), last_only=last_only)
