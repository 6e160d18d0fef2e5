"""transformers on kvtvm: ``generate`` through KVTVMCache + the "kvtvm" attention equals sdpa
token for token (toy Llama and SmolLM2), and what kvtvm lacks fails loudly (padded batches,
beams and batch expansion: test_hf_rows.py)."""

import pytest
import torch

from kvtvm import KVCacheParams
from kvtvm.engine import build_toy_model
from kvtvm.errors import InvalidArgumentError, SequenceTooLongError

hf = pytest.importorskip("kvtvm.integrations.hf")


def _generate(model, ids, cache=None, n=10):
    kw = {"cache": cache} if cache is not None else {}
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=n, pad_token_id=0, **kw)


@pytest.fixture(scope="module")
def toy():
    torch.manual_seed(0)
    return build_toy_model(num_layers=2)


@pytest.mark.parametrize("cache", ["paged", "continuous"])
def test_toy_generate_on_kvtvm_equals_sdpa(toy, cache):
    ids = torch.randint(3, 1000, (3, 21), generator=torch.Generator().manual_seed(1))
    toy.set_attn_implementation("sdpa")
    want = _generate(toy, ids)
    hf.use_kvtvm(toy)
    try:
        kv = hf.KVTVMCache(toy, max_seq_len=64, cache=cache, max_batch_size=3)
        got = _generate(toy, ids, kv)
        assert kv.get_seq_length() == ids.shape[1] + 9     # the last token is never fed back
        kv.release()
        assert len(kv.mgr.slots_remaining) == 3
    finally:
        toy.set_attn_implementation("sdpa")
    assert torch.equal(want, got)


@pytest.mark.parametrize("cache,storage", [
    ("paged", dict(cache_dtype="int8")),
    ("continuous", dict(cache_dtype="float8_e4m3fn")),
    ("paged", dict(k_cache_dtype="int8", skip_layers=(-1,))),   # K-only, last layer full
])
def test_toy_generate_on_an_8bit_kvtvm_cache(toy, cache, storage):
    """An 8-bit kvtvm cache under generate (append quantizes, attention dequantizes in the
    kernel) gives the tokens of transformers' sdpa whose attention input is quantized row by
    row with the reference quantizer (the quality bench's attention), and the cache holds the
    8-bit bytes: less memory than the float32 cache."""
    from kvtvm.engine.check import quantized_reference

    ids = torch.randint(3, 1000, (2, 19), generator=torch.Generator().manual_seed(3))
    params = KVCacheParams.from_hf_config(toy.config, dtype=torch.float32, page_size=16,
                                          **storage)
    with quantized_reference(toy, params):
        want = _generate(toy, ids)
        with torch.no_grad():
            want_logits = toy(ids).logits
    hf.use_kvtvm(toy)
    try:
        kv = hf.KVTVMCache(toy, max_seq_len=48, cache=cache, max_batch_size=2, **storage)
        got = _generate(toy, ids, kv)
        with torch.no_grad():   # the prompt's logits too (float32 KV differs by ~0.2 here)
            got_logits = toy(ids, cache=hf.KVTVMCache(toy, 48, cache=cache, max_batch_size=2,
                                                      **storage)).logits
    finally:
        toy.set_attn_implementation("sdpa")
    assert kv.params.quantized and kv.mgr.blocks[0].dtype == torch.uint8
    full = hf.KVTVMCache(toy, max_seq_len=48, cache=cache, max_batch_size=2)
    assert kv.mgr.device_nbytes() < full.mgr.device_nbytes()
    assert torch.equal(want, got)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=2e-3)


def test_left_padded_batch_on_an_8bit_cache_equals_the_quantized_reference(toy):
    """The quantized reference (sdpa over row-quantized K/V) masks pads as sdpa does: a
    left-padded batch on an int8 kvtvm cache gives its tokens, and its logits at real
    positions (the reference once attended to pads: logits off by whole units)."""
    from kvtvm.engine.check import quantized_reference

    g = torch.Generator().manual_seed(21)
    ids, mask = torch.zeros(3, 11, dtype=torch.long), torch.zeros(3, 11, dtype=torch.long)
    for b, n in enumerate([4, 11, 7]):
        ids[b, 11 - n:], mask[b, 11 - n:] = torch.randint(3, 1000, (n,), generator=g), 1
    storage = dict(cache_dtype="int8")
    params = KVCacheParams.from_hf_config(toy.config, dtype=torch.float32, page_size=16,
                                          **storage)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=8, pad_token_id=0)
    with quantized_reference(toy, params):
        want = toy.generate(ids, **kw)
        with torch.no_grad():
            want_logits = toy(ids, attention_mask=mask).logits
    hf.use_kvtvm(toy)
    try:
        got = toy.generate(ids, cache=hf.KVTVMCache(toy, 24, max_batch_size=3, **storage), **kw)
        with torch.no_grad():
            got_logits = toy(ids, attention_mask=mask, cache=hf.KVTVMCache(
                toy, 24, max_batch_size=3, **storage)).logits
    finally:
        toy.set_attn_implementation("sdpa")
    real = mask.bool()
    torch.testing.assert_close(got_logits[real], want_logits[real], rtol=1e-4, atol=2e-3)
    assert torch.equal(want, got)


def test_right_padded_batch_and_overflow_refused(toy):
    hf.use_kvtvm(toy)
    try:
        ids = torch.randint(3, 1000, (2, 8))
        mask = torch.ones_like(ids)
        mask[0, -1] = 0                                   # right padding (left: test_hf_rows)
        with pytest.raises(InvalidArgumentError, match="padding_side='left'"):
            toy.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                         pad_token_id=0, cache=hf.KVTVMCache(toy, 32, max_batch_size=2))
        with pytest.raises(SequenceTooLongError, match="max_seq_len=12"):
            _generate(toy, ids, hf.KVTVMCache(toy, 12, max_batch_size=2), n=8)
    finally:
        toy.set_attn_implementation("sdpa")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_kvtvm_cache_under_another_attention_refused(toy, attn):
    """A KVTVMCache on a model not switched to kvtvm (``use_kvtvm`` forgotten): the model's own
    attention would get back only this forward's K/V and decode without any history, so the
    first forward is refused, naming past_key_values and the cure, and nothing is claimed."""
    toy.set_attn_implementation(attn)
    try:
        kv = hf.KVTVMCache(toy, max_seq_len=32, max_batch_size=2)
        ids = torch.randint(3, 1000, (2, 5), generator=torch.Generator().manual_seed(4))
        with pytest.raises(InvalidArgumentError, match=f"past_key_values.*{attn}.*use_kvtvm"):
            _generate(toy, ids, kv, n=3)
        assert kv.get_seq_length() == 0 and len(kv.mgr.slots_remaining) == 2
    finally:
        toy.set_attn_implementation("sdpa")


def test_a_cache_of_a_kvtvm_model_refused_by_another_model_on_sdpa():
    """The check read the config of the model the cache was built for: model A on kvtvm, its
    cache handed to model B (same shape) still on sdpa gave B's tokens without any history,
    silently, and left K/V behind that a later forward of A without a cache picked up. Now
    the model calling the cache is the one judged; nothing is claimed or left behind."""
    a, b = build_toy_model(num_layers=2), build_toy_model(num_layers=2)
    hf.use_kvtvm(a)
    b.set_attn_implementation("sdpa")
    ids = torch.randint(3, 1000, (1, 7), generator=torch.Generator().manual_seed(6))
    kv = hf.KVTVMCache(a, max_seq_len=32)
    with pytest.raises(InvalidArgumentError, match="past_key_values.*'sdpa'.*use_kvtvm"):
        _generate(b, ids, kv, n=3)
    assert kv.get_seq_length() == 0 and not kv.seq_ids and not kv._kv
    with pytest.raises(InvalidArgumentError, match="KVTVMCache"), torch.no_grad():
        a(ids[:, :3], use_cache=False)  # no cache: refused, not B's leftovers taken
    # a caller the cache cannot see (no module frame): the second layer's update finds the
    # first layer's K/V untaken by kvtvm attention
    k = torch.randn(1, 4, 3, 16)
    kv2 = hf.KVTVMCache(a, max_seq_len=32)
    kv2.update(k, k, 0)
    with pytest.raises(InvalidArgumentError, match="past_key_values"):
        kv2.update(k, k, 1)
    assert not kv2._kv
    got = _generate(a, ids, hf.KVTVMCache(a, max_seq_len=32), n=3)  # its own model: served
    a.set_attn_implementation("sdpa")
    assert torch.equal(got, _generate(a, ids, n=3))


def test_a_cache_serves_only_a_model_of_its_layer_count():
    """A KVTVMCache built for another model: 2 cache layers under a 3-layer model raised a
    bare IndexError; 3 under a 2-layer model rolled each forward back as a failed one (the
    prompt forgotten: wrong tokens, no error); so did a model whose layers were pruned
    without editing its config."""
    import copy

    two, three = build_toy_model(num_layers=2), build_toy_model(num_layers=3)
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(5))
    for model in (two, three):
        hf.use_kvtvm(model)
    for built, runs in ((two, three), (three, two)):
        kv = hf.KVTVMCache(built, max_seq_len=32)
        with pytest.raises(InvalidArgumentError, match="serves the model it was made with"):
            _generate(runs, ids, kv, n=3)
        assert kv.get_seq_length() == 0 and len(kv.mgr.slots_remaining) == 1
    pruned = copy.deepcopy(three)
    pruned.model.layers = pruned.model.layers[:2]
    with pytest.raises(InvalidArgumentError, match="config says 3 layers"):
        hf.KVTVMCache(pruned, max_seq_len=32)


def test_not_a_supported_model_refused(toy):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    for bad in (None, "smollm2", toy.config, torch.nn.Linear(2, 2)):
        with pytest.raises(InvalidArgumentError, match="model: expected a transformers model"):
            hf.KVTVMCache(bad, 32)
        with pytest.raises(InvalidArgumentError, match="model: expected a transformers model"):
            hf.use_kvtvm(bad)
    for call in (lambda: hf.KVTVMCache(gpt2, 32), lambda: hf.use_kvtvm(gpt2)):
        with pytest.raises(InvalidArgumentError, match="model_type 'gpt2'"):
            call()
    assert gpt2.config._attn_implementation != hf.ATTN_NAME


@pytest.mark.parametrize("attn", ["kvtvm", "kvtvm_flash"])
def test_backward_through_kvtvm_attention_refused(toy, attn):
    """kvtvm's kernels have no backward: a forward with grad enabled (no torch.no_grad) gives
    sdpa's logits, and ``loss.backward()`` raises a typed error instead of silently leaving
    every q/k/v projection without a gradient (q_proj.weight.grad stayed None)."""
    from kvtvm.integrations.hf_batch import use_kvtvm_batch

    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = toy(ids).logits
    (use_kvtvm_batch if attn == "kvtvm_flash" else hf.use_kvtvm)(toy)
    try:
        kw = {"cache": hf.KVTVMCache(toy, 16)} if attn == "kvtvm" else {"use_cache": False}
        out = toy(ids, labels=ids, **kw)
        torch.testing.assert_close(out.logits.detach(), want, rtol=1e-4, atol=1e-4)
        with pytest.raises(InvalidArgumentError, match="no backward"):
            out.loss.backward()
    finally:
        toy.set_attn_implementation("sdpa")
        toy.zero_grad(set_to_none=True)


def test_softcap_refused():
    with pytest.raises(InvalidArgumentError, match="softcap"):
        hf.kvtvm_attention(None, None, None, None, None, softcap=30.0)


def test_params_from_hf_config(toy):
    p = KVCacheParams.from_hf_config(toy.config, dtype=torch.bfloat16, page_size=16)
    assert (p.n_kv_heads, p.head_dim, p.dtype, p.page_size) == (2, 32, "bfloat16", 16)
    with pytest.raises(InvalidArgumentError, match="config"):
        KVCacheParams.from_hf_config(object())


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf")
    from kvtvm.engine import load_model

    model, tok = load_model("smollm2")
    model.generation_config.eos_token_id = None            # a fixed number of tokens
    return model, tok


def _chat(tok, question):
    return tok.apply_chat_template([{"role": "user", "content": question}],
                                   add_generation_prompt=True, tokenize=False)


@pytest.mark.e2e
def test_smollm2_generate_on_kvtvm_equals_sdpa(smollm2):
    model, tok = smollm2
    ids = tok([_chat(tok, "What is the capital of France?")], return_tensors="pt")["input_ids"]
    model.set_attn_implementation("sdpa")
    want = _generate(model, ids, n=8)
    hf.use_kvtvm(model)
    try:
        got = _generate(model, ids, hf.KVTVMCache(model, 128), n=8)
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(want, got)
    assert "Paris" in tok.decode(got[0, ids.shape[1]:])


@pytest.mark.e2e
def test_smollm2_left_padded_batch_on_kvtvm_equals_each_prompt(smollm2):
    """What a user writes: ``tokenizer(prompts, padding=True, padding_side="left")`` and one
    batched ``generate``; each row equals its prompt generated alone on sdpa."""
    model, tok = smollm2
    texts = ["The capital of France is", "Roses are red, violets are blue, and the sky"]
    batch = tok(texts, padding=True, padding_side="left", return_tensors="pt")
    assert batch["attention_mask"].sum(1).tolist()[0] < batch["input_ids"].shape[1]  # padded
    model.set_attn_implementation("sdpa")
    want = [model.generate(**tok([t], return_tensors="pt"), do_sample=False, max_new_tokens=6)
            for t in texts]
    hf.use_kvtvm(model)
    try:
        got = model.generate(**batch, cache=hf.KVTVMCache(model, 64), do_sample=False,
                             max_new_tokens=6)
    finally:
        model.set_attn_implementation("sdpa")
    T = batch["input_ids"].shape[1]
    for b in range(len(texts)):
        assert torch.equal(got[b, T:], want[b][0, -6:]), tok.decode(got[b, T:])
    assert "Paris" in tok.decode(got[0, T:])


@pytest.mark.e2e
def test_smollm2_chunked_prefill_of_a_padded_chat_batch_equals_sdpa(smollm2):
    """Chat prompts of different lengths, left-padded, prefilled in chunks of 8 (the short
    prompt's first chunk is pads only): the tokens equal transformers' own."""
    model, tok = smollm2
    texts = [_chat(tok, q) for q in ("Hi", "Explain in one sentence why the sky is blue.")]
    batch = tok(texts, padding=True, padding_side="left", return_tensors="pt")
    pads = batch["input_ids"].shape[1] - int(batch["attention_mask"][0].sum())
    assert pads >= 8                                  # a whole chunk of row 0 is pads
    kw = dict(do_sample=False, max_new_tokens=6, prefill_chunk_size=8)
    model.set_attn_implementation("sdpa")
    want = model.generate(**batch, **kw)
    hf.use_kvtvm(model)
    try:
        got = model.generate(**batch, cache=hf.KVTVMCache(model, 64, max_batch_size=2), **kw)
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(want, got)
