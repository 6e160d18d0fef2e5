"""kvtvm.engine when a step is interrupted outside its forward pass (Ctrl-C while it admits,
reads the prefix cache or retires finished requests) and what one step computes. Each
window lost a request, leaked a slot or ran a request past its end before (found by an
off-grid sweep, 2026-11-28); now the engine stays consistent and serves on with
transformers' tokens, and ``max_step_tokens`` bounds a step."""

import numpy as np
import pytest
from helpers import assert_engine_clean, random_prompt

from kvtvm.engine import Engine, Request, check_against_reference

pytestmark = pytest.mark.e2e

CACHES = ["paged", "continuous", "linear"]


def _engine(model, cache, **kw):
    kw = {"max_batch_size": 2, "max_seq_len": 48, "page_size": 4, **kw}
    e = Engine(model, cache, **kw)
    e.log = lambda s: None
    return e


def _once(obj, name, exc=KeyboardInterrupt):
    """Make ``obj.name`` raise ``exc`` on its next call only."""
    real = getattr(obj, name)
    state = {"armed": True}

    def wrapper(*args, **kwargs):
        if state["armed"]:
            state["armed"] = False
            raise exc()
        return real(*args, **kwargs)
    setattr(obj, name, wrapper)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("where", ["add", "cached_prefix"])
def test_an_interrupt_while_admitting_requeues_the_request(toy, cache, where):
    """Ctrl-C in the slot claim or in the prefix-cache lookup of a step that admits a
    request: the request is back at the head of the queue (it was in no list, holding a
    slot; the linear cache refused every later step), and the serve that follows gives
    transformers' tokens."""
    rng = np.random.default_rng(3)
    e = _engine(toy, cache)
    a = Request(0, random_prompt(rng, 9), 4)
    b = Request(1, random_prompt(rng, 7), 4, arrival=1)
    e.submit(a)
    e.submit(b)
    e.step()  # a admitted and prefilled
    if where == "add" or cache == "paged":
        _once(e.kv, where)
    else:  # only the paged cache reads a prefix cache; interrupt its chunking instead
        _once(e, "_chunks")
    with pytest.raises(KeyboardInterrupt):
        e.step()
    assert b.status == "waiting" and e.queue == [b] and b.seq_id == -1
    assert a.status == "running"
    e.serve([])
    assert a.status == b.status == "done"
    assert check_against_reference(toy, [a, b]) == []
    assert_engine_clean(e)


@pytest.mark.parametrize("cache", CACHES)
def test_an_interrupt_while_retiring_ends_the_finished_and_aborts_the_rest(toy, cache):
    """Ctrl-C while the step releases what finished: the finished request was left
    running, got one token too many, and one at max_seq_len made every later step raise.
    Now it ends with its tokens, the step's other requests are aborted (their sequences
    released), and the engine serves on."""
    rng = np.random.default_rng(4)
    e = _engine(toy, cache, max_seq_len=12)
    short = Request(0, random_prompt(rng, 5), 2)
    full = Request(1, random_prompt(rng, 6), 7)  # reaches max_seq_len after 7 tokens
    e.serve([])
    e.submit(short)
    e.submit(full)
    e.step()
    _once(e.kv, "finish")
    with pytest.raises(KeyboardInterrupt):
        e.step()  # short's second token ends it
    assert short.status == "done" and short.finish_reason == "length"
    assert len(short.output) == 2
    assert full.status == "aborted" and "KeyboardInterrupt" in full.error
    assert check_against_reference(toy, [short]) == []
    assert_engine_clean(e)
    again = Request(2, full.prompt, 7)
    e.serve([again])
    assert again.status == "done" and len(again.output) == 7
    assert check_against_reference(toy, [again]) == []
    assert_engine_clean(e)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("budget", [3, 4, 9])
def test_max_step_tokens_bounds_every_step(toy, cache, budget):
    """Requests admitted while others still prefilled each got a one-token chunk past the
    budget (4 tokens a step gave steps of 5-8). A step now computes at most the budget, or
    one token per running request when more run than that."""
    rng = np.random.default_rng(5)
    e = _engine(toy, cache, max_batch_size=3, max_seq_len=40, max_step_tokens=budget)
    reqs = [Request(i, random_prompt(rng, int(rng.integers(1, 16))), 3,
                    arrival=int(rng.integers(0, 4))) for i in range(6)]
    sizes = []
    real = e.model.run_step

    def counted(kv, computed):
        sizes.append((sum(len(c) for c in computed), len(computed)))
        return real(kv, computed)
    e.model.run_step = counted
    e.serve(reqs)
    assert all(n <= max(budget, running) for n, running in sizes), sizes
    assert all(r.status == "done" for r in reqs)
    assert check_against_reference(toy, reqs) == []
    assert_engine_clean(e)


def test_waited_counts_requests_queued_past_the_step_they_arrived(toy):
    """A request submitted mid-run with the default arrival 0 (or a negative one) counted as
    having waited although it was admitted at once."""
    rng = np.random.default_rng(6)
    e = _engine(toy, "paged")
    e.serve([Request(0, random_prompt(rng, 5), 3)])
    assert e.stats.waited == 0
    e.serve([Request(1, random_prompt(rng, 5), 3), Request(2, random_prompt(rng, 5), 3,
                                                           arrival=-3)])
    assert e.stats.waited == 0
    e.serve([Request(3 + i, random_prompt(rng, 5), 2) for i in range(3)])  # 2 slots
    assert e.stats.waited == 1
    # a request that waited, then was put back by a fetch without room, counts once
    from kvtvm.errors import KVCacheCapacityError

    e.serve([Request(6 + i, random_prompt(rng, 5), 2) for i in range(2)])
    assert e.stats.waited == 1
    late = [Request(8 + i, random_prompt(rng, 5), 4) for i in range(3)]  # the third waits
    for r in late:
        e.submit(r)
    e.step()
    e.step()
    real = e.kv.fetch

    def no_room_once(batch, tokens):
        if any(r.rid == 10 for r in batch):   # the step admitting the one that waited
            e.kv.fetch = real
            raise KVCacheCapacityError("fetch: no room (test)")
        return real(batch, tokens)
    e.kv.fetch = no_room_once
    e.serve([])
    assert e.kv.fetch == real and e.stats.waited == 2
    assert [r.status for r in late] == ["done"] * 3


@pytest.mark.parametrize("cache", CACHES)
def test_submit_and_abort_from_other_threads_wait_for_the_step(toy, cache):
    """One thread steps while others submit and abort: a submit or abort arriving during a
    step waits for its end (it used to edit the engine's lists under the running step), and
    every request ends served with transformers' tokens or aborted, with nothing held."""
    import threading

    rng = np.random.default_rng(11)
    e = _engine(toy, cache)
    first = [Request(i, random_prompt(rng, 6 + i), 5) for i in range(2)]
    for r in first:
        e.submit(r)
    real, inside, go = e._step, threading.Event(), threading.Event()

    def slow_step():
        inside.set()
        go.wait(10)
        real()
    e._step = slow_step
    stepper = threading.Thread(target=e.step)
    stepper.start()
    inside.wait(10)
    late = Request(9, random_prompt(rng, 5), 3)
    order = []
    submitter = threading.Thread(target=lambda: (e.submit(late), order.append("submit")))
    aborter = threading.Thread(target=lambda: order.append(("abort", e.abort(1))))
    submitter.start()
    aborter.start()
    submitter.join(0.3)
    aborter.join(0.3)
    order.append("step ends")   # neither returned while the step ran
    go.set()
    for t in (stepper, submitter, aborter):
        t.join(10)
    assert order[0] == "step ends" and sorted(map(str, order[1:])) == \
        ["('abort', True)", "submit"]
    e._step = real
    e.serve([])
    assert first[1].status == "aborted" and late.status == "done"
    check_against_reference(toy, [first[0], late])
    assert_engine_clean(e)


def test_finished_requests_are_bounded_and_drained(toy, monkeypatch):
    """A server running for days: the engine kept every finished request (and a sampling
    request's torch.Generator) for good. Now it keeps the latest FINISHED_KEPT for
    pop_finished(), counts them all, and drops a finished request's generator."""
    from kvtvm.engine import core

    monkeypatch.setattr(core, "FINISHED_KEPT", 3)
    rng = np.random.default_rng(12)
    e = _engine(toy, "paged")
    reqs = [Request(i, random_prompt(rng, 4), 2, temperature=0.8, seed=i) for i in range(5)]
    e.serve(reqs)
    assert e.finished_count == 5 and len(e.finished) == 3
    assert all(r.status == "done" and r.generator is None for r in reqs)
    assert [r.rid for r in e.pop_finished()] == [2, 3, 4]
    assert e.pop_finished() == [] and e.finished_count == 5
    assert_engine_clean(e)
