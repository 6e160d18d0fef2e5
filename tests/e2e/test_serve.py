"""End to end: examples/serve.py (over kvtvm.engine) serves a small random-weight Llama through
kvtvm and every request's greedy tokens must equal transformers' own generate() on that request
alone.

Covers each cache strategy with: a prompt that fills pages exactly (and a request whose final
length ends on a page boundary), requests arriving while others decode, a request reusing a
cached system prompt (paged: hits > 0), more requests than slots or pages (they wait), and bad
input (empty prompt, prompt longer than max_seq_len, too many new tokens, a request larger than
the whole page pool, unknown --cache), each rejected with a message while the rest is served.
"""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kvtvm.engine.runner

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e


def _load_serve():
    spec = importlib.util.spec_from_file_location("kvtvm_example_serve",
                                                  ROOT / "examples" / "serve.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


serve = _load_serve()
Request = serve.Request

PAGE = 16
MAX_SEQ_LEN = 96


@pytest.fixture(scope="module")
def model():
    # 2 layers keep the test quick; heads and head_dim are the example's (same kernels).
    # One torch thread, as examples/serve.py uses (torch's and TVM's pools fight otherwise).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield serve.build_model(seed=0, num_layers=2)
    torch.set_num_threads(threads)


def _rand(rng, n):
    return rng.integers(3, 1000, n).tolist()


def workload():
    """Requests exercising the engine; returns (requests, dict of named requests)."""
    rng = np.random.default_rng(123)
    system = _rand(rng, 2 * PAGE)                       # two full pages, shared
    r = {
        "sys_a": Request(0, system + _rand(rng, 5), 8, arrival=0),
        # prompt fills two pages exactly; final length 32 + 17 - 1 = 48 = three pages exactly
        "exact": Request(1, _rand(rng, 2 * PAGE), 17, arrival=0),
        # arrives while sys_a and exact decode; reuses the system prompt's cached pages
        "sys_b": Request(2, system + _rand(rng, 7), 6, arrival=3),
        "one_token": Request(3, _rand(rng, 1), 4, arrival=3),
        "single_new": Request(4, _rand(rng, PAGE), 1, arrival=4),
        "late_a": Request(5, _rand(rng, 9), 5, arrival=4),
        "late_b": Request(6, system + _rand(rng, 2), 3, arrival=5),
        # exactly the system prompt: its last page holds the last token, so only one page hits
        "sys_only": Request(13, list(system), 4, arrival=6),
        # final length 60 + 37 - 1 = 96 = max_seq_len: fills a continuous/linear block exactly
        "full_block": Request(14, _rand(rng, 60), 37, arrival=6),
        "empty": Request(7, [], 4, arrival=1),
        "too_long": Request(8, _rand(rng, MAX_SEQ_LEN + 1), 4, arrival=2),
        "too_many_new": Request(9, _rand(rng, 40), MAX_SEQ_LEN, arrival=2),
        "bad_token": Request(10, [5, 1000, 7], 4, arrival=2),
        "not_tokens": Request(11, ["hello"], 4, arrival=2),
        "zero_new": Request(12, [5, 6], 0, arrival=2),
    }
    return list(r.values()), r


@pytest.mark.slow
@pytest.mark.parametrize("cache", serve.CACHE_CHOICES)
def test_serving_matches_transformers(model, cache):
    requests, r = workload()
    engine, requests, problems = serve.run(
        cache, requests=requests, max_batch_size=3, max_seq_len=MAX_SEQ_LEN, page_size=PAGE,
        num_pages=24, model=model, quiet=True)
    assert problems == []
    served = [q for q in requests if q.status == "done"]
    assert len(served) == 9
    for q in served:
        assert len(q.output) == q.max_new_tokens
    # bad input: rejected with a message, the rest served
    assert r["empty"].status == "rejected" and "empty prompt" in r["empty"].error
    assert r["too_long"].status == "rejected" and "longer than max_seq_len" in r["too_long"].error
    assert r["too_many_new"].status == "rejected" and "max_seq_len" in r["too_many_new"].error
    assert r["bad_token"].status == "rejected" and "vocabulary" in r["bad_token"].error
    assert r["not_tokens"].status == "rejected" and "token ids" in r["not_tokens"].error
    assert r["zero_new"].status == "rejected" and "max_new_tokens" in r["zero_new"].error
    st = engine.stats
    # a request arriving while others decode joins their batch at once
    assert r["sys_b"].admitted_step == 3
    assert st.mixed_steps > 0 and st.decode_steps > 0
    # more requests than slots: some waited, never more than max_batch_size at once
    assert st.waited > 0 and st.peak_running == 3
    assert any(q.admitted_step > q.arrival for q in served)
    # prefix cache (paged only): the system prompt's two pages are reused
    if cache == "paged":
        assert r["sys_b"].prefix_hit_tokens == 2 * PAGE
        assert r["late_b"].prefix_hit_tokens == 2 * PAGE
        assert r["sys_only"].prefix_hit_tokens == PAGE
        assert st.prefix_hit_tokens > 0 and st.hit_rate > 0
        engine.kv.mgr.check_invariants()
        assert engine.kv.mgr.stats().pages_used == 0      # everything released
    else:
        assert st.prefix_hit_tokens == 0
    assert 0 < st.peak_live_bytes <= st.allocated_bytes
    assert not engine.running and not engine.queue


def test_paged_requests_wait_for_pages(model):
    """Slots are free but pages are not: requests wait for pages, then are served."""
    rng = np.random.default_rng(7)
    # each needs 30 + 10 - 1 = 39 tokens = 3 pages; a pool of 7 pages holds two at once
    requests = [Request(i, _rand(rng, 30), 10, arrival=i) for i in range(4)]
    engine, requests, problems = serve.run(
        "paged", requests=requests, max_batch_size=4, max_seq_len=MAX_SEQ_LEN,
        page_size=PAGE, num_pages=7, prefix_caching=False, model=model, quiet=True)
    assert problems == []
    assert all(q.status == "done" for q in requests)
    assert engine.stats.peak_running == 2
    assert engine.stats.waited == 2
    engine.kv.mgr.check_invariants()


def test_paged_request_larger_than_pool_is_rejected(model):
    rng = np.random.default_rng(8)
    requests = [Request(0, _rand(rng, 40), 20, arrival=0),     # 59 tokens: 4 pages > 3
                Request(1, _rand(rng, 20), 5, arrival=0)]      # 24 tokens: 2 pages
    engine, requests, problems = serve.run(
        "paged", requests=requests, max_batch_size=2, max_seq_len=MAX_SEQ_LEN,
        page_size=PAGE, num_pages=3, model=model, quiet=True)
    assert problems == []
    assert requests[0].status == "rejected" and "whole pool holds 3" in requests[0].error
    assert requests[1].status == "done"


def test_prefix_reuse_after_release(model):
    """A finished request's full pages stay cached; a later request with the same prefix
    reads them instead of recomputing, and still generates transformers' tokens."""
    rng = np.random.default_rng(9)
    system = _rand(rng, 3 * PAGE)
    requests = [Request(0, system + _rand(rng, 4), 3, arrival=0),
                Request(1, system + _rand(rng, 6), 5, arrival=10)]
    engine, requests, problems = serve.run(
        "paged", requests=requests, max_batch_size=2, max_seq_len=MAX_SEQ_LEN,
        page_size=PAGE, num_pages=12, model=model, quiet=True)
    assert problems == []
    assert requests[0].finished_step < requests[1].admitted_step
    assert requests[1].prefix_hit_tokens == 3 * PAGE
    assert engine.stats.hit_rate > 0


def test_mismatch_is_reported_with_position(model):
    """The check can fail: a wrong token is named by request, position, expected and got."""
    rng = np.random.default_rng(10)
    req = Request(4, _rand(rng, 6), 5)
    serve.run("continuous", requests=[req], max_batch_size=1, max_seq_len=32, model=model,
              quiet=True, verify=False)
    want = serve.reference_tokens(model, req.prompt, 5)
    assert req.output == want
    req.output[2] = (req.output[2] + 1) % 1000
    (msg,) = serve.check_against_reference(model, [req])
    assert msg.startswith("request 4: generated token 2 (sequence position 8)")
    assert f"expected {want[2]}" in msg and f"got {req.output[2]}" in msg


def test_broken_rope_is_caught(model, monkeypatch):
    """A model bug (RoPE off) makes the served tokens differ and the run reports it."""
    monkeypatch.setattr(kvtvm.engine.runner, "rotate_half", lambda x: torch.zeros_like(x))
    rng = np.random.default_rng(11)
    reqs = [Request(i, _rand(rng, 12), 6) for i in range(2)]
    _, _, problems = serve.run("paged", requests=reqs, max_batch_size=2, max_seq_len=32,
                               num_pages=8, model=model, quiet=True)
    assert problems and problems[0].startswith("request ")


def _off_by_one(decode_attention):
    """``decode_attention`` (or ``prepare_decode_attention``) with a classic bug: it attends
    over the cache without the token just appended."""

    def buggy(q, k_cache, v_cache, cache_lengths, lookup_table, **kw):
        shorter = (cache_lengths - 1).clamp(min=0).to(torch.int32)
        return decode_attention(q, k_cache, v_cache, shorter, lookup_table, **kw)
    return buggy


@pytest.mark.skipif(not hasattr(serve.ops, "decode_attention"), reason="no decode op yet")
def test_off_by_one_decode_is_caught(model, monkeypatch):
    # the step plan prepares the first layer's decode launch (kvtvm.ops.prepare_decode_attention,
    # as kvtvm.plan imported it) and rebinds it (its shorter lengths included) on the others:
    # every layer has the bug; a direct call of kvtvm.ops.decode_attention has it too
    import kvtvm.plan

    monkeypatch.setattr(serve.ops, "decode_attention", _off_by_one(serve.ops.decode_attention))
    monkeypatch.setattr(kvtvm.plan, "prepare_decode_attention",
                        _off_by_one(kvtvm.plan.prepare_decode_attention))
    rng = np.random.default_rng(12)
    reqs = [Request(i, _rand(rng, 10 + 3 * i), 6) for i in range(2)]
    _, _, problems = serve.run("continuous", requests=reqs, max_batch_size=2, max_seq_len=32,
                               model=model, quiet=True)
    assert len(problems) == 2


def test_bfloat16_check_accepts_rounding_and_catches_bugs(monkeypatch):
    """bfloat16: transformers' own sdpa and eager disagree on the toy's greedy tokens, so the
    check accepts near-greedy tokens (teacher-forced) -- and still catches the off-by-one
    decode."""
    import kvtvm.plan

    bf16 = serve.build_model(seed=0, dtype=torch.bfloat16)
    reqs = serve.demo_requests(1000, 128, n=8, bad=False)
    _, reqs, problems = serve.run("paged", requests=reqs, model=bf16, quiet=True)
    assert problems == [] and all(r.status == "done" for r in reqs)
    monkeypatch.setattr(kvtvm.plan, "prepare_decode_attention",
                        _off_by_one(kvtvm.plan.prepare_decode_attention))
    reqs = serve.demo_requests(1000, 128, n=8, bad=False)
    _, _, problems = serve.run("paged", requests=reqs, model=bf16, quiet=True)
    assert len(problems) >= 4 and all("logit range" in p for p in problems)


def test_cli_unknown_cache_lists_choices(capsys):
    with pytest.raises(SystemExit) as exc:
        serve.main(["--cache", "ring"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'ring'" in err
    for c in serve.CACHE_CHOICES:
        assert c in err


@pytest.mark.slow
def test_cli_exit_code_and_report(monkeypatch, capsys, model):
    """main() serves the demo workload, prints the figures, exits 0; a mismatch exits 1."""
    monkeypatch.setattr(serve, "build_model", lambda seed=0, device="cpu", dtype=None: model)
    argv = ["--model", "toy", "--requests", "5", "--max-seq-len", "96", "--max-batch-size", "2"]
    assert serve.main(argv) == 0
    out = capsys.readouterr().out
    for text in ("tokens/s", "KV memory: peak live", "prefix cache:", "hit rate",
                 "rejected: empty prompt", "longer than max_seq_len",
                 "match transformers' generate()"):
        assert text in out
    monkeypatch.setattr(kvtvm.engine.runner, "rotate_half", lambda x: torch.zeros_like(x))
    assert serve.main(argv + ["--cache", "linear"]) == 1
    assert "MISMATCH request " in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--max-new-tokens", "--page-size", "--max-seq-len",
                                  "--max-batch-size", "--num-pages"])
@pytest.mark.parametrize("value", ["0", str(1 << 31)])
def test_cli_refuses_non_positive_sizes(flag, value, capsys):
    """Used to end in a traceback from deep inside (page_size), or to serve nothing and exit 0
    (max_new_tokens 0: every request rejected); a --max-seq-len of 3e9 was OOM-killed (its
    too-long demo prompt), a --max-batch-size of 1e8 numpy's MemoryError."""
    with pytest.raises(SystemExit) as exc:
        serve.main(["--model", "toy", flag, value])
    assert exc.value.code == 2
    assert f"{flag}: expected a positive int below 2**31, got {value}" in \
        capsys.readouterr().err


def test_cli_sizes_past_the_memory_are_a_usage_error(capsys):
    assert serve.main(["--model", "toy", "--requests", "2", "--max-batch-size",
                       "100000000"]) == 2
    assert "host memory" in capsys.readouterr().err


def test_cli_refuses_a_missing_kernel_directory(capsys, tmp_path):
    """A mistyped --kernels was added to the search path silently (on a runtime-only install
    it would only show as a missing kernel)."""
    with pytest.raises(SystemExit) as exc:
        serve.main(["--model", "toy", "--kernels", str(tmp_path / "nope")])
    assert exc.value.code == 2
    assert "--kernels: no such directory" in capsys.readouterr().err


def test_cli_toy_takes_max_new_tokens_and_fails_when_nothing_is_served(monkeypatch, capsys,
                                                                      model):
    """--max-new-tokens applies to the toy's requests too (it was ignored); a run where every
    request is rejected exits 1 instead of reporting 'all 0 served requests match'."""
    monkeypatch.setattr(serve, "build_model", lambda seed=0, device="cpu", dtype=None: model)
    argv = ["--model", "toy", "--requests", "3", "--max-batch-size", "2", "--page-size", "7",
            "--max-new-tokens", "1"]
    assert serve.main(argv) == 0
    out = capsys.readouterr().out
    assert "3 tokens generated" in out and "all 3 served requests match" in out
    assert serve.main(["--model", "toy", "--requests", "2", "--max-seq-len", "2"]) == 1
    assert "no request was served: all 4 were rejected" in capsys.readouterr().out


def test_capacity_error_at_fetch_requeues(model, monkeypatch):
    """If the manager refuses a fetch despite admission (e.g. another user of the pool took
    pages), the new requests go back to the queue and are served later; nothing crashes."""
    rng = np.random.default_rng(13)
    requests = [Request(0, _rand(rng, 10), 6, arrival=0), Request(1, _rand(rng, 12), 4,
                                                                     arrival=2)]
    engine = serve.Engine(model, "paged", max_batch_size=2, max_seq_len=MAX_SEQ_LEN,
                          page_size=PAGE, num_pages=8)
    engine.log = lambda s: None
    real_fetch, calls = engine.kv.mgr.fetch, []

    def flaky_fetch(batch, *a, **kw):
        calls.append(len(batch))
        if len(batch) == 2 and calls.count(2) == 1:
            raise serve.KVCacheCapacityError("fetch: needs 1 new pages, 0 are free (test)")
        return real_fetch(batch, *a, **kw)

    monkeypatch.setattr(engine.kv.mgr, "fetch", flaky_fetch)
    engine.serve(requests)
    assert all(r.status == "done" for r in requests)
    assert requests[1].admitted_step > requests[1].arrival
    assert serve.check_against_reference(model, requests) == []
    engine.kv.mgr.check_invariants()


@pytest.mark.parametrize("cache", ["paged", "linear"])
def test_decode_steps_through_prefill_kernel(model, cache):
    """A decode step is also a prefill of one token each: with the decode kernel off, the
    prefill kernel serves every step and the tokens are the same."""
    rng = np.random.default_rng(14)
    requests = [Request(i, _rand(rng, 5 + 7 * i), 5 + i, arrival=i) for i in range(3)]
    engine = serve.Engine(model, cache, max_batch_size=2, max_seq_len=MAX_SEQ_LEN,
                          page_size=PAGE, num_pages=12)
    engine.log = lambda s: None
    engine.model.use_decode_kernel = False
    engine.serve(requests)
    assert engine.stats.decode_steps > 0
    assert serve.check_against_reference(model, requests) == []


def _load_autotune():
    spec = importlib.util.spec_from_file_location("kvtvm_example_autotune",
                                                  ROOT / "examples" / "autotune.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_autotune_tunes_the_kernels_serving_loads(model, tmp_path):
    """examples/autotune.py records the specs a linear-cache serving run launches (append,
    prefill, decode in the hnd layout, copy for eviction) and tunes one on its recorded call,
    writing the log under the given root only."""
    autotune = _load_autotune()
    recorded, kernel_s, serving_s = autotune.record_serving_kernels(serve, "linear", model)
    assert {s.op for s in recorded} == {"append", "prefill", "decode", "copy"}
    assert all(s.layout == "hnd" for s in recorded if s.op != "copy")
    assert 0 < kernel_s < serving_s
    decode = {s: a for s, a in recorded.items() if s.op == "decode"}
    (spec, entry), = list(autotune.tune_recorded(decode, max_trials=2, repeat=2,
                                                 log_root=tmp_path))
    assert entry["median_ms"] > 0 and len(entry["trials"]) == 2
    assert Path(entry["path"]) == tmp_path / "llvm" / f"{spec.uri}.json"
    assert Path(entry["path"]).exists()


@pytest.mark.slow
def test_autotune_measure_only_reports_tokens_per_second(capsys):
    """The child-process entry of examples/autotune.py prints the serving speed as JSON."""
    import json

    autotune = _load_autotune()
    threads = torch.get_num_threads()
    try:
        assert autotune.main(["--measure-only", "--runs", "1", "--cache", "linear"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(out)["tokens_per_second"] > 0


def test_cli_8bit_cache_is_checked_against_quantized_transformers(monkeypatch, capsys, model):
    """--cache-dtype / --k-cache-dtype: every cache serves the demo over an 8-bit cache and is
    checked against transformers quantizing K/V the same way; a broken RoPE still fails."""
    monkeypatch.setattr(serve, "build_model", lambda seed=0, device="cpu", dtype=None: model)
    argv = ["--model", "toy", "--requests", "5", "--max-seq-len", "96", "--cache", "all",
            "--k-cache-dtype", "float8_e4m3fn", "--v-cache-dtype", "int8"]
    assert serve.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("K float8_e4m3fn V int8") == 3
    assert out.count("its attention quantizing K/V as the cache stores them") == 3
    monkeypatch.setattr(kvtvm.engine.runner, "rotate_half", lambda x: torch.zeros_like(x))
    assert serve.main(argv[:-6] + ["--cache-dtype", "int8"]) == 1
    assert "MISMATCH request " in capsys.readouterr().out


def test_cli_bad_8bit_options_are_one_line(capsys):
    assert serve.main(["--model", "toy", "--cache-dtype", "int8", "--skip-layers", "9"]) == 2
    assert capsys.readouterr().err.startswith("error: skip_layers: expected indices")
    with pytest.raises(SystemExit) as exc:
        serve.main(["--model", "toy", "--skip-layers", "0"])
    assert exc.value.code == 2 and "--skip-layers needs an 8-bit cache" in capsys.readouterr().err
