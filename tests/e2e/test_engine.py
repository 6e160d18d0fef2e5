"""kvtvm.engine: stop tokens, chunked prefill, sampling, abort, threads, the model runner and
bad models, each checked against transformers (toy Llama; SmolLM2 on a few short chats)."""

import numpy as np
import pytest
import torch
from helpers import random_prompt

from kvtvm.engine import (Engine, ModelRunner, Request, UnsupportedModelError,
                          check_against_reference, check_supported, configure_threads,
                          load_model, reference_tokens)
from kvtvm.errors import InvalidArgumentError

pytestmark = pytest.mark.e2e


def _engine(model, cache="paged", **kw):
    e = Engine(model, cache, max_batch_size=3, max_seq_len=96, page_size=16, **kw)
    e.log = lambda s: None
    return e


@pytest.mark.parametrize("cache", ["paged", "linear"])
def test_chunked_prefill_matches_transformers(toy, cache):
    """Prompts longer than the step budget are computed in chunks, mixed with decodes."""
    rng = np.random.default_rng(0)
    reqs = [Request(i, random_prompt(rng, 30 + 11 * i), 6, arrival=i) for i in range(3)]
    e = _engine(toy, cache, max_step_tokens=16)
    e.serve(reqs)
    assert all(r.status == "done" for r in reqs)
    assert e.stats.steps > 10 and e.stats.mixed_steps > 0
    assert check_against_reference(toy, reqs) == []


def test_stop_token_ends_request_like_generate(toy):
    rng = np.random.default_rng(1)
    prompt = random_prompt(rng, 12)
    free = reference_tokens(toy, prompt, 10)
    stop = free[4]                        # the 5th greedy token becomes a stop token
    req = Request(0, prompt, 10, stop_token_ids=(stop,))
    e = _engine(toy)
    e.serve([req])
    want = reference_tokens(toy, prompt, 10, (stop,))
    assert req.output == want == free[:free.index(stop) + 1]
    assert req.finish_reason == "stop"
    assert e.kv.mgr.stats().pages_used == 0


def test_sampling_is_seeded_and_differs_from_greedy(toy):
    rng = np.random.default_rng(2)
    prompt = random_prompt(rng, 10)

    def run(seed, temperature):
        r = Request(0, prompt, 12, temperature=temperature, top_p=0.9, seed=seed)
        _engine(toy).serve([r])
        return r.output

    assert run(5, 1.5) == run(5, 1.5)
    assert run(5, 1.5) != run(6, 1.5) or run(5, 1.5) != reference_tokens(toy, prompt, 12)
    assert run(5, 0.0) == reference_tokens(toy, prompt, 12)
    bad = Request(1, prompt, 4, top_p=0.0)
    _engine(toy).serve([bad])
    assert bad.status == "rejected" and "top_p" in bad.error


def test_abort_releases(toy):
    rng = np.random.default_rng(3)
    reqs = [Request(i, random_prompt(rng, 20), 30) for i in range(3)]
    e = _engine(toy)
    for r in reqs:
        e.submit(r)
    e.step()
    e.step()
    assert e.abort(1) and not e.abort(1) and not e.abort(99)
    assert reqs[1].status == "aborted"
    while not e.idle:
        e.step()
    assert [r.status for r in reqs] == ["done", "aborted", "done"]
    assert check_against_reference(toy, reqs) == []
    assert e.kv.mgr.stats().pages_used == 0


def test_threads_configured_at_first_step(toy):
    before = torch.get_num_threads()
    try:
        e = _engine(toy, torch_threads=1, kernel_threads=1)
        torch.set_num_threads(2)
        e.serve([Request(0, [5, 6, 7], 2)])
        assert torch.get_num_threads() == 1
        with pytest.raises(InvalidArgumentError, match="torch_threads"):
            configure_threads(0)
    finally:
        torch.set_num_threads(before)
        configure_threads(None, None)
        import kvtvm.runtime

        kvtvm.runtime.set_num_threads(None)


def test_runner_checks_counts_and_models(toy):
    e = _engine(toy)
    (seq,) = e.kv.mgr.claim(1)
    from kvtvm.inputs import BatchItem

    (kv,) = e.kv.mgr.fetch([BatchItem(seq, [5, 6, 7])])
    with pytest.raises(InvalidArgumentError, match="new_tokens"):
        ModelRunner(toy).run_step(kv, [[5, 6]])
    logits = ModelRunner(toy).run_step(kv, [[5, 6, 7]])
    assert logits.shape == (1, 1000)
    cfg = type("C", (), {"model_type": "gemma2", "attn_logit_softcapping": 50.0})()
    with pytest.raises(UnsupportedModelError, match="gemma2"):
        check_supported(cfg)
    cfg.model_type = "llama"
    with pytest.raises(UnsupportedModelError, match="softcap"):
        check_supported(cfg)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    mixed = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
        sliding_window=4, max_window_layers=1))
    with pytest.raises(UnsupportedModelError, match="sliding-window layers mixed"):
        ModelRunner(mixed)           # one window for every layer would be silently wrong
    with pytest.raises(InvalidArgumentError, match="no such directory"):
        load_model("/nonexistent/model")
    with pytest.raises(InvalidArgumentError, match="dtype"):
        load_model("toy", dtype="int8")


def test_smollm3_layers_without_rope_match_transformers():
    """SmolLM3 skips RoPE in every fourth layer (``no_rope_layers``): the runner follows each
    layer's ``use_rope`` (it once rotated every layer: tokens differed from the first)."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    cfg = SmolLM3Config(vocab_size=1000, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        initializer_range=0.1, pad_token_id=0, eos_token_id=None)
    assert 0 in cfg.no_rope_layers
    torch.manual_seed(0)
    model = SmolLM3ForCausalLM(cfg).eval()
    rng = np.random.default_rng(7)
    reqs = [Request(i, random_prompt(rng, 9 + 4 * i), 6) for i in range(2)]
    _engine(model).serve(reqs)
    assert check_against_reference(model, reqs) == []


def test_smollm2_chat_matches_transformers():
    """The real model, small: three short chats (two share SmolLM2's system prompt, so the
    paged cache hits), 12 new tokens, stopping at EOS, equal to generate token for token."""
    pytest.importorskip("gguf")
    model, tok = load_model("smollm2")
    chats = ["What is the capital of France?", "Name a color.", "What is 2 + 2?"]
    reqs = []
    for i, q in enumerate(chats):
        ids = tok.apply_chat_template([{"role": "user", "content": q}],
                                      add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        reqs.append(Request(i, ids, 12, arrival=i))
    e = Engine(model, "paged", max_batch_size=3, max_seq_len=128, page_size=16)
    e.log = lambda s: None
    e.serve(reqs)
    assert check_against_reference(model, reqs) == []
    assert e.stats.prefix_hit_tokens > 0
    assert "Paris" in tok.decode(reqs[0].output)
    assert any(r.finish_reason == "stop" and r.output[-1] == tok.eos_token_id for r in reqs)


def test_second_engine_served_warm_from_the_disk_tier(toy, tmp_path):
    """An engine with a disk tier persists its prefix cache at close; a new engine on the
    same directory (a restart) reads the shared system prompt from disk, and both generate
    what transformers does."""
    rng = np.random.default_rng(7)
    system = random_prompt(rng, 48)  # 3 full pages
    first = [Request(0, system + random_prompt(rng, 5), 4)]
    a = _engine(toy, host_tier_pages=4, disk_tier_dir=tmp_path / "kv")
    a.serve(first)
    assert a.close() >= 3
    assert len(list((tmp_path / "kv").glob("*.kvp"))) >= 3
    second = [Request(1, system + random_prompt(rng, 7), 4)]
    b = _engine(toy, disk_tier_dir=tmp_path / "kv")
    b.serve(second)
    assert second[0].prefix_hit_tokens == 48 and b.stats.prefix_hit_tokens == 48
    assert b.kv.mgr.stats().tiers["disk"]["hits"] >= 3
    assert check_against_reference(toy, first + second) == []
    b.close(persist=False)
    cold = [Request(2, system + [5], 2)]
    c = _engine(toy)  # no tiers: cold
    c.serve(cold)
    assert cold[0].prefix_hit_tokens == 0
    with pytest.raises(InvalidArgumentError, match="prefix caching"):
        _engine(toy, cache="linear", disk_tier_dir=tmp_path / "kv")
