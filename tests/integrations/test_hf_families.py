"""transformers on kvtvm beyond the Llama family: tiny random models (seeded, float32, 2-3
layers) of every family :data:`kvtvm.integrations.hf_support.VERIFIED_MODEL_TYPES` adds give
transformers' own tokens (sdpa; eager for Gemma2) under ``generate`` (left-padded greedy
batch, sampling, beam search; paged and continuous caches) and ``generate_batch``; their
logits match sdpa's; the families kvtvm cannot serve exactly are refused up front, naming
what, with the model unchanged."""

import numpy as np
import pytest
import torch

from kvtvm.errors import InvalidArgumentError

hf = pytest.importorskip("kvtvm.integrations.hf")
import transformers  # noqa: E402

from kvtvm.integrations import hf_batch, hf_support  # noqa: E402

VOCAB = 256
# 8 query heads, 2 KV heads of 32 (the toy Llama's kernels); hidden 64 where the config takes a
# head_dim of its own, else 256 (= 8 x 32)
_GQA = dict(vocab_size=VOCAB, num_attention_heads=8, num_key_value_heads=2,
            intermediate_size=64, max_position_embeddings=256, initializer_range=0.15,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=None, pad_token_id=0)
_OWN_HEAD_DIM = dict(_GQA, hidden_size=64, head_dim=32)
_WIDE = dict(_GQA, hidden_size=256)

#: kind -> (config class, model class, config kwargs): each family's distinguishing features
FAMILIES = {
    # q/k RMSNorm per head; layer 1 windowed (layer_types), a window shorter than the prompts
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        _OWN_HEAD_DIM, num_hidden_layers=2, use_sliding_window=True, sliding_window=6,
        max_window_layers=1)),
    # embeddings scaled by sqrt(hidden), GeGLU, (1 + w) RMSNorm
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_OWN_HEAD_DIM, num_hidden_layers=2)),
    # query_pre_attn_scalar scaling, alternating windowed/full layers, final logit softcap
    # (on the LM head: transformers'), no attention softcap
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        _OWN_HEAD_DIM, num_hidden_layers=2, query_pre_attn_scalar=20, sliding_window=6,
        attn_logit_softcapping=None, final_logit_softcapping=30.0)),
    # query_pre_attn_scalar scaling, q/k norms, windowed and full layers mixed (layer_types),
    # a RoPE of its own per layer type
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        _OWN_HEAD_DIM, num_hidden_layers=3, query_pre_attn_scalar=20, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # fused qkv projection, a window on every layer
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_WIDE, num_hidden_layers=2,
                                                   sliding_window=6)),
    # q/k RMSNorm over the whole projection, norms after attention and MLP
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(_WIDE, num_hidden_layers=2)),
    # attention_multiplier as the softmax scale, embedding/residual/logit multipliers
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        _WIDE, num_hidden_layers=2, attention_multiplier=0.09, embedding_multiplier=2.0,
        residual_multiplier=0.5, logits_scaling=2.0)),
    # biases everywhere, LayerNorm, a window on every layer
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(
        _WIDE, num_hidden_layers=2, sliding_window=6, use_bias=True)),
    # parallel attention + MLP, LayerNorm, interleaved RoPE, q/k norms, logit scale
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(_WIDE, num_hidden_layers=2,
                                                         use_qk_norm=True, logit_scale=0.5)),
    # o_proj maps heads x head_dim back assuming it is the hidden size
    "helium": ("HeliumConfig", "HeliumForCausalLM", dict(_WIDE, head_dim=32, num_hidden_layers=2)),
    # partial, interleaved RoPE; fused gate/up
    "glm": ("GlmConfig", "GlmForCausalLM", dict(_OWN_HEAD_DIM, num_hidden_layers=2)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(_OWN_HEAD_DIM, num_hidden_layers=2)),
    # fused qkv, partial RoPE, parallel residual, LayerNorm, multi-head (no GQA)
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        {k: v for k, v in _WIDE.items() if k != "num_key_value_heads"}, num_hidden_layers=2)),
    # partial RoPE, parallel block, biases, LayerNorm
    "phi": ("PhiConfig", "PhiForCausalLM", dict(_WIDE, num_hidden_layers=2)),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(_WIDE, num_hidden_layers=2)),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(
        _WIDE, num_hidden_layers=2, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"])),
    # windowed layers with RoPE, full layers without (NoPE)
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(
        _OWN_HEAD_DIM, num_hidden_layers=2, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"])),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(
        _WIDE, num_hidden_layers=2, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"])),
    "ministral": ("MinistralConfig", "MinistralForCausalLM", dict(
        _OWN_HEAD_DIM, num_hidden_layers=2, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"])),
    # mixture of experts (transformers' experts), a window on every layer
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        _OWN_HEAD_DIM, num_hidden_layers=2, sliding_window=6, num_local_experts=2,
        num_experts_per_tok=1)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        _OWN_HEAD_DIM, num_hidden_layers=2, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=32)),
}
#: families transformers' continuous batching cannot run on any attention (GPT-NeoX calls
#: ``cache.update`` without the ``kwargs=`` its PagedAttentionCache needs)
NO_GENERATE_BATCH = ("gpt_neox",)
#: the families the task named, whose sampling / beam / generate_batch runs are in the fast
#: suite; the others' are marked slow (their greedy runs and logits are always checked)
CORE = ("qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "granite", "starcoder2",
        "cohere", "helium", "glm")


def _kinds(skip=()):
    return [pytest.param(k, marks=() if k in CORE else pytest.mark.slow)
            for k in FAMILIES if k not in skip]

_models: dict = {}


def tiny(kind: str):
    """The seeded tiny random model of ``kind`` (float32, eval, on sdpa), built once."""
    if kind not in _models:
        config_cls, model_cls, kw = FAMILIES[kind]
        config = getattr(transformers, config_cls)(**kw)
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(config).eval()
        model.generation_config.eos_token_id = None          # a fixed number of tokens
        model.set_attn_implementation(_reference(model))
        _models[kind] = model
    return _models[kind]


def _reference(model) -> str:
    """transformers' attention to compare with: sdpa, or eager where the family has no sdpa
    path (Gemma2)."""
    return "sdpa" if model._supports_sdpa else "eager"


def on_kvtvm(model, fn):
    """``fn()`` with ``model`` on kvtvm attention, on its reference attention afterwards."""
    hf.use_kvtvm(model)
    try:
        return fn()
    finally:
        model.set_attn_implementation(_reference(model))


def _left_padded(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, T - n:], mask[b, T - n:] = torch.randint(3, VOCAB, (n,), generator=g), 1
    return ids, mask


def _gen(model, ids, mask, cache=None, seed=None, **kw):
    if cache is not None:
        kw["cache"] = cache
    if seed is not None:
        torch.manual_seed(seed)
    kw.setdefault("do_sample", False)
    return model.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0, **kw)


def test_every_family_here_is_verified_and_vice_versa():
    """The list hf_support accepts is the list this file (and test_hf*.py for the Llama
    family) verifies."""
    llama_family = {"llama", "mistral", "qwen2", "smollm3"}
    assert set(hf_support.VERIFIED_MODEL_TYPES) == llama_family | set(FAMILIES)
    for kind in FAMILIES:
        assert tiny(kind).config.model_type == kind


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_left_padded_greedy_batch_and_logits_equal_sdpa(kind):
    """Three prompts of different lengths (longer than the 6-token windows), left-padded:
    the prompt's logits at real positions and 8 greedy tokens equal sdpa's, on the paged and
    the continuous cache; each row's sequence holds only its real tokens."""
    model = tiny(kind)
    lengths = [5, 13, 9]
    ids, mask = _left_padded(lengths, seed=11)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want_logits = model(ids, attention_mask=mask, position_ids=pos).logits
    want = _gen(model, ids, mask)
    caches = {c: hf.KVTVMCache(model, max_seq_len=24, cache=c, page_size=4)
              for c in ("paged", "continuous")}

    def run():
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, position_ids=pos,
                           cache=hf.KVTVMCache(model, 24, max_batch_size=3)).logits
        return logits, {c: _gen(model, ids, mask, kv) for c, kv in caches.items()}

    got_logits, got = on_kvtvm(model, run)
    real = mask.bool()
    torch.testing.assert_close(got_logits[real], want_logits[real], rtol=1e-4, atol=1e-4)
    for c, kv in caches.items():
        assert torch.equal(got[c], want), (kind, c)
        # the last token is still in flight (committed by a next forward or release)
        assert [kv.mgr.cache_length(s) for s in kv.seq_ids] == [n + 6 for n in lengths]


@pytest.mark.parametrize("kind", _kinds())
def test_sampling_equals_sdpa(kind):
    """Seeded sampling, two return sequences per prompt (batch expansion), paged cache for
    half the families and continuous for the others."""
    model = tiny(kind)
    ids, mask = _left_padded([4, 10], seed=13)
    kw = dict(do_sample=True, num_return_sequences=2, top_k=0, temperature=1.5, seed=5)
    want = _gen(model, ids, mask, **kw)
    cache = "paged" if sorted(FAMILIES).index(kind) % 2 else "continuous"
    got = on_kvtvm(model, lambda: _gen(model, ids, mask, hf.KVTVMCache(
        model, max_seq_len=18, cache=cache), **kw))
    assert torch.equal(got, want), kind


@pytest.mark.parametrize("kind", _kinds())
def test_beam_search_equals_sdpa(kind):
    model = tiny(kind)
    ids, mask = _left_padded([6, 11], seed=12)
    kw = dict(num_beams=3, num_return_sequences=2)
    want = _gen(model, ids, mask, **kw)
    cache = "continuous" if sorted(FAMILIES).index(kind) % 2 else "paged"
    kv = hf.KVTVMCache(model, max_seq_len=19, cache=cache, max_batch_size=2)
    got = on_kvtvm(model, lambda: _gen(model, ids, mask, kv, **kw))
    assert torch.equal(got, want), kind
    assert len(kv.seq_ids) == 6


def _batch(model, prompts, n, attn):
    from transformers import GenerationConfig

    if attn == "kvtvm":
        hf_batch.use_kvtvm_batch(model)
    gen = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cfg = hf_batch.cb_config(max(map(len, prompts)), n, len(prompts), page_size=4)
    try:
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cfg,
                                   warmup=False, progress_bar=False)
    finally:
        model.set_attn_implementation(_reference(model))
    return [list(out[f"req_{i}"].generated_tokens) for i in range(len(prompts))]


@pytest.mark.parametrize("kind", _kinds(skip=NO_GENERATE_BATCH))
def test_generate_batch_equals_sdpa(kind):
    """transformers' continuous batching with the "kvtvm_flash" attention."""
    model = tiny(kind)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 14, 9)]
    want = _batch(model, prompts, 8, "sdpa")
    hf_batch.KERNEL_CALLS.reset()
    got = _batch(model, prompts, 8, "kvtvm")
    assert hf_batch.KERNEL_CALLS.varlen + hf_batch.KERNEL_CALLS.kvcache > 0
    assert got == want, kind


@pytest.mark.slow
def test_gemma3_at_its_real_head_dim_of_256():
    """Gemma 3's real head_dim (256; kernels of their own, built on first use): greedy tokens
    and logits, beam search and generate_batch equal eager/sdpa."""
    kind = "gemma3_text"
    saved, cached = FAMILIES[kind], _models.pop(kind, None)
    FAMILIES[kind] = (saved[0], saved[1], dict(saved[2], head_dim=256, num_hidden_layers=2,
                                               layer_types=["sliding_attention",
                                                            "full_attention"]))
    try:
        test_left_padded_greedy_batch_and_logits_equal_sdpa(kind)
        test_beam_search_equals_sdpa(kind)
        test_generate_batch_equals_sdpa(kind)
        assert tiny(kind).config.head_dim == 256
    finally:
        FAMILIES[kind] = saved
        _models.pop(kind, None)
        if cached is not None:
            _models[kind] = cached


_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)
_MOE = dict(num_experts_per_tok=1, moe_intermediate_size=16)

#: (config class, model class, config kwargs, what the refusal names)
REFUSED = {
    "gemma2_softcap": ("Gemma2Config", "Gemma2ForCausalLM", dict(_SMALL, head_dim=8),
                       r"'gemma2'.*attn_logit_softcapping=50.0"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(_SMALL, head_dim=8, num_local_experts=2, num_experts_per_tok=1),
                "attention sinks"),
    "falcon_alibi": ("FalconConfig", "FalconForCausalLM",
                     dict(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                          num_attention_heads=4, alibi=True), "ALiBi"),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=64, hidden_size=32, n_layer=1,
                                                      n_head=4), "ALiBi"),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(_SMALL, head_dim=8, attention_chunk_size=8, num_local_experts=2,
                    intermediate_size_mlp=32), r"chunked attention \(attention_chunk_size=8\)"),
    "gemma3n": ("Gemma3nTextConfig", "Gemma3nForCausalLM",
                dict(_SMALL, head_dim=8, num_kv_shared_layers=1, vocab_size_per_layer_input=64,
                     hidden_size_per_layer_input=8, laurel_rank=4, altup_num_inputs=2),
                r"KV shared between layers \(num_kv_shared_layers=1\)"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(_SMALL, **_MOE, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                         qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=2,
                         first_k_dense_replace=2), "multi-head latent attention"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(_SMALL, **_MOE, head_dim=8, num_experts=2,
                        shared_expert_intermediate_size=16, linear_num_key_heads=2,
                        linear_num_value_heads=2, linear_key_head_dim=8,
                        linear_value_head_dim=8), r"layer_types \['linear_attention'\]"),
    "jamba": ("JambaConfig", "JambaForCausalLM",
              dict(_SMALL, num_experts=2, num_experts_per_tok=1, attn_layer_period=2,
                   attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                   use_mamba_kernels=False, mamba_d_state=4, mamba_expand=1),
              "not recurrent or hybrid"),
    "t5": ("T5Config", "T5ForConditionalGeneration",
           dict(vocab_size=64, d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=4),
           "encoder-decoder"),
    "gemma3_bidirectional": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                             dict(_SMALL, head_dim=8, use_bidirectional_attention=True),
                             "bidirectional attention"),
    "falcon": ("FalconConfig", "FalconForCausalLM",
               dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4),
               "does not run through transformers' AttentionInterface"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=1, n_embd=32, n_head=2, vocab_size=64),
             r"'gpt2'.*not among the families verified"),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_what_kvtvm_cannot_serve_exactly_is_refused_up_front(kind):
    """Each refusal is an UnsupportedModelError (an InvalidArgumentError) naming the model type
    and what is unsupported, from use_kvtvm, use_kvtvm_batch and KVTVMCache alike, and the
    model keeps its attention."""
    config_cls, model_cls, kw, match = REFUSED[kind]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kw))
    before = model.config._attn_implementation
    for call in (hf.use_kvtvm, hf_batch.use_kvtvm_batch, lambda m: hf.KVTVMCache(m, 16)):
        with pytest.raises(hf_support.UnsupportedModelError, match=match) as err:
            call(model)
        assert isinstance(err.value, InvalidArgumentError)
        assert "model_type" in str(err.value)
        assert model.config._attn_implementation == before
