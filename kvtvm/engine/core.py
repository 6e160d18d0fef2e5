"""The reference serving engine: a request queue over one kvtvm cache manager.

Each :meth:`Engine.step` admits queued requests while a slot (and, paged, enough pages for the
request's whole length) is free, runs one forward pass over every running request -- decode
tokens of the requests already generating mixed with prompt chunks of new ones (chunked prefill:
at most ``max_step_tokens`` tokens a step) -- samples the next tokens (greedy, or temperature /
top-k / top-p with a per-request seed), and releases requests that hit a stop token or their
``max_new_tokens`` (or were aborted). Bad requests are rejected with a message; the rest keep
being served. :class:`ModelRunner` does the model step, the adapters of
:mod:`kvtvm.engine.caches` the cache bookkeeping.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Set
from typing import Callable

import torch

from ..errors import InvalidArgumentError, KVCacheCapacityError, describe
from ..manager.args import parse_devices
from ..manager.uncopyable import Uncopyable
from ..params import KVCacheParams
from .caches import CACHE_CHOICES, make_cache
from .request import Request, ServeStats
from .runner import ModelRunner, check_engine_model
from .sampling import SEED_RANGE, is_int, make_generator, sample, token_list
from .threads import DEFAULT_TORCH_THREADS, check_thread_count, configure_threads
from .tierdir import claim_tier_dir

__all__ = ["Request", "ServeStats", "Engine", "sample"]

_log = logging.getLogger("kvtvm.engine")


#: Finished requests an engine keeps for :meth:`Engine.pop_finished` (the latest).
FINISHED_KEPT = 4096


def _check_quantized_kernels(params: KVCacheParams, device: torch.device) -> None:
    """Refuse (typed, naming the storage argument) an 8-bit cache on a device that lacks one of
    the kernels a step runs over it: append, prefill (prompts) and decode
    (:data:`kvtvm.ops.quant.QUANT_TARGETS`, :data:`kvtvm.ops.quant.BOTH_8BIT`)."""
    if not params.quantized:
        return
    from ..ops.quant import BOTH_8BIT, QUANT_TARGETS

    target = "cuda" if device.type == "cuda" else "llvm"
    storages = {"k_cache_dtype": params.k_cache_dtype, "v_cache_dtype": params.v_cache_dtype}
    name = "cache_dtype" if params.k_cache_dtype == params.v_cache_dtype else next(
        n for n, s in storages.items() if s != params.dtype)
    for op in ("append", "prefill", "decode"):
        have = QUANT_TARGETS.get((target, op), ())
        missing = [s for s in storages.values() if s != params.dtype and s not in have]
        mixed = (target, op) in BOTH_8BIT and any(s not in have for s in storages.values())
        if missing or mixed:
            where = (f"has only for K and V both in {list(have)}" if have else "does not have")
            raise InvalidArgumentError(
                f"{name}: an 8-bit cache on {device.type} needs the {op} kernel over K "
                f"{params.k_cache_dtype} / V {params.v_cache_dtype}, which kvtvm {where} "
                f"on {device.type} (kvtvm.ops.quant.QUANT_TARGETS); serve it on the CPU")


def _check_tier_args(host_tier_pages, disk_tier_dir, disk_tier_bytes) -> None:
    """The Engine's tier options, named as the Engine names them (the manager's own checks
    named host_pages / disk_dir / disk_bytes, or a path of another type raised TypeError)."""
    for name, v in (("host_tier_pages", host_tier_pages), ("disk_tier_bytes", disk_tier_bytes)):
        if not is_int(v) or v < 0:
            raise InvalidArgumentError(describe(name, "an int >= 0", repr(v)))
    if disk_tier_dir is not None and (not isinstance(disk_tier_dir, (str, os.PathLike))
                                      or not os.fspath(disk_tier_dir)):
        raise InvalidArgumentError(describe("disk_tier_dir", "None or a non-empty path (str or "
                                            "os.PathLike)", repr(disk_tier_dir)))


class Engine(Uncopyable):
    """A continuous-batching engine over one kvtvm cache manager.

    Parameters
    ----------
    model : transformers PreTrainedModel
        A Llama-family ``*ForCausalLM`` (see :mod:`kvtvm.engine.runner`) on ``device``.
    cache : {"paged", "continuous", "linear"}
        Which kvtvm manager holds the KV cache.
    max_batch_size, max_seq_len : int
        Sequences at once and tokens per sequence.
    page_size : int
        Tokens per page (paged).
    num_pages : int, optional
        Pages in the pool (paged); default enough for every slot to reach ``max_seq_len``.
    prefix_caching : bool
        Reuse cached full pages of earlier prompts (paged).
    device : str
        ``"cpu"`` or ``"cuda"``; the model must be on it.
    eos_token_ids : sequence of int, optional
        Default stop tokens of requests; default the model's ``generation_config.eos_token_id``.
    max_step_tokens : int, optional
        Most tokens one step computes (decode tokens first, then prompt chunks; new requests
        are admitted into what the running ones leave), or one per running request when more
        run; None: whole prompts in one step.
    torch_threads, kernel_threads : int or None
        Thread counts set at the first step (:func:`kvtvm.engine.threads.configure_threads`).
    host_tier_pages : int
        Pages of the prefix cache's host tier (paged, prefix caching; 0: none): evicted
        cached pages are demoted there and promoted back on a hit.
    disk_tier_dir : str or Path, optional
        Directory of the prefix cache's disk tier (written by a background thread; see
        :class:`kvtvm.manager.tiers.DiskTier`). :meth:`close` writes every cached page there,
        so a later engine on the same directory (a restart, another process) is served warm.
    disk_tier_bytes : int
        Size bound of the disk tier.
    cache_dtype, k_cache_dtype, v_cache_dtype : str, optional
        Storage type of the KV cache (``"int8"`` or ``"float8_e4m3fn"``: 8-bit rows with one
        scale each, :mod:`kvtvm.quant`), of K (of V) alone; default the model's dtype. As
        :class:`~kvtvm.params.KVCacheParams`; all three caches take them, on the CPU and on
        CUDA (K and V 8-bit, or one side only). Bad values raise
        ``KVCacheParams``' :class:`~kvtvm.errors.InvalidArgumentError` before any allocation.
    skip_layers : sequence of int
        Layers whose cache stays in the model's dtype (negative indices count from the end).

    Raises
    ------
    UnsupportedModelError
        The model is not one :class:`ModelRunner` runs (an :class:`InvalidArgumentError`).
    InvalidArgumentError
        A bad argument (cache kind, device other than the model's, thread counts, tiers
        without prefix caching, a disk tier of another model), or as ``KVCacheParams``.
    """

    def __init__(self, model, cache: str = "paged", max_batch_size: int = 4,
                 max_seq_len: int = 128, page_size: int = 16, num_pages: int | None = None,
                 prefix_caching: bool = True, device: str = "cpu", *, eos_token_ids=None,
                 max_step_tokens: int | None = 512,
                 torch_threads: int | None = DEFAULT_TORCH_THREADS,
                 kernel_threads: int | None = None, host_tier_pages: int = 0,
                 disk_tier_dir=None, disk_tier_bytes: int = 1 << 30,
                 cache_dtype: str | None = None, k_cache_dtype: str | None = None,
                 v_cache_dtype: str | None = None, skip_layers=()):
        if cache not in CACHE_CHOICES:
            raise InvalidArgumentError(f"cache must be one of {CACHE_CHOICES}, got {cache!r}")
        if max_step_tokens is not None and (not is_int(max_step_tokens)
                                            or max_step_tokens < 1):
            raise InvalidArgumentError(
                f"max_step_tokens must be None or a positive int, got {max_step_tokens!r}")
        check_thread_count("torch_threads", torch_threads)
        check_thread_count("kernel_threads", kernel_threads)
        _check_tier_args(host_tier_pages, disk_tier_dir, disk_tier_bytes)
        check_engine_model(model)
        if not isinstance(device, (str, torch.device)):  # one device: the model's
            raise InvalidArgumentError(describe("device", "one device (a str or torch.device: "
                                                "the model's)", repr(device)))
        (dev,) = parse_devices(device, name="device")
        model_dev = next(model.parameters()).device
        if model_dev.type != dev.type or (dev.type == "cuda" and dev.index is not None
                                          and model_dev != dev):   # "cpu:0" is the CPU
            raise InvalidArgumentError(describe("device", f"the model's device ({model_dev})",
                                                repr(device)))
        self.hf_model = model
        self.model = ModelRunner(model)
        self.vocab_size = model.config.vocab_size
        self.cache, self.device = cache, dev
        self.max_seq_len, self.max_step_tokens = max_seq_len, max_step_tokens
        self._threads = (torch_threads, kernel_threads)
        self._threads_set = False
        self._stepping = threading.Lock()  # held by the step running (one thread at a time)
        # held by a step, submit, abort and close: requests may be submitted and aborted from
        # other threads while one steps (they wait for its end); re-entrant, so a callback
        # inside a step may abort
        self._state = threading.RLock()
        if eos_token_ids is None:
            gen = getattr(model, "generation_config", None)
            eos_token_ids = getattr(gen, "eos_token_id", None)
        eos = token_list((eos_token_ids,) if is_int(eos_token_ids) else
                          () if eos_token_ids is None else eos_token_ids)
        if eos is None:
            raise InvalidArgumentError(describe("eos_token_ids", "None, an int or a sequence "
                                                "of ints", repr(eos_token_ids)))
        self.eos_token_ids = tuple(eos)
        self.params = KVCacheParams(self.model.dtype, self.model.n_kv_heads,
                                    self.model.head_dim, cache,
                                    page_size=page_size if cache == "paged" else None,
                                    enable_prefix_caching=prefix_caching and cache == "paged",
                                    cache_dtype=cache_dtype, k_cache_dtype=k_cache_dtype,
                                    v_cache_dtype=v_cache_dtype, skip_layers=skip_layers)
        _check_quantized_kernels(self.params, self.device)
        self.kv = make_cache(cache, self.params, max_batch_size, max_seq_len,
                             self.model.num_layers, device, num_pages)
        if host_tier_pages or disk_tier_dir is not None:
            if not self.params.enable_prefix_caching:
                raise InvalidArgumentError("host_tier_pages / disk_tier_dir need the paged "
                                           "cache with prefix caching")
            dtype = str(self.model.dtype).removeprefix("torch.")
            if disk_tier_dir is not None:     # another model's pages: refused, nothing made
                claim_tier_dir(disk_tier_dir, model, dtype, check_only=True)
            self.kv.mgr.attach_tiers(host_pages=host_tier_pages, disk_dir=disk_tier_dir,
                                     disk_bytes=disk_tier_bytes)
            if disk_tier_dir is not None:
                claim_tier_dir(disk_tier_dir, model, dtype)
        self.pending: list[Request] = []    # submitted, not yet arrived
        self.queue: list[Request] = []      # arrived, waiting for room
        self.running: list[Request] = []    # in the cache, in batch order
        # done, rejected or aborted: the latest FINISHED_KEPT (a server runs for days; take
        # them with pop_finished()), and how many ever
        self.finished: deque[Request] = deque(maxlen=FINISHED_KEPT)
        self.finished_count = 0
        self.step_no = 0
        self._closed = False
        self.stats = ServeStats(allocated_bytes=self.kv.allocated_bytes())
        self.log: Callable[[str], None] = _log.info

    # -- requests -------------------------------------------------------------------------

    def close(self, persist: bool = True) -> int:
        """Finish with the engine: with a disk tier, write every cached page there
        (``persist``) and stop its writer. Returns the pages written. Requests submitted
        afterwards are refused (:class:`~kvtvm.errors.InvalidArgumentError`): a closed tier
        takes no more pages, so make a new engine (on the same directory, it starts warm).
        A second call does nothing (returns 0)."""
        with self._state:
            return self._close(persist)

    def _close(self, persist: bool) -> int:
        if self._closed:
            return 0
        self._closed = True
        mgr = getattr(self.kv, "mgr", None)
        if getattr(mgr, "_tiers", None) is None:
            return 0
        disk = mgr._tiers.disk  # (closed: close_tiers ran, or a process forked from ours)
        n = mgr.persist_prefix_cache() if persist and not (disk is not None and disk.closed) \
            else 0
        mgr.close_tiers()
        return n

    def _check_fresh(self, reqs) -> None:
        """Refuse (typed, nothing queued) a request object that was already submitted to an
        engine: its ``output``, ``status`` and cache position belong to that run, and serving
        it again would continue its old output over an empty cache."""
        if self._closed:
            raise InvalidArgumentError("engine: closed by close(); make a new Engine to serve "
                                       "more requests")
        seen = {id(r) for r in (*self.pending, *self.queue, *self.running)}
        for r in reqs:
            if not isinstance(r, Request):
                raise InvalidArgumentError(describe("requests", "kvtvm.engine.Request objects",
                                                    type(r).__name__))
            if (id(r) in seen or r.status != "waiting" or r.output or r.prefilled
                    or r.seq_id != -1):
                raise InvalidArgumentError(
                    f"request {r.rid!r}: already submitted (status {r.status!r}, "
                    f"{len(r.output)} tokens out); submit a new Request for another run")
            seen.add(id(r))

    def submit(self, req: Request) -> None:
        """Queue ``req``; it arrives at engine step ``req.arrival`` (an int; another value
        rejects it). A request object already submitted is refused
        (:class:`~kvtvm.errors.InvalidArgumentError`, nothing queued). Another thread may
        submit while one steps: the request waits for the step's end."""
        with self._state:
            self._submit(req)

    def _submit(self, req: Request) -> None:
        self._check_fresh([req])
        if not is_int(req.arrival):
            self._reject(req, f"arrival must be an int (an engine step), got {req.arrival!r}")
            return
        self.pending.append(req)
        self.pending.sort(key=lambda r: r.arrival)

    def abort(self, rid) -> bool:
        """Stop request ``rid`` wherever it is (its cache is released); False if unknown or
        already finished. From another thread while one steps: after the step's end."""
        with self._state:
            return self._abort(rid)

    def _abort(self, rid) -> bool:
        for where in (self.pending, self.queue):
            for r in where:
                if r.rid == rid:
                    where.remove(r)
                    self._finish(r, "aborted")
                    return True
        for r in self.running:
            if r.rid == rid:
                self.kv.finish(self.running, [r])
                self.running = [q for q in self.running if q is not r]
                self._finish(r, "aborted")
                return True
        return False

    def _finish(self, req: Request, status: str, reason: str = "") -> None:
        req.status, req.finish_reason = status, reason
        req.finished_step, req.t_done = self.step_no, time.perf_counter()
        req.generator = None   # (a sampling request's torch.Generator: native state)
        self.finished.append(req)
        self.finished_count += 1

    def pop_finished(self) -> list[Request]:
        """The requests finished (done, rejected or aborted) since the last call, oldest first,
        at most :data:`FINISHED_KEPT` (older ones were let go: the engine keeps no request
        past that, so a long-running server's memory stays bounded); ``finished_count``
        counts them all."""
        with self._state:
            out = list(self.finished)
            self.finished.clear()
        return out

    def _reject(self, req: Request, why: str) -> None:
        req.error = why
        self._finish(req, "rejected")
        self.log(f"request {req.rid}: rejected: {why}")

    def _validate(self, req: Request) -> str:
        """Why ``req`` can never be served, or ``""``."""
        if isinstance(req.prompt, Mapping):      # a tokenizer's BatchEncoding, say
            return ("prompt must be a sequence of integer token ids, got a mapping (a "
                    "tokenizer's output? pass its ['input_ids'])")
        prompt = None if isinstance(req.prompt, Set) else token_list(req.prompt)
        if prompt is None:
            return "prompt must be a sequence of integer token ids"
        n = len(prompt)
        if n == 0:
            return "empty prompt (at least one token is needed)"
        req.prompt = prompt     # a list of ints from here on (an iterator is read once)
        if n > self.max_seq_len:
            return (f"prompt of {n} tokens is longer than max_seq_len={self.max_seq_len} "
                    "(shorten it or raise the engine's max_seq_len)")
        if not is_int(req.max_new_tokens) or req.max_new_tokens < 1:
            return f"max_new_tokens must be a positive int, got {req.max_new_tokens!r}"
        req.max_new_tokens = int(req.max_new_tokens)  # a numpy int wrapped the sum below
        if req.length > self.max_seq_len:
            return (f"prompt of {n} tokens + max_new_tokens={req.max_new_tokens} needs "
                    f"{req.length} cache positions, more than max_seq_len={self.max_seq_len}")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            return f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})"
        def real(x):
            return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)

        if not (real(req.temperature) and req.temperature >= 0):
            return f"temperature must be a finite number >= 0, got {req.temperature!r}"
        if not (real(req.top_p) and 0 < req.top_p <= 1):
            return f"top_p must be in (0, 1], got {req.top_p!r}"
        if req.top_k is not None and not (is_int(req.top_k) and req.top_k >= 0):
            return f"top_k must be None or an int >= 0 (0: all tokens), got {req.top_k!r}"
        if req.seed is not None and not (is_int(req.seed)
                                         and SEED_RANGE[0] <= req.seed <= SEED_RANGE[1]):
            return (f"seed must be None or an int in [-2**63, 2**64), got {req.seed!r}")
        stop = req.stop_token_ids
        if stop is not None:
            ids = token_list((stop,) if is_int(stop) else stop)
            if ids is None:
                return (f"stop_token_ids must be None, an int or a sequence of ints, got "
                        f"{stop!r}")
            req.stop_token_ids = tuple(ids)      # an iterator is read once
        return self.kv.never_fits(req)

    def _arrive(self) -> None:
        while self.pending and self.pending[0].arrival <= self.step_no:
            req = self.pending.pop(0)
            req.t_arrived = time.perf_counter()
            try:
                why = self._validate(req)
            except BaseException as err:  # a prompt or stop list that raises when read (a
                # generator, a meta tensor): rejected, the others still served
                why = f"could not read the request: {type(err).__name__}: {str(err)[:200]}"
                if not isinstance(err, Exception):  # Ctrl-C while reading it: rejected,
                    self._reject(req, why)          # not lost (it stayed "waiting" in no
                    raise                           # list), then raised
            if why:
                self._reject(req, why)
            else:
                if req.stop_token_ids is None:       # else a tuple of ints (_validate)
                    req.stop_token_ids = self.eos_token_ids
                if req.temperature > 0:
                    req.generator = make_generator(req.seed, req.rid)
                req.arrived_step = self.step_no
                self.queue.append(req)

    def _admit(self, budget: int) -> list[Request]:
        """Move queued requests into the cache, first come first served, while they fit (slots,
        pages, and this step's token budget)."""
        new = []
        try:
            while self.queue and budget > 0 and self.kv.can_admit(self.queue[0],
                                                                    self.running + new):
                req = self.queue[0]
                self.kv.add(req)     # (raises: still queued)
                new.append(self.queue.pop(0))
                req.status, req.admitted_step = "running", self.step_no
                budget -= len(req.prompt)
        except BaseException:        # an interrupt: the ones admitted go back to the queue
            self._unadmit(new)
            raise
        return new

    def _chunks(self, batch) -> list[list[int]]:
        """This step's tokens per request: the last token of those generating, the next prompt
        chunk of the others (at least one token each, within ``max_step_tokens``). A prompt's
        first chunk also holds its prefix-cache hits, which cost nothing to compute (a chunk
        shorter than them would recompute what the cache holds)."""
        budget = self.max_step_tokens or 1 << 62
        budget -= sum(1 for r in batch if r.prefilled == len(r.prompt))
        out = []
        for r in batch:
            if r.prefilled == len(r.prompt):
                out.append(r.output[-1:])
                continue
            hits = self.kv.cached_prefix(r) if r.prefilled == 0 else 0
            n = min(len(r.prompt) - r.prefilled, hits + max(1, budget))
            budget -= n - hits
            out.append(r.prompt[r.prefilled:r.prefilled + n])
        return out

    def _unadmit(self, new) -> None:
        """Undo :meth:`_admit` of ``new`` (never fetched): their slots back, the requests
        back at the head of the queue."""
        if not new:
            return
        self.kv.remove(new)
        for r in reversed(new):
            r.status, r.seq_id, r.admitted_step = "waiting", -1, -1
            self.queue.insert(0, r)

    def _fail(self, batch, err: BaseException, released=None) -> None:
        """A step's forward pass or sampling raised ``err`` (a kernel that does not load, no
        memory, an interrupt): abort every request of ``batch`` (``error`` says why) and
        release their sequences -- an uncommitted fetch is dropped, never committed, so no
        K/V of the failed pass is read later or reaches the prefix cache. Queued requests
        stay queued and the engine serves on. ``released``: the step's whole batch, every
        sequence of which is released (some may be already: the retiring raised)."""
        gone = batch if released is None else released
        self.kv.finish(gone, gone)
        self.running = []
        for r in batch:
            r.error = f"aborted: engine step {self.step_no} failed: {type(err).__name__}: {err}"
            self._finish(r, "aborted")
        if batch:
            self.log(f"requests {[r.rid for r in batch]}: {batch[0].error}")
        self.step_no += 1

    # -- one step -------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """True when no request is waiting, queued or running."""
        return not (self.pending or self.queue or self.running)

    def step(self) -> None:
        """One engine step: arrivals, admission, one forward pass over every running request
        (prompt chunks and decode tokens together), sampling, then retire finished ones.
        One thread at a time: a step while another thread's runs is an InvalidArgumentError
        (:meth:`submit` and :meth:`abort` from other threads wait for the step instead)."""
        if not self._stepping.acquire(blocking=False):
            raise InvalidArgumentError(describe(
                "Engine.step", "one thread at a time (step from one thread; submit and abort "
                "may come from others)", "a step running on another thread"))
        try:
            with self._state:
                self._step()
        finally:
            self._stepping.release()

    def _step(self) -> None:
        if not self._threads_set:          # first use: the one place threads are set
            configure_threads(*self._threads)
            self._threads_set = True
        self._arrive()
        # what the running requests compute this step first (a token each while decoding,
        # the rest of their prompt while prefilling): new ones take only what is left
        need = sum(max(1, len(r.prompt) - r.prefilled) for r in self.running)
        new = self._admit((self.max_step_tokens or 1 << 62) - need)
        if not self.running and not new:
            if self.queue:          # nothing runs and the head still does not fit: never will
                self._reject(self.queue.pop(0), "does not fit in the cache even when it is empty")
            self.step_no += 1
            return
        batch = self.running + new
        try:
            tokens = self._chunks(batch)   # (reads the prefix cache and its tiers)
            kv = self.kv.fetch(batch, tokens)
        except KVCacheCapacityError as err:
            if not new:     # admission reserves room for running requests: not expected
                raise
            # no room after all: the new requests go back to the head of the queue
            self.log(f"requests {[r.rid for r in new]} wait: {err}")
            self._unadmit(new)
            new, batch = [], self.running
            if not batch:
                self.step_no += 1
                return
            tokens = self._chunks(batch)
            kv = self.kv.fetch(batch, tokens)
        except BaseException:
            self._unadmit(new)   # a failed fetch changed nothing: neither does this step
            raise
        self.running = batch
        is_new = {id(r) for r in new}
        # counted once they run (a request put back by _unadmit counted twice before)
        self.stats.waited += sum(r.admitted_step > r.arrived_step for r in new)
        prefilling = [r.prefilled < len(r.prompt) for r in batch]
        computed = []
        for r, t, h in zip(batch, tokens, kv.num_cached_tokens):
            h = int(h)
            computed.append(t[h:])
            if id(r) in is_new:
                r.prefix_hit_tokens = h
                self.stats.prompt_tokens += len(r.prompt)
                self.stats.prefix_hit_tokens += h
            if r.prefilled < len(r.prompt):
                self.stats.prefill_tokens += len(t) - h
                r.prefilled += len(t)
        ready = [r.prefilled == len(r.prompt) for r in batch]
        rows = [i for i, ok in enumerate(ready) if ok]
        try:
            logits = self.model.run_step(kv, computed)
            self.kv.commit(batch, tokens)
            picked = sample(logits[rows], [batch[i] for i in rows]) if rows else []
        except BaseException as err:
            self._fail(batch, err)
            raise
        now, done = time.perf_counter(), []
        for i, tok in zip(rows, picked):
            r = batch[i]
            r.output.append(int(tok))
            if len(r.output) == 1:
                r.t_first = now
            if tok in r.stop_token_ids:
                done.append((r, "stop"))
            elif len(r.output) >= r.max_new_tokens:
                done.append((r, "length"))
        st = self.stats
        st.generated_tokens += len(rows)
        st.decode_steps += all(len(c) == 1 for c in computed)
        st.mixed_steps += any(prefilling) and not all(prefilling)
        st.steps += 1
        st.peak_running = max(st.peak_running, len(batch))
        try:
            st.peak_live_bytes = max(st.peak_live_bytes, self.kv.live_bytes(self.running))
            self.kv.finish(batch, [r for r, _ in done])
        except BaseException as err:  # an interrupt while retiring: the finished ones end
            for r, reason in done:    # (their tokens are all there), the rest are aborted
                self._finish(r, "done", reason)
            self._fail([r for r in batch if r.status == "running"], err, released=batch)
            raise
        for r, reason in done:
            self._finish(r, "done", reason)
        self.running = [r for r in batch if r.status == "running"]
        self.step_no += 1

    def serve(self, requests, progress: Callable | None = None) -> list[Request]:
        """Submit ``requests`` and step until every one is finished; returns them (a list).
        Requests already submitted to an engine are refused before any is queued
        (:class:`~kvtvm.errors.InvalidArgumentError`, as for a non-iterable or a closed
        engine)."""
        if isinstance(requests, Request) or not isinstance(requests, Iterable):
            raise InvalidArgumentError(describe("requests", "an iterable of Request",
                                                type(requests).__name__))
        requests = list(requests)
        with self._state:
            self._check_fresh(requests)
            for r in requests:
                self._submit(r)
        total = len(requests)
        t0 = time.perf_counter()
        while not self.idle:
            if not self.running and not self.queue and self.pending:
                self.step_no = max(self.step_no, self.pending[0].arrival)  # skip idle steps
            self.step()
            if progress is not None:
                progress(self, total)
        self.stats.seconds += time.perf_counter() - t0   # the counters add up over calls
        return requests

    def warmup(self) -> float:
        """Load (or build, once) every kernel this engine uses, on a throwaway cache of the
        same kind; returns the seconds it took."""
        t0 = time.perf_counter()
        tmp = Engine(self.hf_model, self.cache, max_batch_size=2, max_seq_len=32,
                     page_size=self.params.page_size or 16, num_pages=None,
                     prefix_caching=False, device=str(self.device), eos_token_ids=(),
                     torch_threads=self._threads[0], kernel_threads=self._threads[1],
                     k_cache_dtype=self.params.k_cache_dtype,
                     v_cache_dtype=self.params.v_cache_dtype,
                     skip_layers=self.params.skip_layers)
        tmp.log = lambda s: None
        tmp.serve([Request(0, [5, 6, 7], 3), Request(1, [8, 9], 2, arrival=1)])
        return time.perf_counter() - t0
