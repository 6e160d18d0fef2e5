"""kvtvm.engine on inputs off the usual grid (session 12's fuzzing of the serving path): tiny
random models of each supported family with configs the other tests do not use, request
fields of types a caller may well pass (numpy scalars, generators, non-int request ids), and
models that are not models. Served tokens equal transformers'; bad input is refused by name
(typed) and the engine serves the next good request."""

import os

import numpy as np
import pytest
import torch
from helpers import random_prompt

from kvtvm.engine import (Engine, ModelRunner, Request, UnsupportedModelError,
                          check_against_reference, reference_tokens)

pytestmark = pytest.mark.e2e


def tiny(kind, seed=0, **kw):
    """A seeded random 2-layer float32 ``kind`` model (llama, mistral, qwen2, smollm3)."""
    import transformers

    transformers.logging.set_verbosity_error()
    names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "smollm3": "SmolLM3"}
    config = getattr(transformers, f"{names[kind]}Config")(**{
        "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "initializer_range": 0.1,
        "pad_token_id": 0, "eos_token_id": None, "bos_token_id": 1,
        "max_position_embeddings": 512, **kw})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{names[kind]}ForCausalLM")(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _engine(model, cache="paged", **kw):
    kw = {"max_batch_size": 3, "max_seq_len": 48, "page_size": 8, **kw}
    e = Engine(model, cache, **kw)
    e.log = lambda s: None
    return e


def test_smollm3_sliding_window_flag_without_sliding_layers():
    """SmolLM3 with ``use_sliding_window=True`` lists every layer as full attention
    (``layer_types``) and transformers attends in full; the runner took the config's
    ``sliding_window`` for every layer (tokens differed from the second)."""
    model = tiny("smollm3", use_sliding_window=True, sliding_window=3)
    assert set(model.config.layer_types) == {"full_attention"}
    assert ModelRunner(model).sliding_window is None
    rng = np.random.default_rng(0)
    reqs = [Request(i, random_prompt(rng, 6 + 5 * i), 5) for i in range(2)]
    _engine(model).serve(reqs)
    assert check_against_reference(model, reqs) == []


@pytest.mark.parametrize("window", [1, 2])
def test_mistral_windows_of_one_and_two_tokens(window):
    """Windows far shorter than the prompt, through every cache and chunk size. kvtvm is
    compared with transformers' forward without a cache: at ``sliding_window=1``
    transformers' own cached ``generate`` (5.24) differs from its cache-less forward from the
    second token (its sliding cache keeps ``[-sliding_window + 1:]``, at 1 every token), so it
    is no reference there."""
    model = tiny("mistral", sliding_window=window)
    prompt = [3, 4, 5, 9, 11, 40, 7]
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(5):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    want = seq[len(prompt):]
    for cache, chunk in (("paged", None), ("continuous", 1), ("linear", 3)):
        r = Request(0, prompt, 5)
        _engine(model, cache, max_step_tokens=chunk).serve([r])
        assert r.output == want, (cache, chunk)


@pytest.mark.parametrize("bad", [None, "smollm2", 5])
def test_engine_refuses_what_is_not_a_model(bad):
    """None, a name or a number raised AttributeError (``.parameters``)."""
    with pytest.raises(UnsupportedModelError, match="model"):
        Engine(bad)


def test_engine_refuses_the_base_model():
    """The base ``LlamaModel`` (no LM head) raised AttributeError (``.model``)."""
    with pytest.raises(UnsupportedModelError, match="ForCausalLM"):
        Engine(tiny("llama").model)


def test_request_fields_of_other_types(toy):
    """Values a caller may well pass: a numpy seed (``manual_seed`` raised TypeError out of
    ``step`` and the request was lost), a string or None request id with no seed (the id
    seeded the generator: RuntimeError), a prompt given as a generator (TypeError, ``len``),
    a dict or a set as the prompt (a dict's keys were taken, then slicing it raised), stop
    ids given as a generator (read by the check, then empty: the request never stopped). Each is
    served or rejected by name, and the good request beside it gets transformers' tokens."""
    rng = np.random.default_rng(3)
    p = random_prompt(rng, 9)
    want = reference_tokens(toy, p, 5)
    sampled = {"np seed": Request(0, p, 5, temperature=0.7, seed=np.int64(11)),
               "int seed": Request(1, p, 5, temperature=0.7, seed=11),
               "str rid": Request("a", p, 5, temperature=0.7),
               "None rid": Request(None, p, 5, temperature=0.7),
               "huge rid": Request(1 << 70, p, 5, temperature=0.7)}
    greedy = {"generator": Request(10, (t for t in p), 5),
              "tensor": Request(11, torch.tensor(p, dtype=torch.int32), 5),
              "np": Request(12, np.array(p, dtype=np.uint16), 5)}
    bad = {"dict": Request(20, dict.fromkeys(p, 1), 5),
           "set": Request(21, set(p), 5)}
    good = Request(30, p, 5)
    stops = Request(31, p, 5, stop_token_ids=(t for t in [want[1]]))   # read twice: lost
    e = _engine(toy, max_seq_len=64)
    e.serve([*sampled.values(), *greedy.values(), *bad.values(), good, stops])
    assert stops.output == want[:want.index(want[1]) + 1] and stops.finish_reason == "stop"
    for name, r in {**sampled, **greedy}.items():
        assert r.status == "done" and len(r.output) == 5, (name, r.error)
    assert sampled["np seed"].output == sampled["int seed"].output
    for name, r in greedy.items():
        assert r.prompt == p and r.output == want, name
    for name, r in bad.items():
        assert r.status == "rejected" and "prompt" in r.error and r.output == [], name
    assert "input_ids" in bad["dict"].error
    assert good.output == want
    assert e.kv.mgr.stats().pages_used == 0 and len(e.kv.mgr.slots_remaining) == 3
    again = Request("a", p, 5, temperature=0.7)       # a string id seeds the same way twice
    _engine(toy, max_seq_len=64).serve([again])
    assert again.output == sampled["str rid"].output


@pytest.mark.parametrize("cache", ["paged", "continuous", "linear"])
def test_cpu_0_is_the_cpu(toy, cache):
    """``device="cpu:0"`` with the model on the CPU was refused ("expected the model's
    device (cpu)")."""
    rng = np.random.default_rng(4)
    reqs = [Request(i, random_prompt(rng, 5 + 7 * i), 4) for i in range(2)]
    _engine(toy, cache, device="cpu:0").serve(reqs)
    assert check_against_reference(toy, reqs) == []


def test_stats_add_up_over_serve_calls(toy):
    """``stats.seconds`` was the last ``serve()``'s time while the token counters added up
    over every call: ``tokens_per_second`` after a second call counted both calls' tokens in
    one call's time."""
    import time

    e = _engine(toy)
    took = []
    for i, prompt in enumerate(([5, 6, 7], [8, 9])):
        t0 = time.perf_counter()
        e.serve([Request(i, prompt, 4)])
        took.append(time.perf_counter() - t0)
    assert e.stats.generated_tokens == 8
    assert took[1] < e.stats.seconds <= sum(took)


def test_top_k(toy):
    """``top_k`` (new: a request could not restrict sampling to the k most likely tokens):
    1 is greedy at any temperature, 0 / None / more than the vocabulary restrict nothing (the
    same draws as without it), 2 draws only tokens among the two best of transformers'
    teacher-forced logits; a bad value is rejected by name and the engine serves on."""
    rng = np.random.default_rng(5)
    p = random_prompt(rng, 8)
    hot = dict(temperature=2.0, seed=3)
    reqs = {"k1": Request(0, p, 6, top_k=1, **hot), "k0": Request(1, p, 6, top_k=0, **hot),
            "none": Request(2, p, 6, **hot), "huge": Request(3, p, 6, top_k=10**9, **hot),
            "k2": Request(4, p, 12, top_k=2, top_p=0.999, **hot)}
    bad = [Request(10 + i, p, 3, temperature=1.0, top_k=k)
           for i, k in enumerate((-1, 1.5, "3", True))]
    good = Request(20, p, 6)
    e = _engine(toy)
    e.serve([*reqs.values(), *bad, good])
    want = reference_tokens(toy, p, 6)
    assert reqs["k1"].output == want == good.output
    assert reqs["k0"].output == reqs["none"].output == reqs["huge"].output != want
    ids = torch.tensor([p + reqs["k2"].output[:-1]])
    with torch.no_grad():
        best2 = toy(ids).logits[0, len(p) - 1:].topk(2).indices.tolist()
    assert all(t in b for t, b in zip(reqs["k2"].output, best2))
    assert all(r.status == "rejected" and "top_k" in r.error for r in bad)
    assert e.kv.mgr.stats().pages_used == 0


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
     "original_max_position_embeddings": 16}])
def test_rope_whose_frequencies_depend_on_the_forward_is_refused(rope):
    """transformers recomputes dynamic-NTK and LongRoPE frequencies from the longest position
    of each forward pass: served in a batch with a 30-token prompt (original context 16),
    a 5-token request got other tokens than generate gives it alone (wrong from the first
    token with longrope). Refused by name; the static types are served exactly."""
    model = tiny("llama", rope_scaling=rope, max_position_embeddings=32)
    with pytest.raises(UnsupportedModelError, match=rope["rope_type"]):
        Engine(model)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16}])
def test_static_rope_types_past_the_original_context(rope):
    """Prompts past the scaled RoPE's original context, batched with short ones and chunked."""
    model = tiny("llama", rope_scaling=rope, max_position_embeddings=32)
    rng = np.random.default_rng(6)
    reqs = [Request(0, random_prompt(rng, 5), 6), Request(1, random_prompt(rng, 30), 6),
            Request(2, random_prompt(rng, 12), 8, arrival=2)]
    _engine(model, max_step_tokens=7).serve(reqs)
    assert check_against_reference(model, reqs) == []


@pytest.mark.parametrize("cache", ["paged", "continuous", "linear"])
@pytest.mark.parametrize("where", ["forward", "sampling"])
def test_a_step_that_raises_aborts_its_batch_and_the_engine_serves_on(toy, cache, where,
                                                                      monkeypatch):
    """A forward pass that raised (a kernel that does not load, no memory, Ctrl-C) left the
    paged and continuous managers with a fetch in flight -- every later step raised
    SequenceStateError -- and the linear cache with requests counted as prefilled whose K/V
    were never committed: later tokens were silently wrong. Now the step's requests are
    aborted (their error says why), their sequences released, the exception propagates,
    and the queued and later requests -- the same prompt again included, which the prefix
    cache must not serve from the failed pass -- get transformers' tokens."""
    import kvtvm.engine.core as core

    rng = np.random.default_rng(8)
    prompts = [random_prompt(rng, 19), random_prompt(rng, 6), random_prompt(rng, 11)]
    e = _engine(toy, cache, max_batch_size=2, page_size=4, max_step_tokens=8)
    reqs = [Request(i, p, 5, arrival=i) for i, p in enumerate(prompts)]
    for r in reqs:
        e.submit(r)
    e.step()
    e.step()                                 # request 0 mid-prefill, request 1 admitted
    owner, name = (e.model, "run_step") if where == "forward" else (core, "sample")
    real = getattr(owner, name)

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")
    monkeypatch.setattr(owner, name, broken)
    with pytest.raises(RuntimeError, match="injected"):
        e.step()
    monkeypatch.setattr(owner, name, real)
    failed = [r for r in reqs if r.status == "aborted"]
    assert [r.rid for r in failed] == [0, 1]
    assert all("injected failure" in r.error and "RuntimeError" in r.error for r in failed)
    assert e.running == [] and reqs[2].status == "waiting"
    again = [Request(10 + i, p, 5) for i, p in enumerate(prompts[:2])]
    e.serve(again)
    assert reqs[2].status == "done"
    assert check_against_reference(toy, [reqs[2], *again]) == []
    mgr = e.kv.mgr
    if cache == "linear":
        assert mgr.active_batch_size == 0
    else:
        assert len(mgr.slots_remaining) == 2
        if cache == "paged":
            mgr.check_invariants()
            assert mgr.stats().pages_used == 0


def test_disk_tier_directory_of_another_model_is_refused(toy, tmp_path):
    """The disk tier keys pages by tokens and storage format only: another model of the same
    cache geometry (the toy with other weights) given the same directory read the first
    model's K/V -- every token wrong, silently. The directory now carries each model's mark
    (per dtype); another model is refused by name before anything is made, the same model
    (rebuilt, or in another dtype or cache format) is served warm as before."""
    from kvtvm.engine import build_toy_model
    from kvtvm.errors import InvalidArgumentError

    rng = np.random.default_rng(9)
    prompt = random_prompt(rng, 40)
    first = _engine(toy, max_seq_len=64, disk_tier_dir=tmp_path)
    first.serve([Request(0, prompt, 3)])
    assert first.close() > 0
    other = build_toy_model(seed=1, num_layers=2)
    with pytest.raises(InvalidArgumentError, match="disk_tier_dir.*another model"):
        _engine(other, max_seq_len=64, disk_tier_dir=tmp_path)
    again = Request(1, prompt, 3)
    same = _engine(build_toy_model(num_layers=2), max_seq_len=64, disk_tier_dir=tmp_path)
    same.serve([again])
    assert again.prefix_hit_tokens > 0 and check_against_reference(toy, [again]) == []
    bf16 = build_toy_model(num_layers=2, dtype=torch.bfloat16)
    r = Request(2, prompt, 3)
    _engine(bf16, max_seq_len=64, disk_tier_dir=tmp_path).serve([r])   # its own mark
    assert r.status == "done" and check_against_reference(bf16, [r]) == []
    other_dir = tmp_path / "other"
    served = Request(3, prompt, 3)
    _engine(other, max_seq_len=64, disk_tier_dir=other_dir).serve([served])
    assert check_against_reference(other, [served]) == []


@pytest.mark.parametrize("damage", ["{}", '{"fingerprint": null}', '{"fingerprint": 7}', "[1]",
                                    "deleted", "[" * 50000, "fifo", "directory"])
def test_a_disk_tier_directory_with_a_damaged_or_lost_mark_is_refused(toy, tmp_path, damage):
    """A mark without a fingerprint ('{}', null) counted as no mark, and so did a deleted one
    while the pages stayed: another model of the same geometry then claimed the directory and
    read the first model's K/V (its first token already wrong). Now refused, nothing made."""
    from kvtvm.engine import build_toy_model
    from kvtvm.errors import InvalidArgumentError

    prompt = random_prompt(np.random.default_rng(11), 40)
    first = _engine(toy, max_seq_len=64, disk_tier_dir=tmp_path)
    first.serve([Request(0, prompt, 3)])
    assert first.close() > 0 and list(tmp_path.glob("*.kvp"))
    (mark,) = tmp_path.glob(".kvtvm-model-*")
    if damage in ("deleted", "fifo", "directory"):  # a FIFO hung the engine's constructor;
        mark.unlink()  # deep JSON raised RecursionError, a directory IsADirectoryError
        if damage == "fifo":
            os.mkfifo(mark)
        elif damage == "directory":
            mark.mkdir()
    else:
        mark.write_text(damage)
    before = sorted(p.name for p in tmp_path.iterdir())
    for model in (build_toy_model(seed=1, num_layers=2), toy):   # its model is unknown too
        with pytest.raises(InvalidArgumentError, match="disk_tier_dir"):
            _engine(model, max_seq_len=64, disk_tier_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
