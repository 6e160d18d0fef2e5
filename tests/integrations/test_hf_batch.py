"""transformers' continuous batching on kvtvm: ``generate_batch`` with the "kvtvm_flash"
attention equals sdpa token for token (toy Llama; SmolLM2 on two short prompts), kvtvm's
flash-attn functions match a torch reference (scale, causal, window, GQA, paged views), what
kvtvm lacks is refused, and a transformers without the names the adapter relies on fails
loudly."""

import numpy as np
import pytest
import torch

from kvtvm.engine import build_toy_model
from kvtvm.errors import InvalidArgumentError

hfb = pytest.importorskip("kvtvm.integrations.hf_batch")


def reference(q, k, v, cu_q, cu_k, scale, causal, window=None):
    """Per-sequence softmax attention in float64 (flash-attn's bottom-right causal)."""
    outs = []
    group = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        qb = q[cu_q[b]:cu_q[b + 1]].double()
        kb = k[cu_k[b]:cu_k[b + 1]].double().repeat_interleave(group, 1)
        vb = v[cu_k[b]:cu_k[b + 1]].double().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", qb, kb) * scale
        pos_q = torch.arange(qb.shape[0])[:, None] + kb.shape[0] - qb.shape[0]
        pos_k = torch.arange(kb.shape[0])[None, :]
        mask = torch.zeros_like(pos_q * pos_k, dtype=torch.bool)
        if causal:
            mask |= pos_k > pos_q
        if window is not None:
            mask |= pos_k < pos_q - window[0]
        s = s.masked_fill(mask, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vb))
    return torch.cat(outs).float()


def ragged(q_lens, kv_lens, hq=8, hkv=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    k = torch.randn(sum(kv_lens), hkv, d, generator=g)
    v = torch.randn(sum(kv_lens), hkv, d, generator=g)
    cu = lambda n: torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32)  # noqa
    return q, k, v, cu(q_lens), cu(kv_lens)


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (5, 5))])
def test_varlen_matches_reference(causal, window):
    q_lens, kv_lens = [7, 1, 12], [19, 9, 12]          # chunked prefill, a decode row, a prompt
    q, k, v, cu_q, cu_k = ragged(q_lens, kv_lens)
    scale = 0.3
    got = hfb.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 19, softmax_scale=scale,
                                     causal=causal, window_size=window or (-1, -1))
    want = reference(q, k, v, cu_q.tolist(), cu_k.tolist(), scale, causal, window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_varlen_decode_rows_and_dense():
    q, k, v, cu_q, cu_k = ragged([1, 1, 1], [5, 17, 30], seed=1)
    got = hfb.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 30, causal=True,
                                     window_size=(7, 7))
    want = reference(q, k, v, cu_q.tolist(), cu_k.tolist(), 32 ** -0.5, True, (7, 7))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    qd, kd, vd = (torch.randn(2, n, h, 32) for n, h in ((6, 8), (6, 2), (6, 2)))
    dense = hfb.flash_attn_func(qd, kd, vd, causal=True)
    cu = torch.tensor([0, 6, 12], dtype=torch.int32)
    want = reference(qd.reshape(12, 8, 32), kd.reshape(12, 2, 32), vd.reshape(12, 2, 32),
                     cu.tolist(), cu.tolist(), 32 ** -0.5, True)
    torch.testing.assert_close(dense.reshape(12, 8, 32), want, atol=2e-5, rtol=1e-4)


def test_with_kvcache_on_interleaved_page_views():
    """transformers' page views: K and V pages of a layer interleaved with other layers' in
    one buffer (strided views), a -1 padded block table, pre-append lengths."""
    g = torch.Generator().manual_seed(2)
    page, hkv, d, layers = 4, 2, 32, 2
    buf = torch.randn(40 * 2 * layers * page, hkv, d, generator=g)
    stride = 2 * layers                        # pages of one block: K, V of every layer
    k_pages = buf[0 * page:].view(-1, page, hkv, d)[::1]
    v_pages = buf[1 * page:].view(-1, page, hkv, d)
    n = min(k_pages.shape[0], v_pages.shape[0])
    k_pages, v_pages = k_pages[:n], v_pages[:n]
    lengths = torch.tensor([5, 0, 11], dtype=torch.int32)
    table = torch.full((3, 5), -1, dtype=torch.int32)
    blocks = [[3, 7], [1], [9, 2, 5]]
    for b, ids in enumerate(blocks):
        table[b, :len(ids)] = torch.tensor(ids) * stride
    q = torch.randn(3, 1, 8, d, generator=g)
    k_new, v_new = torch.randn(3, 1, hkv, d, generator=g), torch.randn(3, 1, hkv, d, generator=g)
    before = buf.clone()
    out = hfb.flash_attn_with_kvcache(q, k_pages, v_pages, k_new, v_new, block_table=table,
                                      cache_seqlens=lengths, softmax_scale=0.2, causal=True)
    for b in range(3):
        L = int(lengths[b])
        rows = lambda pages: torch.cat([pages[int(p)] for p in table[b] if p >= 0])  # noqa
        kk, vv = rows(k_pages)[:L + 1], rows(v_pages)[:L + 1]
        torch.testing.assert_close(kk[L], k_new[b, 0])          # appended in place
        want = reference(q[b], kk, vv, [0, 1], [0, L + 1], 0.2, True)
        torch.testing.assert_close(out[b], want, atol=2e-5, rtol=1e-4)
    changed = (buf != before).any(-1).any(-1).sum().item()
    assert changed == 2 * 3                     # one K row and one V row per sequence


def test_refusals_change_nothing():
    q, k, v, cu_q, cu_k = ragged([3], [3])
    keep = k.clone()
    with pytest.raises(InvalidArgumentError, match="softcap"):
        hfb.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True, softcap=30.0)
    with pytest.raises(InvalidArgumentError, match="ALiBi"):
        hfb.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True,
                                   alibi_slopes=torch.ones(8))
    with pytest.raises(InvalidArgumentError, match="causal"):
        hfb.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=False, window_size=(2, 2))
    with pytest.raises(InvalidArgumentError, match="sinks"):
        hfb.flash_attn_with_kvcache(q[:, None], k[:, None], v[:, None], s_aux=torch.ones(8))
    assert torch.equal(k, keep)


@pytest.mark.parametrize("bad", [dict(page_size=0), dict(page_size=-1), dict(page_size=2.5),
                                 dict(page_size=1), dict(page_size=3),   # transformers: >= 4
                                 dict(num_requests=0), dict(max_prompt_len=-5),
                                 dict(max_new_tokens=True), dict(max_batch_tokens=0)])
def test_cb_config_refuses_bad_sizes(bad):
    (name, _), = bad.items()
    args = {**dict(max_prompt_len=10, max_new_tokens=5, num_requests=2), **bad}
    with pytest.raises(InvalidArgumentError, match=f"^{name}: expected a"):
        hfb.cb_config(**args)


def test_use_kvtvm_batch_refuses_what_it_does_not_support():
    """``use_kvtvm_batch`` checks its model as ``use_kvtvm`` does: not a transformers model, or
    not a supported one (GPT-2: transformers' flash path dies on its Conv1D layers, and
    generate_batch only logs the failed requests) -> typed, naming ``model``, unchanged."""
    from transformers import GPT2Config, GPT2LMHeadModel

    for bad in (None, "smollm2", torch.nn.Linear(2, 2)):
        with pytest.raises(InvalidArgumentError, match="model: expected a transformers model"):
            hfb.use_kvtvm_batch(bad)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(InvalidArgumentError, match="model_type 'gpt2'"):
        hfb.use_kvtvm_batch(gpt2)
    assert gpt2.config._attn_implementation != hfb.KVTVM_FLASH


@pytest.mark.parametrize("case", ["kvtvm attention", "gpt_neox"])
def test_generate_batch_refuses_what_continuous_batching_cannot_run(case):
    """generate_batch on 'kvtvm' attention (use_kvtvm, not use_kvtvm_batch) raised
    transformers' bare ValueError naming its own attentions; GPT-NeoX on 'kvtvm_flash'
    failed every request and only logged it. Both are typed, naming the cure, before a request
    runs; the model is unchanged and serves afterwards."""
    import transformers
    from transformers import GenerationConfig

    from kvtvm.integrations import hf

    torch.manual_seed(0)
    if case == "gpt_neox":
        model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
            vocab_size=64, hidden_size=32, num_attention_heads=2, intermediate_size=32,
            num_hidden_layers=1)).eval()
        hfb.use_kvtvm_batch(model)
        match = "model_type 'gpt_neox'"
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=32, num_hidden_layers=1)).eval()
        hf.use_kvtvm(model)
        match = "use_kvtvm_batch"
    gen = GenerationConfig(max_new_tokens=3, eos_token_id=-1, pad_token_id=0)
    with pytest.raises(InvalidArgumentError, match=match):
        model.generate_batch([[5, 6, 7]], generation_config=gen,
                             continuous_batching_config=hfb.cb_config(3, 3, 1), warmup=False)
    ids = torch.tensor([[5, 6, 7]])
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    got = model.generate(ids, **kw, **({} if case == "gpt_neox" else
                                       {"cache": hf.KVTVMCache(model, 8)}))
    model.set_attn_implementation("sdpa")
    assert torch.equal(got, model.generate(ids, **kw))


def test_varlen_names_the_callers_k_and_v():
    """A k or v whose last axis is strided was refused naming ``k_cache``, the kernel's
    argument, not the caller's."""
    q = torch.randn(3, 4, 16)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    k = torch.randn(3, 2, 32)[..., ::2]
    for name, kv in (("k", (k, torch.randn(3, 2, 16))), ("v", (torch.randn(3, 2, 16), k))):
        with pytest.raises(InvalidArgumentError, match=rf"^{name}\.stride\(-1\)"):
            hfb.flash_attn_varlen_func(q, *kv, cu, cu, causal=True)


def test_transformers_change_fails_loudly(monkeypatch):
    monkeypatch.delattr(hfb._mfa, "_flash_varlen_fn")
    with pytest.raises(ImportError, match="_flash_varlen_fn"):
        hfb.check_transformers()


def _batch(model, prompts, n, attn, cfg=None):
    from transformers import GenerationConfig

    model.set_attn_implementation("sdpa")
    if attn == "kvtvm":
        hfb.use_kvtvm_batch(model)
    else:
        model.set_attn_implementation(attn)
    gen = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cfg = cfg or hfb.cb_config(max(map(len, prompts)), n, len(prompts))
    try:
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cfg,
                                   warmup=False, progress_bar=False)
    finally:
        model.set_attn_implementation("sdpa")
    return [list(out[f"req_{i}"].generated_tokens) for i in range(len(prompts))]


def test_toy_generate_batch_on_kvtvm_equals_sdpa():
    torch.manual_seed(0)
    toy = build_toy_model(num_layers=2)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 1000, n).tolist() for n in (5, 23, 40, 9)]
    want = _batch(toy, prompts, 10, "sdpa")
    hfb.KERNEL_CALLS.reset()
    # a small token budget: prompts are split into chunks mixed with decodes
    small = hfb.cb_config(40, 10, 4, max_batch_tokens=24)
    got = _batch(toy, prompts, 10, "kvtvm", small)
    calls = hfb.KERNEL_CALLS
    assert calls.varlen + calls.kvcache >= 2 * 10     # every layer of every step on kvtvm
    # pure decode steps take transformers' block-table path (kvtvm's append + decode on its
    # pages, no read-back copy), prompt chunks the varlen path
    assert calls.kvcache >= 2 and calls.varlen >= 2
    assert got == want
    assert _batch(toy, prompts, 10, "paged|eager") == want


@pytest.mark.e2e
def test_smollm2_generate_batch_on_kvtvm_equals_sdpa():
    pytest.importorskip("gguf")
    from kvtvm.engine import load_model

    model, tok = load_model("smollm2")
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}],
                                       add_generation_prompt=True, tokenize=True)
               for c in ("What is the capital of France?", "Name a primary color.")]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    want = _batch(model, prompts, 6, "sdpa")
    hfb.KERNEL_CALLS.reset()
    got = _batch(model, prompts, 6, "kvtvm")
    assert got == want
    assert hfb.KERNEL_CALLS.kvcache >= 30              # decode steps on the block-table path
    assert "Paris" in tok.decode(got[0])
