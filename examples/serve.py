"""Serve a small Llama through kvtvm: continuous batching, paged KV cache, prefix caching.

A random-weight Llama built from a ``transformers`` ``LlamaConfig`` (fixed seed) generates text
for a stream of requests. torch runs the embeddings, RMSNorm, projections, RoPE, MLP and LM head;
kvtvm owns the KV cache (a manager hands out slots and pages) and runs the cache kernels (append
the new K/V, then prefill or decode attention over the cache). Each engine step mixes the prompts
of newly admitted requests with one decode token of every running request. Requests that do not
fit (no free slot, not enough pages) wait in the queue; bad requests are rejected with a message
while the rest keep being served. At the end every request's tokens are checked against
``transformers``' own ``model.generate`` on that request alone; any difference exits non-zero.

    python examples/serve.py                       # paged cache with prefix caching, CPU
    python examples/serve.py --cache continuous    # one max_seq_len block per sequence
    python examples/serve.py --cache linear        # seed 004's linear cache (slot compaction)
    python examples/serve.py --device cuda --kernels build/kernels   # AOT-built CUDA kernels

Importable: :func:`build_model`, :class:`Request`, :func:`demo_requests`, :class:`Engine`,
:func:`reference_tokens`, :func:`check_against_reference`, :func:`run`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Callable

import numpy as np
import torch

from kvtvm import KVCacheParams, ops
from kvtvm.errors import CompilerUnavailableError, KVCacheCapacityError
from kvtvm.plan import plan_step
from kvtvm.manager import (BatchItem, ContinuousBatchingKVCacheManager, LinearKVCache,
                           PagedKVCacheManager, TokenBatch)

CACHE_CHOICES = ("paged", "continuous", "linear")

#: Builds every kernel this example loads for an H100 (copy runs with n_kv_heads=1: it moves
#: whole slots for the linear cache's eviction). Use --arch sm_80 for an A100.
CUDA_BUILD_COMMAND = ("python -m kvtvm build --target cuda --arch sm_90a "
                      "--ops append,prefill,decode,copy --dtypes float32 --head-dims 32 "
                      "--kv-heads 1,2 --group-sizes 4 --layouts nhd,hnd --out build/kernels")


# ------------------------------------------------------------------------------------------
# The model: transformers' Llama weights, kvtvm's KV cache
# ------------------------------------------------------------------------------------------


def build_model(seed: int = 0, num_layers: int = 4, hidden_size: int = 256, n_heads: int = 8,
                n_kv_heads: int = 2, head_dim: int = 32, intermediate_size: int = 512,
                vocab_size: int = 1000, device: str = "cpu"):
    """A random-weight ``transformers`` Llama (float32, eval mode, fixed seed).

    Weights are drawn with std 0.1 (``initializer_range``; transformers' default 0.02 gives a
    model whose greedy tokens barely depend on attention, so a broken KV cache would go
    unnoticed). No end-of-sequence token is set, so every request generates exactly its
    ``max_new_tokens``.
    """
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads, head_dim=head_dim, max_position_embeddings=4096,
        rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def rotate_half(x):
    """transformers' RoPE convention: the two halves of the head, ``(-x2, x1)``."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class KVTVMLlama:
    """The Llama forward pass over a ragged batch, with kvtvm doing KV append and attention.

    The batch is ragged: the new tokens of every sequence are concatenated into one
    ``[num_tokens]`` row dimension and ``kv.qo_indptr`` says which rows belong to which sequence.
    Each layer projects q, k, v, rotates them by position, appends k and v to the cache and
    attends over the cache -- decode attention when every sequence adds exactly one token,
    prefill attention otherwise -- through one :func:`kvtvm.plan.plan_step` per step (the ops'
    checks run on the first layer; the others replay its launches).
    """

    def __init__(self, hf_model):
        cfg = hf_model.config
        self.model = hf_model.model          # embed_tokens, layers, norm, rotary_emb
        self.lm_head = hf_model.lm_head
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.num_layers = cfg.num_hidden_layers
        self.use_decode_kernel = hasattr(ops, "decode_attention")

    @torch.no_grad()
    def forward(self, token_ids, positions, kv, decode: bool):
        """Logits of the last new token of each sequence.

        Parameters
        ----------
        token_ids, positions : torch.Tensor
            int64 ``[num_tokens]``: the new tokens and their positions in their sequence.
        kv : kvtvm.inputs.RaggedKVCacheInputs
            This step's cache inputs from the manager.
        decode : bool
            Every sequence adds exactly one token (use the decode kernel).

        Returns
        -------
        torch.Tensor
            float32 ``[batch, vocab_size]``.
        """
        T, Hq, Hkv, D = token_ids.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        x = self.model.embed_tokens(token_ids)                            # [T, hidden]
        cos, sin = self.model.rotary_emb(x, positions[None])              # [1, T, D]
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]                 # [T, 1, D]
        # kvtvm: this step's append + attention for every layer, arguments checked once
        plan = plan_step(kv, decode=decode and self.use_decode_kernel)
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(T, Hq, D)
            k = attn.k_proj(h).view(T, Hkv, D)
            v = attn.v_proj(h).view(T, Hkv, D).contiguous()
            q = (q * cos + rotate_half(q) * sin).contiguous()            # RoPE
            k = (k * cos + rotate_half(k) * sin).contiguous()
            plan.append_kv(i, k, v)      # write this step's K/V into layer i's cache
            o, _ = plan.attention(i, q)  # attend over it: decode or causal prefill kernel
            x = x + attn.o_proj(o.reshape(T, Hq * D))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        last = torch.from_numpy(kv.qo_indptr_host[1:].astype(np.int64) - 1).to(x.device)
        return self.lm_head(self.model.norm(x[last]))


# ------------------------------------------------------------------------------------------
# Requests
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Request:
    """One generation request.

    ``arrival`` is the engine step at which it is submitted. The engine fills ``output`` (the
    generated tokens), ``status`` (``"waiting"``, ``"running"``, ``"done"``, ``"rejected"``),
    ``error`` (why it was rejected) and ``prefix_hit_tokens`` (prompt tokens read from the
    prefix cache instead of computed).
    """

    rid: int
    prompt: list
    max_new_tokens: int
    arrival: int = 0
    output: list = dataclasses.field(default_factory=list)
    status: str = "waiting"
    error: str = ""
    prefix_hit_tokens: int = 0
    seq_id: int = -1
    admitted_step: int = -1
    finished_step: int = -1

    @property
    def length(self) -> int:
        """Tokens the cache will hold when the request finishes (its last generated token is
        never fed back)."""
        return len(self.prompt) + self.max_new_tokens - 1


def demo_requests(vocab_size: int = 1000, max_seq_len: int = 128, seed: int = 1,
                  n: int = 24, system_len: int = 48, bad: bool = True) -> list[Request]:
    """A workload: ``n`` requests arriving over time, half of them sharing a ``system_len``
    token system prompt, one whose prompt fills pages of 16 exactly, plus (with ``bad``) an
    empty prompt and a prompt longer than ``max_seq_len``."""
    rng = np.random.default_rng(seed)
    system = rng.integers(3, vocab_size, system_len).tolist()
    reqs = []
    for i in range(n):
        if i % 2 == 0:   # system prompt + a short user turn: prefix-cache hits after the first
            prompt = system + rng.integers(3, vocab_size, int(rng.integers(3, 24))).tolist()
        elif i == 3:     # fills exactly two pages of 16 tokens
            prompt = rng.integers(3, vocab_size, 32).tolist()
        else:
            prompt = rng.integers(3, vocab_size, int(rng.integers(2, 40))).tolist()
        reqs.append(Request(i, prompt, int(rng.integers(4, 32)), arrival=2 * i))
    if bad:
        reqs.append(Request(n, [], 8, arrival=3))
        reqs.append(Request(n + 1, rng.integers(3, vocab_size, max_seq_len + 8).tolist(), 8,
                            arrival=5))
    return reqs


# ------------------------------------------------------------------------------------------
# Cache backends: one small adapter per manager
# ------------------------------------------------------------------------------------------


class _TableCache:
    """CONTINUOUS and PAGED: the seed-002 verbs claim / fetch / step / release."""

    def __init__(self, cache: str, params, max_batch_size, max_seq_len, num_layers, device,
                 num_pages):
        self.paged = cache == "paged"
        if self.paged:
            self.mgr = PagedKVCacheManager(params, max_batch_size, max_seq_len, num_layers,
                                           devices=(device,), num_pages=num_pages)
        else:
            self.mgr = ContinuousBatchingKVCacheManager(params, max_batch_size, max_seq_len,
                                                        num_layers, devices=(device,))
        self.params, self.num_layers = params, num_layers
        self.page_size = params.page_size if self.paged else max_seq_len

    def pages(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def never_fits(self, req: Request) -> str:
        if self.paged and self.pages(req.length) > self.mgr.num_pages:
            return (f"needs {self.pages(req.length)} pages of {self.page_size} tokens, the "
                    f"whole pool holds {self.mgr.num_pages}")
        return ""

    def can_admit(self, req: Request, running: list[Request]) -> bool:
        """A free slot, and (paged) enough free or evictable pages for the request to reach
        its final length on top of what the running requests may still need."""
        if not self.mgr.slots_remaining:
            return False
        if not self.paged:
            return True
        st = self.mgr.stats()
        reserved = sum(self.pages(r.length) - len(self.mgr.pages_of(r.seq_id))
                       if r.seq_id >= 0 else self.pages(r.length) for r in running)
        return st.pages_free + st.pages_cached - reserved >= self.pages(req.length)

    def add(self, req: Request) -> None:
        (req.seq_id,) = self.mgr.claim(1)

    def remove(self, new) -> None:
        """Undo :meth:`add` of requests that were never fetched."""
        for r in new:
            self.mgr.release(r.seq_id)

    @staticmethod
    def _batch(reqs, tokens):
        """The batch in the form a manager takes: a decode step (one token each) as a
        ``TokenBatch`` of arrays -- no Python object per sequence --, others as seed 002's
        list of ``BatchItem``."""
        if all(len(t) == 1 for t in tokens):
            return TokenBatch([r.seq_id for r in reqs], [t[0] for t in tokens])
        return [BatchItem(r.seq_id, t) for r, t in zip(reqs, tokens)]

    def fetch(self, reqs, tokens):
        return self.mgr.fetch(self._batch(reqs, tokens))[0]

    def commit(self, reqs, tokens):
        self.mgr.step(self._batch(reqs, tokens))

    def finish(self, reqs, finished) -> None:
        for r in finished:
            self.mgr.release(r.seq_id)

    def live_bytes(self, running) -> int:
        if self.paged:
            return self.mgr.stats().pages_used * self.params.bytes_per_page(self.num_layers)
        return (sum(self.mgr.cache_length(r.seq_id) for r in running if r.seq_id >= 0)
                * self.params.bytes_per_token(self.num_layers))

    def allocated_bytes(self) -> int:
        return self.mgr.device_nbytes()


class _LinearCache:
    """LINEAR (seed 004): batch slot b holds the b-th running request.

    A new request takes the next slot (``set_active_batch_size``); finished requests are
    removed by ``evict``, which moves the kept ones to the front with the copy kernel, so the
    running list and the slots stay in the same order.
    """

    def __init__(self, params, max_batch_size, max_seq_len, num_layers, device):
        self.mgr = LinearKVCache(params, max_batch_size, max_seq_len, num_layers,
                                 devices=(device,))
        self.params, self.num_layers = params, num_layers
        self.mgr.reset_for_new_sequences([])

    def never_fits(self, req: Request) -> str:
        return ""

    def can_admit(self, req: Request, running: list[Request]) -> bool:
        return self.mgr.active_batch_size < self.mgr.max_batch_size

    def add(self, req: Request) -> None:
        req.seq_id = self.mgr.active_batch_size
        self.mgr.set_active_batch_size(req.seq_id + 1)

    def remove(self, new) -> None:
        """Undo :meth:`add` of the last requests (never fetched)."""
        self.mgr.set_active_batch_size(self.mgr.active_batch_size - len(new))

    def fetch(self, reqs, tokens):
        assert [r.seq_id for r in reqs] == list(range(len(reqs))), "slots out of order"
        return self.mgr.step_inputs([len(t) for t in tokens])[0]

    def commit(self, reqs, tokens):
        self.mgr.commit_sequence_length(np.array([len(t) for t in tokens], dtype=np.int64))

    def finish(self, reqs, finished) -> None:
        if not finished:
            return
        gone = {id(r) for r in finished}
        keep = [b for b, r in enumerate(reqs) if id(r) not in gone]
        self.mgr.evict(keep)
        for b, r in enumerate(r for r in reqs if id(r) not in gone):
            r.seq_id = b

    def live_bytes(self, running) -> int:
        return int(self.mgr.host_lengths.sum()) * self.params.bytes_per_token(self.num_layers)

    def allocated_bytes(self) -> int:
        return self.mgr.device_nbytes()


# ------------------------------------------------------------------------------------------
# The engine
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ServeStats:
    steps: int = 0
    prefill_tokens: int = 0          # prompt tokens computed
    prompt_tokens: int = 0           # prompt tokens of admitted requests
    prefix_hit_tokens: int = 0       # prompt tokens read from the prefix cache
    generated_tokens: int = 0
    decode_steps: int = 0            # steps run with the decode kernel
    mixed_steps: int = 0             # steps mixing new prompts with ongoing decodes
    waited: int = 0                  # requests that waited in the queue at least one step
    peak_running: int = 0            # most requests in the cache at once
    peak_live_bytes: int = 0
    allocated_bytes: int = 0
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0


class Engine:
    """A continuous-batching engine over one kvtvm cache manager.

    Parameters
    ----------
    model : transformers LlamaForCausalLM
        The weights (see :func:`build_model`).
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
    """

    def __init__(self, model, cache: str = "paged", max_batch_size: int = 4,
                 max_seq_len: int = 128, page_size: int = 16, num_pages: int | None = None,
                 prefix_caching: bool = True, device: str = "cpu"):
        if cache not in CACHE_CHOICES:
            raise ValueError(f"cache must be one of {CACHE_CHOICES}, got {cache!r}")
        cfg = model.config
        self.hf_model = model
        self.model = KVTVMLlama(model)
        self.vocab_size = cfg.vocab_size
        self.cache, self.device = cache, torch.device(device)
        self.max_seq_len = max_seq_len
        params = KVCacheParams("float32", self.model.n_kv_heads, self.model.head_dim, cache,
                               page_size=page_size if cache == "paged" else None,
                               enable_prefix_caching=prefix_caching and cache == "paged")
        self.params = params
        if cache == "linear":
            self.kv = _LinearCache(params, max_batch_size, max_seq_len, self.model.num_layers,
                                   device)
        else:
            self.kv = _TableCache(cache, params, max_batch_size, max_seq_len,
                                  self.model.num_layers, device, num_pages)
        self.pending: list[Request] = []    # submitted, not yet arrived
        self.queue: list[Request] = []      # arrived, waiting for room
        self.running: list[Request] = []    # in the cache, in batch order
        self.finished: list[Request] = []   # done or rejected
        self.step_no = 0
        self.stats = ServeStats(allocated_bytes=self.kv.allocated_bytes())
        self.log: Callable[[str], None] = print

    # -- requests -------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        """Queue ``req``; it arrives at engine step ``req.arrival``."""
        self.pending.append(req)
        self.pending.sort(key=lambda r: r.arrival)

    def _reject(self, req: Request, why: str) -> None:
        req.status, req.error = "rejected", why
        req.finished_step = self.step_no
        self.finished.append(req)
        self.log(f"request {req.rid}: rejected: {why}")

    def _validate(self, req: Request) -> str:
        """Why ``req`` can never be served, or ``""``."""
        try:
            prompt = [int(t) for t in req.prompt]
        except (TypeError, ValueError):
            return "prompt must be a sequence of integer token ids"
        if prompt != list(req.prompt):
            return "prompt must be a sequence of integer token ids"
        n = len(prompt)
        if n == 0:
            return "empty prompt (at least one token is needed)"
        if n > self.max_seq_len:
            return f"prompt of {n} tokens is longer than max_seq_len={self.max_seq_len}"
        if (not isinstance(req.max_new_tokens, int) or isinstance(req.max_new_tokens, bool)
                or req.max_new_tokens < 1):
            return f"max_new_tokens must be a positive int, got {req.max_new_tokens!r}"
        if req.length > self.max_seq_len:
            return (f"prompt of {n} tokens + max_new_tokens={req.max_new_tokens} needs "
                    f"{req.length} cache positions, more than max_seq_len={self.max_seq_len}")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            return f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})"
        return self.kv.never_fits(req)

    def _arrive(self) -> None:
        while self.pending and self.pending[0].arrival <= self.step_no:
            req = self.pending.pop(0)
            why = self._validate(req)
            if why:
                self._reject(req, why)
            else:
                self.queue.append(req)

    def _admit(self) -> list[Request]:
        """Move queued requests into the cache, first come first served, while they fit."""
        new = []
        while self.queue and self.kv.can_admit(self.queue[0], self.running + new):
            req = self.queue.pop(0)
            self.kv.add(req)
            req.status, req.admitted_step = "running", self.step_no
            if req.admitted_step > req.arrival:
                self.stats.waited += 1
            new.append(req)
        return new

    # -- one step -------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not (self.pending or self.queue or self.running)

    def step(self) -> None:
        """One engine step: arrivals, admission, one forward pass over every running request
        (new ones run their prompt, the others decode one token), then retire finished ones."""
        self._arrive()
        new = self._admit()
        if not self.running and not new:
            if self.queue:          # nothing runs and the head still does not fit: never will
                self._reject(self.queue.pop(0), "does not fit in the cache even when it is empty")
            self.step_no += 1
            return
        is_new = {id(r) for r in new}
        batch = self.running + new
        tokens = [r.prompt if id(r) in is_new else r.output[-1:] for r in batch]
        try:
            kv = self.kv.fetch(batch, tokens)
        except KVCacheCapacityError as err:
            if not new:     # admission reserves room for running requests: not expected
                raise
            # no room after all: the new requests go back to the head of the queue
            self.log(f"requests {[r.rid for r in new]} wait: {err}")
            self.kv.remove(new)
            for r in reversed(new):
                r.status, r.seq_id, r.admitted_step = "waiting", -1, -1
                self.queue.insert(0, r)
            new, is_new, batch = [], set(), self.running
            if not batch:
                self.step_no += 1
                return
            tokens = [r.output[-1:] for r in batch]
            kv = self.kv.fetch(batch, tokens)
        self.running = batch
        hits = kv.num_cached_tokens
        ids, counts = [], []
        for r, t, h in zip(batch, tokens, hits):
            ids.extend(t[h:])
            counts.append(len(t) - h)
            if id(r) in is_new:
                r.prefix_hit_tokens = int(h)
                self.stats.prompt_tokens += len(t)
                self.stats.prefix_hit_tokens += int(h)
                self.stats.prefill_tokens += len(t) - int(h)
        decode = all(c == 1 for c in counts)
        start = kv.cache_lengths_host.astype(np.int64)
        offsets = np.arange(sum(counts)) - np.repeat(kv.qo_indptr_host[:-1], counts)
        positions = np.repeat(start, counts) + offsets
        dev = self.device
        logits = self.model.forward(torch.tensor(ids, dtype=torch.int64, device=dev),
                                    torch.from_numpy(positions).to(dev), kv, decode)
        self.kv.commit(batch, tokens)
        next_tokens = logits.argmax(dim=-1).tolist()
        done = []
        for r, tok in zip(batch, next_tokens):
            r.output.append(int(tok))
            if len(r.output) >= r.max_new_tokens:
                done.append(r)
        self.stats.generated_tokens += len(batch)
        self.stats.decode_steps += decode
        self.stats.mixed_steps += bool(new) and len(new) < len(batch)
        self.stats.steps += 1
        self.stats.peak_running = max(self.stats.peak_running, len(batch))
        self.stats.peak_live_bytes = max(self.stats.peak_live_bytes,
                                         self.kv.live_bytes(self.running))
        self.kv.finish(batch, done)
        for r in done:
            r.status, r.finished_step = "done", self.step_no
            self.finished.append(r)
        self.running = [r for r in batch if r.status == "running"]
        self.step_no += 1

    def serve(self, requests, progress: Callable | None = None) -> list[Request]:
        """Submit ``requests`` and step until every one is done or rejected."""
        for r in requests:
            self.submit(r)
        total = len(requests)
        t0 = time.perf_counter()
        while not self.idle:
            if not self.running and not self.queue and self.pending:
                self.step_no = max(self.step_no, self.pending[0].arrival)  # skip idle steps
            self.step()
            if progress is not None:
                progress(self, total)
        self.stats.seconds = time.perf_counter() - t0
        return requests

    def warmup(self) -> float:
        """Load (or build, once) every kernel this engine uses, on a throwaway cache of the
        same kind; returns the seconds it took."""
        t0 = time.perf_counter()
        tmp = Engine(self.hf_model, self.cache, max_batch_size=2, max_seq_len=32,
                     page_size=self.params.page_size or 16, num_pages=None,
                     prefix_caching=False, device=str(self.device))
        tmp.log = lambda s: None
        tmp.serve([Request(0, [5, 6, 7], 3), Request(1, [8, 9], 2, arrival=1)])
        return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------
# Checking against transformers
# ------------------------------------------------------------------------------------------


@torch.no_grad()
def reference_tokens(model, prompt, max_new_tokens: int) -> list[int]:
    """Greedy tokens of ``transformers``' own ``generate`` on this prompt alone."""
    ids = torch.tensor([list(prompt)], dtype=torch.int64, device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def check_against_reference(model, requests) -> list[str]:
    """One message per served request whose tokens differ from ``generate``'s (empty: all
    equal). The message names the request, the position and the expected and actual token."""
    problems = []
    for r in requests:
        if r.status != "done":
            continue
        want = reference_tokens(model, r.prompt, r.max_new_tokens)
        got = r.output
        if got == want:
            continue
        i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want),
                                                                               len(got)))
        exp = want[i] if i < len(want) else "<end>"
        act = got[i] if i < len(got) else "<end>"
        problems.append(f"request {r.rid}: generated token {i} (sequence position "
                        f"{len(r.prompt) + i}): expected {exp} (transformers), got {act} "
                        f"(kvtvm {len(got)} tokens: {got[:i + 1]}...)")
    return problems


# ------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


class ProgressBar:
    """A status line on stderr: requests finished, running, queued, KV memory live/allocated.

    On a terminal it redraws in place every step; otherwise it prints a line each time a request
    finishes. :meth:`say` prints a message without tearing the bar.
    """

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.open = False
        self.last_done = -1

    def say(self, msg: str) -> None:
        if self.open:
            self.stream.write("\n")
            self.stream.flush()
            self.open = False
        print(msg, flush=True)

    def __call__(self, engine: "Engine", total: int) -> None:
        done = len(engine.finished)
        if not self.tty and done == self.last_done:
            return
        self.last_done = done
        width = 30
        fill = int(width * done / total) if total else width
        live = engine.kv.live_bytes(engine.running)
        line = (f"[{'#' * fill}{'.' * (width - fill)}] {done}/{total} requests | step "
                f"{engine.step_no} | running {len(engine.running)} | queued "
                f"{len(engine.queue)} | KV live {_mib(live)} of "
                f"{_mib(engine.stats.allocated_bytes)}")
        if self.tty:
            self.stream.write("\r" + line + "\033[K")
            self.open = done < total
            if not self.open:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def run(cache: str = "paged", device: str = "cpu", requests=None, max_batch_size: int = 4,
        max_seq_len: int = 128, page_size: int = 16, num_pages: int | None = 20,
        prefix_caching: bool = True, seed: int = 0, verify: bool = True, quiet: bool = False,
        model=None, log: Callable[[str], None] | None = None):
    """Serve ``requests`` (default :func:`demo_requests`) and check them against transformers.

    Returns ``(engine, requests, problems)``; ``problems`` lists token mismatches.
    """
    bar = None if quiet else ProgressBar()
    say = (lambda s: None) if quiet else (log or bar.say)
    if model is None:
        model = build_model(seed=seed, device=device)
    if requests is None:
        requests = demo_requests(model.config.vocab_size, max_seq_len)
    engine = Engine(model, cache, max_batch_size, max_seq_len, page_size, num_pages,
                    prefix_caching, device)
    engine.log = say
    say(f"kvtvm serving a {model.config.num_hidden_layers}-layer Llama "
        f"(hidden {model.config.hidden_size}, {model.config.num_attention_heads} q heads / "
        f"{model.config.num_key_value_heads} kv heads, head_dim {engine.model.head_dim}, "
        f"vocab {model.config.vocab_size}, float32) on {device}")
    desc = {"paged": f"paged: {engine.kv.mgr.num_pages if cache == 'paged' else 0} pages of "
                     f"{page_size} tokens, prefix caching "
                     f"{'on' if engine.params.enable_prefix_caching else 'off'}",
            "continuous": f"continuous: one block of {max_seq_len} tokens per sequence",
            "linear": f"linear: {max_batch_size} slots of {max_seq_len} tokens, finished "
                      "requests evicted by slot compaction"}[cache]
    say(f"cache {desc}; {max_batch_size} sequences at once, max_seq_len {max_seq_len}; "
        f"{_mib(engine.stats.allocated_bytes)} allocated")
    say(f"kernels ready in {engine.warmup():.1f} s (loaded from disk or built once)")
    say(f"serving {len(requests)} requests arriving over "
        f"{max((r.arrival for r in requests), default=0) + 1} steps")
    engine.serve(requests, progress=bar)
    st = engine.stats
    served = [r for r in requests if r.status == "done"]
    rejected = [r for r in requests if r.status == "rejected"]
    say(f"served {len(served)} requests ({len(rejected)} rejected, {st.waited} waited for room) "
        f"in {st.steps} steps ({st.mixed_steps} mixing prefill with decode, {st.decode_steps} "
        f"pure decode)")
    say(f"throughput: {st.generated_tokens} tokens generated in {st.seconds:.2f} s = "
        f"{st.tokens_per_second:.1f} tokens/s ({st.prefill_tokens} prompt tokens computed)")
    say(f"KV memory: peak live {_mib(st.peak_live_bytes)} of {_mib(st.allocated_bytes)} "
        f"allocated ({100 * st.peak_live_bytes / st.allocated_bytes:.0f}%)")
    if engine.params.enable_prefix_caching:
        say(f"prefix cache: {st.prefix_hit_tokens} of {st.prompt_tokens} prompt tokens reused "
            f"(hit rate {100 * st.hit_rate:.1f}%)")
    else:
        say(f"prefix cache: off for --cache {cache} (hit rate 0%)")
    problems = []
    if verify:
        t0 = time.perf_counter()
        problems = check_against_reference(model, requests)
        for p in problems:
            say("MISMATCH " + p)
        if not problems:
            say(f"all {len(served)} served requests match transformers' generate() token for "
                f"token (checked in {time.perf_counter() - t0:.1f} s)")
    return engine, requests, problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default="paged", choices=CACHE_CHOICES,
                        help="KV cache manager (default: paged)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--kernels", default=None, metavar="DIR",
                        help="directory of kernels built with `python -m kvtvm build` "
                             "(also KVTVM_KERNEL_PATH)")
    parser.add_argument("--requests", type=int, default=24,
                        help="requests to serve (plus two bad ones)")
    parser.add_argument("--max-batch-size", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=20,
                        help="pages in the paged pool (small, so requests queue for room)")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch intra-op threads (default 1: for a model this small, "
                             "torch's thread pool and the kernels' TVM thread pool spin-waiting "
                             "on the same few cores cost far more than they win)")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip the token-for-token check against transformers")
    args = parser.parse_args(argv)
    if args.kernels:
        from kvtvm import compiler

        compiler.add_kernel_dir(args.kernels)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    model = build_model(seed=args.seed, device=args.device)
    requests = demo_requests(model.config.vocab_size, args.max_seq_len, n=args.requests)
    try:
        _, _, problems = run(args.cache, args.device, requests, args.max_batch_size,
                             args.max_seq_len, args.page_size, args.num_pages,
                             not args.no_prefix_caching, args.seed, not args.no_verify,
                             model=model)
    except CompilerUnavailableError as err:   # runtime-only install, kernels not built
        print(f"error: {err}\nbuild them with:\n  {CUDA_BUILD_COMMAND}\nthen pass "
              "--kernels build/kernels (or set KVTVM_KERNEL_PATH)", file=sys.stderr)
        return 2
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
