"""transformers on kvtvm, batches as users build them: left-padded prompts of different lengths,
beam search, ``num_return_sequences``, batch re-indexing -- each equal token for token (or
logit for logit) to transformers' own sdpa/eager path, and every refusal typed and harmless."""

import numpy as np
import pytest
import torch
from helpers import on_kvtvm

from kvtvm.engine import build_toy_model
from kvtvm.errors import InvalidArgumentError, KVCacheCapacityError

hf = pytest.importorskip("kvtvm.integrations.hf")
from transformers import (DynamicCache, MistralConfig, MistralForCausalLM,  # noqa: E402
                          Qwen2Config, Qwen2ForCausalLM)


@pytest.fixture(scope="module")
def toy():
    return build_toy_model(num_layers=2)


def _tiny(kind: str):
    """A random 2-layer GQA model (std 0.1 weights, like build_toy_model): Mistral with a
    head_dim of its own (32, hidden 192 / 8 heads = 24) and a 6-token sliding window, Qwen2
    (q/k/v biases), or Qwen2 whose layer 0 attends in full and layer 1 over a 4-token window
    (``max_window_layers=1``: mixed ``layer_types``)."""
    common = dict(vocab_size=1000, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, initializer_range=0.1,
                  max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=None, pad_token_id=0)
    if kind == "mistral":
        config, cls = MistralConfig(hidden_size=192, head_dim=32, sliding_window=6, **common), \
            MistralForCausalLM
    elif kind == "qwen2_mixed":
        config, cls = Qwen2Config(hidden_size=256, use_sliding_window=True, sliding_window=4,
                                  max_window_layers=1, **common), Qwen2ForCausalLM
        assert config.layer_types == ["full_attention", "sliding_attention"]
    else:
        config, cls = Qwen2Config(hidden_size=256, **common), Qwen2ForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    model.generation_config.eos_token_id = None
    return model


def _left_padded(lengths, seed):
    """Fresh random prompts and their left-padded batch ``(prompts, ids, mask)``."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 1000, (n,), generator=g) for n in lengths]
    T = max(lengths)
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):], mask[b, T - len(p):] = p, 1
    return prompts, ids, mask


def _gen(model, ids, mask, cache=None, **kw):
    if cache is not None:
        kw["cache"] = cache
    kw.setdefault("do_sample", False)
    return model.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0, **kw)


@pytest.mark.parametrize("kind,cache,ref", [("llama", "paged", "sdpa"),
                                            ("llama", "continuous", "eager"),
                                            ("qwen2", "paged", "sdpa"),
                                            ("qwen2_mixed", "paged", "sdpa"),
                                            ("mistral", "paged", "eager")])
def test_left_padded_greedy_equals_each_prompt_unpadded(toy, kind, cache, ref):
    model = toy if kind == "llama" else _tiny(kind)
    prompts, ids, mask = _left_padded([5, 13, 9], seed=11)
    model.set_attn_implementation(ref)
    want = [_gen(model, p[None], torch.ones(1, len(p), dtype=torch.long))[0] for p in prompts]
    kv = hf.KVTVMCache(model, max_seq_len=21, cache=cache)       # longest prompt + 8
    got = on_kvtvm(model, lambda: _gen(model, ids, mask, kv))
    T = ids.shape[1]
    for b, p in enumerate(prompts):
        assert torch.equal(got[b, T - len(p):], want[b]), (kind, b)
    # each row's sequence holds only its real tokens: prompt + 7 fed back, the last forward's
    # token still in flight (committed by the next forward or by release)
    assert kv.pads.tolist() == [8, 0, 4]
    assert [kv.mgr.cache_length(s) for s in kv.seq_ids] == [len(p) + 6 for p in prompts]
    kv.release()
    assert len(kv.mgr.slots_remaining) == kv.mgr.max_batch_size == 3  # grown from 1


@pytest.mark.parametrize("cache,lengths,chunk", [("paged", [1, 7, 4], 3),
                                                 ("continuous", [3, 0, 6], 2)])
def test_chunked_prefill_of_a_left_padded_batch_equals_sdpa(toy, cache, lengths, chunk):
    """``prefill_chunk_size`` over a left-padded batch (padded to 8, so the first chunk is
    pads in every row, later ones in the short rows; one row pads only): a row with no token
    in a forward is left out of the fetch, its outputs zero -- what sdpa gives a row whose
    positions are all masked -- and the tokens equal sdpa's + DynamicCache's."""
    _, ids, mask = _left_padded(lengths, seed=19)
    ids, mask = (torch.cat([x.new_zeros(len(lengths), 8 - x.shape[1]), x], 1) for x in (ids, mask))
    kw = dict(prefill_chunk_size=chunk)
    want = _gen(toy, ids, mask, **kw)
    kv = hf.KVTVMCache(toy, max_seq_len=16, cache=cache, max_batch_size=3, page_size=2)
    got = on_kvtvm(toy, lambda: _gen(toy, ids, mask, kv, **kw))
    assert torch.equal(got, want)
    assert kv.pads.tolist() == [8 - n for n in lengths]
    assert [kv.mgr.cache_length(s) for s in kv.seq_ids] == [n + 6 for n in lengths]


@pytest.mark.parametrize("cache,beams,returns", [("paged", 2, 1), ("paged", 4, 3),
                                                 ("continuous", 3, 2)])
def test_beam_search_equals_dynamic_cache(toy, cache, beams, returns):
    _, ids, mask = _left_padded([6, 10], seed=12)
    kw = dict(num_beams=beams, num_return_sequences=returns)
    want = _gen(toy, ids, mask, **kw)                             # sdpa + DynamicCache
    kv = hf.KVTVMCache(toy, max_seq_len=18, cache=cache, max_batch_size=2)
    got = on_kvtvm(toy, lambda: _gen(toy, ids, mask, kv, **kw))
    assert torch.equal(got, want)
    assert len(kv.seq_ids) == 2 * beams and kv.mgr.max_batch_size == 2 * beams
    if cache == "paged":
        kv.mgr.check_invariants()
        assert kv.mgr.stats().pages_shared > 0              # beams share their prompt pages
    kv.release()
    assert len(kv.mgr.slots_remaining) == 2 * beams
    if cache == "paged":
        assert kv.mgr.stats().pages_used == 0


@pytest.mark.parametrize("cache", ["paged", "continuous"])
def test_beam_search_with_a_row_of_pads_only_equals_dynamic_cache(toy, cache):
    """A row with no token (mask all 0, supported) under beam search: its beams hold nothing
    when transformers first reorders them. The continuous cache's copy of such a row once
    fetched zero tokens and the manager refused it mid-generate."""
    _, ids, mask = _left_padded([5, 5], seed=13)
    mask[1] = 0
    kw = dict(num_beams=2, num_return_sequences=2, max_new_tokens=3)
    want = toy.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, **kw)
    kv = hf.KVTVMCache(toy, max_seq_len=12, cache=cache, max_batch_size=4)
    got = on_kvtvm(toy, lambda: toy.generate(ids, attention_mask=mask, cache=kv,
                                              do_sample=False, pad_token_id=0, **kw))
    assert torch.equal(got, want)


def test_sampled_num_return_sequences_equals_sdpa(toy):
    _, ids, mask = _left_padded([4, 7], seed=13)
    kw = dict(do_sample=True, num_return_sequences=3, top_k=0)
    torch.manual_seed(5)
    want = _gen(toy, ids, mask, **kw)
    kv = hf.KVTVMCache(toy, max_seq_len=15, cache="continuous")

    def run():
        torch.manual_seed(5)
        return _gen(toy, ids, mask, kv, **kw)

    got = on_kvtvm(toy, run)
    assert torch.equal(got, want)
    assert kv.pads.tolist() == [3, 3, 3, 0, 0, 0]


@pytest.mark.parametrize("cache", ["paged", "continuous"])
def test_batch_reindexing_equals_dynamic_cache(toy, cache):
    """Prefill a padded batch, repeat each row twice, decode, keep rows [3, 0, 0], decode:
    kvtvm's logits at real positions equal sdpa's over a DynamicCache doing the same; pad
    positions give finite logits."""
    _, ids, mask = _left_padded([3, 8], seed=14)
    g = torch.Generator().manual_seed(15)
    nxt = [torch.randint(3, 1000, (4, 1), generator=g), torch.randint(3, 1000, (3, 1), generator=g)]

    def run(kv_cache):
        outs, m = [], mask
        pos = (m.cumsum(-1) - 1).clamp(min=0)
        outs.append(toy(ids, attention_mask=m, position_ids=pos, cache=kv_cache).logits)
        kv_cache.batch_repeat_interleave(2)
        m = m.repeat_interleave(2, dim=0)
        for step, (tok, keep) in enumerate(zip(nxt, ([3, 0, 0], None))):
            m = torch.cat([m, torch.ones_like(tok)], dim=1)
            pos = m.sum(-1, keepdim=True) - 1
            outs.append(toy(tok, attention_mask=m, position_ids=pos, cache=kv_cache).logits)
            if keep is not None:
                kv_cache.batch_select_indices(torch.tensor(keep))
                m = m[keep]
        return outs

    toy.set_attn_implementation("sdpa")
    with torch.no_grad():
        want = run(DynamicCache(config=toy.config))
        kv = hf.KVTVMCache(toy, max_seq_len=16, cache=cache, max_batch_size=4)
        got = on_kvtvm(toy, lambda: run(kv))
    real = mask.bool()
    assert torch.isfinite(got[0]).all()
    torch.testing.assert_close(got[0][real], want[0][real], atol=2e-4, rtol=2e-4)
    for g_, w_ in zip(got[1:], want[1:]):
        torch.testing.assert_close(g_, w_, atol=2e-4, rtol=2e-4)
    assert len(kv.seq_ids) == 3 and kv.pads.tolist() == [0, 5, 5]
    if cache == "paged":
        kv.mgr.check_invariants()


def _manager_state(kv):
    m = kv.mgr
    return (sorted(m.slots_remaining), list(kv.seq_ids), kv.length, kv.pads.tolist(),
            [m.cache_length(s) for s in kv.seq_ids])


@pytest.mark.parametrize("bad", ["right", "hole_in_a_window", "right_after_a_hole"])
def test_unsupported_masks_refused_before_any_change(toy, bad):
    ids = torch.randint(3, 1000, (2, 6), generator=torch.Generator().manual_seed(16))
    mask = torch.ones_like(ids)
    model = toy
    if bad == "right":
        mask[1, 4:] = 0
    elif bad == "hole_in_a_window":         # without a window a hole is fine (test_hf_crop)
        mask[0, 2] = 0
        model = _tiny("mistral")
    else:                                   # a row of pads only is fine (chunked prefill)
        mask[1] = torch.tensor([0, 1, 1, 0, 1, 0])
        mask[0, 0] = 0
    kv = hf.KVTVMCache(model, 32, max_batch_size=2)
    before = _manager_state(kv)
    with pytest.raises(InvalidArgumentError, match="attention_mask row"):
        on_kvtvm(model, lambda: _gen(model, ids, mask, kv))
    assert _manager_state(kv) == before


def test_right_pads_in_a_later_chunk_wrong_history_and_4d_mask_refused(toy):
    _, ids, mask = _left_padded([3, 6], seed=17)
    kv = hf.KVTVMCache(toy, 32, max_batch_size=2)

    def run():
        toy(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), cache=kv)
        state = _manager_state(kv)
        nxt = torch.tensor([[5, 6], [7, 8]])
        m = torch.cat([mask, torch.tensor([[1, 1], [1, 0]])], dim=1)   # right pad, later chunk
        with pytest.raises(InvalidArgumentError, match=r"row 1 \(new positions\).*only before"):
            toy(nxt, attention_mask=m, cache=kv)
        m = torch.cat([mask, torch.tensor([[1, 1], [0, 0]])], dim=1)   # pads after tokens only:
        with pytest.raises(InvalidArgumentError, match=r"row 1 \(new positions\).*only before"):
            toy(nxt, attention_mask=m, cache=kv)     # sdpa's last logits there attend to them
        m = torch.cat([torch.ones_like(mask), torch.ones(2, 2, dtype=torch.long)], dim=1)
        with pytest.raises(InvalidArgumentError, match="cached positions"):
            toy(nxt, attention_mask=m, cache=kv)                    # history without its pads
        assert _manager_state(kv) == state
        with pytest.raises(InvalidArgumentError, match="2-D padding mask"):
            toy(nxt, attention_mask=torch.zeros(2, 1, 2, 8), cache=kv)

    on_kvtvm(toy, run)


def test_bad_reorder_refused_before_any_change(toy):
    _, ids, mask = _left_padded([3, 6], seed=18)
    kv = hf.KVTVMCache(toy, 32, max_batch_size=3)
    on_kvtvm(toy, lambda: toy(ids, attention_mask=mask,
                               position_ids=(mask.cumsum(-1) - 1).clamp(min=0), cache=kv))
    before = _manager_state(kv)
    for bad, match in (([0, 2], r"beam_idx\[1\]"), (torch.tensor([0.0, 1.0]), "dtype"),
                       ([1], "2 entries"), ([[0, 1]], "1-D")):
        with pytest.raises(InvalidArgumentError, match=match):
            kv.reorder_cache(bad)
        assert _manager_state(kv) == before
    with pytest.raises(KVCacheCapacityError, match="max_batch_size=3"):
        kv.batch_repeat_interleave(2)              # 4 rows, 3 slots: nothing released
    with pytest.raises(InvalidArgumentError, match="repeats"):
        kv.batch_repeat_interleave(0)
    assert _manager_state(kv) == before
    kv.reorder_cache(torch.tensor([1, 1]))
    assert kv.pads.tolist() == [0, 0] and len(set(kv.seq_ids)) == 2
    assert [kv.mgr.cache_length(s) for s in kv.seq_ids] == [6, 6]


def test_a_prefill_chunk_ending_inside_a_hole_refused_naming_the_chunk_size(toy):
    """A prompt with a hole (``[1, 1, 0, 1]``, supported) under ``prefill_chunk_size``: a
    chunk boundary after the hole gives sdpa's tokens; one inside it makes a forward end with
    a pad after a token (its output there would be read as the logits of a right-padded row),
    refused before anything changes -- naming prefill_chunk_size, not only right padding."""
    ids = torch.randint(3, 1000, (1, 4), generator=torch.Generator().manual_seed(12))
    mask = torch.tensor([[1, 1, 0, 1]])
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = toy.generate(ids, **kw)
    kv = hf.KVTVMCache(toy, 16)
    got = on_kvtvm(toy, lambda: toy.generate(ids, cache=kv, prefill_chunk_size=2, **kw))
    assert torch.equal(got, want)
    kv = hf.KVTVMCache(toy, 16)
    with pytest.raises(InvalidArgumentError, match=r"attention_mask row 0.*prefill_chunk_size"):
        on_kvtvm(toy, lambda: toy.generate(ids, cache=kv, prefill_chunk_size=3, **kw))
    assert kv.get_seq_length() == 0 and kv.seq_ids == []
