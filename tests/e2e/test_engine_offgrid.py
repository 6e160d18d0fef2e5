"""kvtvm.engine off the usual grid: request fields of the wrong type or range, a request object
served twice, tiny temperatures, bad engine arguments, and a tight page pool shared by
prompts that are prefixes of each other. Each bad value is refused by name and changes
nothing; every request that is served gives transformers' tokens; no page or slot leaks."""

import numpy as np
import pytest
import torch
from helpers import assert_engine_clean, random_prompt

from kvtvm.engine import Engine, Request, check_against_reference, \
    reference_tokens
from kvtvm.errors import InvalidArgumentError

pytestmark = pytest.mark.e2e


def _engine(model, cache="paged", **kw):
    kw = {"max_batch_size": 3, "max_seq_len": 64, "page_size": 8, **kw}
    e = Engine(model, cache, **kw)
    e.log = lambda s: None
    return e


@pytest.mark.parametrize("cache", ["paged", "linear"])
def test_bad_request_fields_are_rejected_and_the_rest_served(toy, cache):
    """A bad seed, stop list, temperature, arrival or float prompt used to raise out of
    ``step`` (TypeError/RuntimeError/ValueError) with the request half admitted."""
    rng = np.random.default_rng(0)
    p = random_prompt(rng, 9)
    bad = {
        "seed str": Request(0, p, 3, temperature=0.5, seed="abc"),
        "seed float": Request(1, p, 3, temperature=0.5, seed=1.5),
        "seed bool": Request(2, p, 3, temperature=0.5, seed=True),
        "seed 2**64": Request(3, p, 3, temperature=0.5, seed=1 << 64),
        "stop str": Request(4, p, 3, stop_token_ids=("x",)),
        "stop None": Request(5, p, 3, stop_token_ids=(None,)),
        "temperature inf": Request(6, p, 3, temperature=float("inf")),
        "temperature bool": Request(7, p, 3, temperature=True),
        "float prompt": Request(8, [float(t) for t in p], 3),
        "bool prompt": Request(9, [True, False], 3),
        "arrival None": Request(10, p, 3, arrival=None),
        "arrival str": Request(11, p, 3, arrival="1"),
        # a numpy max_new_tokens wrapped the length check (then the engine stuck on the
        # request's failing fetch); a prompt or stop list raising when read escaped serve()
        "max_new_tokens int64": Request(12, p, np.int64(2 ** 63 - 1)),
        "max_new_tokens int8": Request(13, p, np.int8(100)),
        "raising prompt": Request(14, (t if t < 10 ** 9 else 1 // 0 for t in [5, 2 ** 40]), 3),
        "raising stop": Request(15, p, 3, stop_token_ids=(1 // 0 for _ in range(1))),
    }
    good = [Request(20, p, 4), Request(21, random_prompt(rng, 13), 3, arrival=1)]
    e = _engine(toy, cache, max_step_tokens=5)
    e.serve([*bad.values(), *good])
    for name, r in bad.items():
        assert r.status == "rejected" and r.error, name
        assert r.output == [], name
    words = {"seed": "seed", "stop": "stop_token_ids", "temperature": "temperature",
             "float": "prompt", "bool": "prompt", "arrival": "arrival",
             "max_new_tokens": "max_new_tokens", "raising": "ZeroDivisionError"}
    for name, r in bad.items():
        assert words[name.split()[0]] in r.error, (name, r.error)
    assert [r.status for r in good] == ["done", "done"]
    assert check_against_reference(toy, good) == []
    assert_engine_clean(e)


def test_stop_token_given_as_an_int(toy):
    """``stop_token_ids=5`` (an int, as ``eos_token_ids`` takes) used to raise TypeError after
    the step's forward pass."""
    rng = np.random.default_rng(1)
    prompt = random_prompt(rng, 10)
    free = reference_tokens(toy, prompt, 8)
    req = Request(0, prompt, 8, stop_token_ids=free[2])
    e = _engine(toy)
    e.serve([req])
    assert req.output == free[:free.index(free[2]) + 1] and req.finish_reason == "stop"
    assert req.stop_token_ids == (free[2],)
    assert_engine_clean(e)


@pytest.mark.parametrize("cache", ["paged", "continuous", "linear"])
def test_a_request_served_twice_is_refused(toy, cache):
    """Re-serving a finished Request continued its old output over an empty cache (5 tokens
    for max_new_tokens=4, the fifth from a cache without the prompt); the same object twice in
    one serve() raised out of fetch and leaked a slot."""
    rng = np.random.default_rng(2)
    e = _engine(toy, cache)
    r = Request(0, random_prompt(rng, 10), 4)
    e.serve([r])
    out = list(r.output)
    with pytest.raises(InvalidArgumentError, match="already submitted"):
        e.serve([r])
    assert r.output == out and r.status == "done" and e.idle
    fresh = Request(1, random_prompt(rng, 7), 3)
    with pytest.raises(InvalidArgumentError, match="already submitted"):
        e.serve([fresh, fresh])
    assert e.idle and fresh.status == "waiting"   # nothing queued, not even the first
    with pytest.raises(InvalidArgumentError, match="requests"):
        e.serve([("not", "a request")])
    again = Request(0, r.prompt, 4)
    e.serve(iter([again, fresh]))                   # any iterable of requests
    assert again.output == out
    assert check_against_reference(toy, [again, fresh]) == []
    assert_engine_clean(e)


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324])
def test_tiny_temperature_samples_the_greedy_token(toy, temperature):
    """``logits / T`` in float32 overflowed to inf for T below ~1e-38 and torch.multinomial
    raised on the NaN probabilities, out of ``step``."""
    rng = np.random.default_rng(3)
    prompt = random_prompt(rng, 8)
    req = Request(0, prompt, 5, temperature=temperature, seed=7)
    e = _engine(toy)
    e.serve([req])
    assert req.status == "done"
    assert req.output == reference_tokens(toy, prompt, 5)
    assert_engine_clean(e)


@pytest.mark.parametrize("kw, name", [
    (dict(torch_threads=0), "torch_threads"), (dict(kernel_threads=-1), "kernel_threads"),
    (dict(kernel_threads=100000), "kernel_threads"), (dict(max_step_tokens=True),
                                                      "max_step_tokens"),
    (dict(device="tpu"), "device"), (dict(eos_token_ids="x"), "eos_token_ids"),
    (dict(eos_token_ids=[1.5]), "eos_token_ids"),
    (dict(disk_tier_dir=""), "disk_tier_dir"), (dict(disk_tier_dir=5), "disk_tier_dir"),
    (dict(host_tier_pages=-1), "host_tier_pages"), (dict(disk_tier_bytes=1.5),
                                                    "disk_tier_bytes"),
    (dict(device=["cpu"]), "device"), (dict(device=("cpu", "cpu")), "device"),
    (dict(device=("cpu",)), "device")])
def test_bad_engine_arguments_are_refused_by_name(toy, kw, name):
    """These were taken (threads failed at the first step, a float stop id was truncated to
    an int, an empty disk-tier path meant the current directory) or raised untyped errors."""
    with pytest.raises(InvalidArgumentError, match=name):
        _engine(toy, **kw)


def test_stop_ids_as_arrays(toy):
    """An array of stop ids (numpy or torch, as a generation config may hold) is taken (a
    2-element numpy array was 'truth value ambiguous')."""
    assert _engine(toy, eos_token_ids=np.array([5, 6])).eos_token_ids == (5, 6)
    assert _engine(toy, eos_token_ids=torch.tensor([7, 8])).eos_token_ids == (7, 8)
    assert _engine(toy, eos_token_ids=np.int64(9)).eos_token_ids == (9,)
    assert _engine(toy, eos_token_ids=[]).eos_token_ids == ()


def test_a_failed_fetch_leaves_the_engine_as_it_was(toy, tmp_path):
    """Serving after close() raised out of the fetch (the closed disk tier refuses pages) with
    the step's new request holding a slot: the slot leaked and the request was lost. Now
    close() refuses later requests by name, and a fetch that raises undoes the admission."""
    rng = np.random.default_rng(6)
    base = random_prompt(rng, 16)
    e = _engine(toy, page_size=4, num_pages=8, max_seq_len=30, disk_tier_dir=tmp_path)
    first = [Request(i, base + random_prompt(rng, 2), 3, arrival=i) for i in range(3)]
    e.serve(first)
    assert e.close() > 0
    with pytest.raises(InvalidArgumentError, match="closed"):
        e.serve([Request(9, base, 3)])
    assert e.idle and len(e.kv.mgr.slots_remaining) == 3
    e = _engine(toy, "linear")
    reqs = [Request(i, random_prompt(rng, 6 + i), 4, arrival=i) for i in range(3)]
    for r in reqs:
        e.submit(r)
    e.step()
    fetch, calls = e.kv.fetch, []

    def flaky(batch, tokens):
        calls.append(len(batch))
        if len(calls) == 1:
            raise InvalidArgumentError("fetch: injected")
        return fetch(batch, tokens)
    e.kv.fetch = flaky
    with pytest.raises(InvalidArgumentError, match="injected"):
        e.step()                                       # request 1 arrives, fetch fails
    assert [r.status for r in reqs] == ["running", "waiting", "waiting"]
    assert e.kv.mgr.active_batch_size == 1 and e.queue == [reqs[1]]
    e.serve([])
    assert check_against_reference(toy, reqs) == []
    assert_engine_clean(e)


def test_warmup_loads_the_8bit_cache_kernels(toy, monkeypatch):
    """warmup() served its throwaway engine over a full-precision cache, so an 8-bit engine
    still loaded (or built) its quantized kernels at its first real step."""
    import kvtvm.engine.core as core

    seen = []
    make = core.make_cache
    monkeypatch.setattr(core, "make_cache", lambda *a: seen.append(a[1]) or make(*a))
    e = _engine(toy, k_cache_dtype="int8", skip_layers=(-1,))
    e.warmup()
    assert len(seen) == 2 and seen[1].k_cache_dtype == "int8" == seen[0].k_cache_dtype
    assert seen[1].skip_layers == seen[0].skip_layers


@pytest.mark.parametrize("page_size, num_pages", [(3, 9), (5, 7), (4, 6)])
def test_tight_pool_prefixes_and_aborts_match_transformers(toy, page_size, num_pages):
    """Off-grid pages (3, 5), a pool holding one or two requests, prompts that are prefixes of
    each other (prefix hits while the pool is full), lengths of 1 and page +- 1, chunks of 7,
    and aborts mid-prefill, mid-decode and of unknown ids: served tokens equal transformers'
    and the page bookkeeping holds after every step."""
    rng = np.random.default_rng(page_size)
    base = random_prompt(rng, 3 * page_size)
    prompts = [base, base[:page_size + 1], base[:page_size - 1], base[:1], base + [7],
               base[:2 * page_size], random_prompt(rng, page_size), base]
    cap = num_pages * page_size
    reqs = [Request(i, p, max(1, min(5, cap - len(p) + 1)), arrival=i // 2)
            for i, p in enumerate(prompts)]
    victims = [Request(90, random_prompt(rng, 20), 3), Request(91, base[:5], 9, arrival=1)]
    e = _engine(toy, max_seq_len=cap, page_size=page_size, num_pages=num_pages,
                max_step_tokens=7, max_batch_size=2)
    for r in victims + reqs:
        e.submit(r)
    aborts = {1: [90, 12345], 3: [91]}
    while not e.idle:
        for rid in aborts.get(e.step_no, []):
            assert e.abort(rid) == (rid != 12345)
        e.step()
        e.kv.mgr.check_invariants()
    assert [v.status for v in victims] == ["aborted", "aborted"]
    assert all(r.status == "done" for r in reqs), [(r.rid, r.error) for r in reqs]
    assert check_against_reference(toy, reqs) == []
    assert sum(r.prefix_hit_tokens for r in reqs) > 0
    assert_engine_clean(e)


def test_chunked_prefill_keeps_the_prefix_hits(toy):
    """A prompt admitted when the step budget was nearly spent got a one-token first chunk;
    prefix hits are looked up at a sequence's first fetch only, so a prompt whose first
    21 tokens were cached computed all of them again (0 hits). The first chunk now holds the
    cached prefix (free) plus the budget."""
    rng = np.random.default_rng(5)
    a, b = random_prompt(rng, 30), random_prompt(rng, 35)
    reqs = [Request(0, a, 10), Request(1, b, 12, arrival=1),
            Request(2, a[:27], 6, arrival=1), Request(3, a, 5, arrival=2)]
    e = _engine(toy, max_seq_len=64, page_size=7, max_step_tokens=13)
    e.serve(reqs)
    assert [r.prefix_hit_tokens for r in reqs] == [0, 0, 21, 28]
    assert e.stats.prefill_tokens == sum(len(r.prompt) for r in reqs) - 49
    assert check_against_reference(toy, reqs) == []
    assert_engine_clean(e)


def test_prompt_of_max_seq_len_and_one_token_in_every_cache(toy):
    """A prompt exactly ``max_seq_len`` long (one new token), a one-token prompt and a
    request whose final length is ``max_seq_len``, through every cache; one token more is
    rejected by name."""
    rng = np.random.default_rng(4)
    for cache in ("paged", "continuous", "linear"):
        reqs = [Request(0, random_prompt(rng, 40), 1), Request(1, random_prompt(rng, 1), 6),
                Request(2, random_prompt(rng, 33), 8)]
        over = [Request(3, random_prompt(rng, 41), 1), Request(4, random_prompt(rng, 40), 2)]
        e = _engine(toy, cache, max_seq_len=40, page_size=7, max_step_tokens=9)
        e.serve(reqs + over)
        assert [r.status for r in reqs] == ["done"] * 3, cache
        assert all(r.status == "rejected" and "max_seq_len" in r.error for r in over)
        assert check_against_reference(toy, reqs) == [], cache
        assert_engine_clean(e)


def test_cli_kernel_threads_bounded():
    """``--kernel-threads 100000`` hung the toy generate for minutes (TVM starts every
    worker)."""
    from kvtvm import cli, runtime

    with pytest.raises(SystemExit) as ex:
        cli.main(["generate", "--model", "toy", "--prompt", "5", "--kernel-threads", "100000"])
    assert ex.value.code == 2
    with pytest.raises(InvalidArgumentError, match="n"):
        runtime.set_num_threads(runtime.MAX_THREADS + 1)


def test_seeds_apart_in_their_high_half_sample_apart():
    """torch's CPU generator keeps a seed's low 32 bits: seeds 7 and 7 + 2**32 (and the
    default seeds of rids 0 and 2**32) sampled alike. A seed below 2**32 is unchanged."""
    from kvtvm.engine.sampling import fold_seed, make_generator

    def draws(seed, rid=0):
        return torch.rand(8, generator=make_generator(seed, rid)).tolist()

    assert draws(7) != draws(7 + 2 ** 32) and draws(None, 0) != draws(None, 2 ** 32)
    assert draws(7) == torch.rand(8, generator=torch.Generator().manual_seed(7)).tolist()
    assert all(0 <= fold_seed(s) < 2 ** 32 for s in (-2 ** 63, -1, 0, 2 ** 64 - 1))


def test_ctrl_c_while_reading_a_prompt_rejects_that_request(toy):
    """A prompt generator raising KeyboardInterrupt: the interrupt reaches the caller, the
    request is rejected (it was left "waiting" in no list, never served) and the others are
    served by the next steps."""
    from kvtvm.engine import Engine, Request

    def prompt():
        yield 5
        raise KeyboardInterrupt

    e = Engine(toy, "paged", max_batch_size=2, max_seq_len=32, page_size=8)
    e.log = lambda s: None
    good = [Request(0, [5, 6, 7], 3), Request(2, [8, 9], 3)]
    bad = Request(1, prompt(), 3)
    for r in (good[0], bad, good[1]):
        e.submit(r)
    with pytest.raises(KeyboardInterrupt):
        while not e.idle:
            e.step()
    while not e.idle:
        e.step()
    assert bad.status == "rejected" and "KeyboardInterrupt" in bad.error
    assert [r.status for r in good] == ["done", "done"]


def test_one_thread_steps_an_engine_at_a_time(toy):
    import threading

    from kvtvm.engine import Engine, Request
    from kvtvm.errors import InvalidArgumentError

    e = Engine(toy, "paged", max_batch_size=2, max_seq_len=32, page_size=8)
    e.log = lambda s: None
    inside, leave = threading.Event(), threading.Event()
    step = e._step

    def slow_step():
        inside.set()
        leave.wait(10)
        step()

    e._step = slow_step
    e.submit(Request(0, [5, 6, 7], 2))
    t = threading.Thread(target=e.step)
    t.start()
    inside.wait(10)
    with pytest.raises(InvalidArgumentError, match="another thread"):
        e.step()
    leave.set()
    t.join(10)
    e._step = step
    e.serve([])
    assert e.idle


def test_an_engine_is_not_copied(toy):
    import copy

    from kvtvm.engine import Engine
    from kvtvm.errors import InvalidArgumentError

    e = Engine(toy, "paged", max_batch_size=2, max_seq_len=32, page_size=8)
    for how in (copy.copy, copy.deepcopy):
        with pytest.raises(InvalidArgumentError, match="Engine"):
            how(e)
