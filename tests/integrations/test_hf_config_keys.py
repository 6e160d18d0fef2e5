"""Config keys the model's attention does not act on, and options kvtvm cannot give:

- a ``sliding_window`` key left in the config of a family whose attention has no window (a
  Llama or Gemma config made from a Mistral one): transformers attends in full, and so does
  kvtvm now (it windowed, from the config: wrong logits and tokens, no error). The reference is
  transformers without a cache: its DynamicCache keeps only the last ``sliding_window`` tokens
  of such a config and decodes wrong tokens itself;
- ``use_sliding_window=False`` on a family that windows by ``sliding_window`` alone
  (Mistral): transformers windows, kvtvm too (the first forward was refused);
- ``output_attentions=True``: a typed error (the weights came back as empty tuples);
- re-indexing after a first forward that failed midway (rolled back): typed errors or a
  no-op, not a bare IndexError;
- kvtvm's engine takes the window from what the layers' attention applies too.
"""

import pytest
import torch

from kvtvm.errors import InvalidArgumentError

hf = pytest.importorskip("kvtvm.integrations.hf")
import transformers  # noqa: E402

_BASE = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, num_hidden_layers=2, initializer_range=0.15,
             bos_token_id=1, eos_token_id=None, pad_token_id=0)


def _model(config_cls, model_cls, **kw):
    config = getattr(transformers, config_cls)(**dict(_BASE, **kw))
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    model.generation_config.eos_token_id = None
    model.set_attn_implementation("sdpa")
    return model


def _prompt(n=20, seed=3):
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _generate(model, x, **kw):
    return model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                          max_new_tokens=10, pad_token_id=0, **kw)[0, x.shape[1]:].tolist()


@pytest.mark.parametrize("kind", [("LlamaConfig", "LlamaForCausalLM"),
                                  ("GemmaConfig", "GemmaForCausalLM")])
def test_a_window_key_the_family_ignores_is_ignored(kind):
    model = _model(*kind, sliding_window=8)
    x = _prompt()
    want = _generate(model, x, use_cache=False)   # full attention, recomputed every step
    with torch.no_grad():
        want_logits = model(x).logits
    hf.use_kvtvm(model)
    try:
        got = _generate(model, x, cache=hf.KVTVMCache(model, max_seq_len=64))
        with torch.no_grad():
            got_logits = model(x, cache=hf.KVTVMCache(model, 64)).logits
    finally:
        model.set_attn_implementation("sdpa")
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)


def test_mistral_windows_whatever_use_sliding_window_says():
    model = _model("MistralConfig", "MistralForCausalLM", sliding_window=4,
                   use_sliding_window=False)
    x = _prompt(12)
    want = _generate(model, x)
    hf.use_kvtvm(model)
    try:
        got = _generate(model, x, cache=hf.KVTVMCache(model, max_seq_len=64))
    finally:
        model.set_attn_implementation("sdpa")
    assert got == want


def test_output_attentions_is_refused_and_the_cache_goes_on():
    model = _model("LlamaConfig", "LlamaForCausalLM")
    x = _prompt()
    want = _generate(model, x)
    hf.use_kvtvm(model)
    try:
        cache = hf.KVTVMCache(model, max_seq_len=64)
        with pytest.raises(InvalidArgumentError, match="output_attentions"):
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=2,
                           pad_token_id=0, cache=cache, output_attentions=True,
                           return_dict_in_generate=True)
        cache.reset()
        assert _generate(model, x, cache=cache) == want
    finally:
        model.set_attn_implementation("sdpa")


class _Boom(Exception):
    pass


@pytest.mark.parametrize("call", ["reorder_cache", "batch_select_indices",
                                  "batch_repeat_interleave", "crop"])
def test_reindexing_after_a_failed_first_forward(call):
    """The first forward stops in layer 0's MLP (rolled back at the next use of the cache):
    re-indexing then sees no rows -- a typed error or nothing to do."""
    model = _model("LlamaConfig", "LlamaForCausalLM")
    x = torch.cat([_prompt(6, 1), _prompt(6, 2)])
    hf.use_kvtvm(model)
    mlp = model.model.layers[0].mlp
    forward = mlp.forward
    try:
        cache = hf.KVTVMCache(model, max_seq_len=64, max_batch_size=2)
        mlp.forward = lambda *a, **k: (_ for _ in ()).throw(_Boom())
        with pytest.raises(_Boom), torch.no_grad():
            model(x, cache=cache, attention_mask=torch.ones_like(x))
        mlp.forward = forward
        if call == "reorder_cache":
            with pytest.raises(InvalidArgumentError):
                cache.reorder_cache(torch.tensor([1, 0]))
        elif call == "batch_select_indices":
            with pytest.raises(InvalidArgumentError):
                cache.batch_select_indices(torch.tensor([1]))
        elif call == "batch_repeat_interleave":
            cache.batch_repeat_interleave(2)
        else:
            with pytest.raises(InvalidArgumentError):
                cache.crop(-3)
        assert cache.seq_ids == []
        want = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=4,
                              do_sample=False, pad_token_id=0, cache=cache)
    finally:
        mlp.forward = forward
        model.set_attn_implementation("sdpa")
    assert torch.equal(want, model.generate(x, attention_mask=torch.ones_like(x),
                                            max_new_tokens=4, do_sample=False, pad_token_id=0))


def test_engine_ignores_a_window_key_the_family_ignores():
    from kvtvm.engine.runner import ModelRunner, attention_windows

    llama = _model("LlamaConfig", "LlamaForCausalLM", sliding_window=8)
    assert attention_windows(llama) == [None, None]
    assert ModelRunner(llama).sliding_window is None
    mistral = _model("MistralConfig", "MistralForCausalLM", sliding_window=4,
                     use_sliding_window=False)
    assert attention_windows(mistral) == [4, 4]
    qwen2 = _model("Qwen2Config", "Qwen2ForCausalLM", sliding_window=4,
                   use_sliding_window=True, max_window_layers=0)
    assert attention_windows(qwen2) == [4, 4]
    plain = _model("Qwen2Config", "Qwen2ForCausalLM", sliding_window=4,
                   use_sliding_window=False)
    assert attention_windows(plain) == [None, None]
