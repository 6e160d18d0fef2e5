"""A seeded random driver of the three managers and the CPU ops on shapes off the usual grid,
checked after every operation against a dense shadow (used by ``test_offgrid_fuzz.py``).

The shadow holds each sequence's tokens; the K/V of a token are a function of its whole prefix
(as in a real model), so a prefix-cache hit, a fork or an import must serve exactly what the
sequence would have computed. After every operation the driver reads every live sequence's
K/V back out of the cache (dequantized with :mod:`kvtvm.quant`'s reference for an 8-bit
layer) and compares them with the shadow's values as stored -- exact: the kernels quantize
like the reference -- and checks lengths, claimed ids and the paged manager's invariants.
Every fetch also runs decode or prefill attention (through a ``StepPlan`` or the ops) and
compares it with numpy attention in float64 over the shadow (``TOL`` per dtype).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvtvm import KVCacheParams, ops
from kvtvm.errors import KVCacheCapacityError, SequenceStateError, SequenceTooLongError
from kvtvm.inputs import BatchItem, TokenBatch
from kvtvm.manager import (ContinuousBatchingKVCacheManager, LinearKVCache,
                           PagedKVCacheManager)
from kvtvm.plan import plan_step
from kvtvm.quant import QUANT_DTYPES, dequantize_rows, numpy_storage_dtype, quantize_rows
from kvtvm.storage import layer_view

from offgrid_hostile_calls import TORCH, HostileCalls  # noqa: E402  (tests/manager)

#: Max abs error of attention outputs (values of magnitude <= 2) per ``dtype``: float32
#: accumulation vs float64, then the output's rounding to ``dtype``.
TOL = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}


@dataclass(frozen=True)
class Shape:
    """One manager configuration."""

    strategy: str
    dtype: str = "float32"
    storage: tuple = (None, None)     # (k_cache_dtype, v_cache_dtype)
    skip: tuple = ()
    H: int = 1
    D: int = 8
    G: int = 1
    L: int = 1
    P: int | None = None
    MB: int = 3
    S: int = 24
    prefix: bool = False
    num_pages: int | None = None
    long: bool = False                # prompts up to S tokens (parallel kernels, KV splits)
    tiers: str = ""                   # "host" / "disk": lower tiers of the prefix cache

    def params(self) -> KVCacheParams:
        return KVCacheParams(self.dtype, self.H, self.D, self.strategy,
                             page_size=self.P if self.strategy == "paged" else None,
                             enable_prefix_caching=self.prefix,
                             k_cache_dtype=self.storage[0], v_cache_dtype=self.storage[1],
                             skip_layers=self.skip)

    def make(self):
        p = self.params()
        if self.strategy == "paged":
            mgr = PagedKVCacheManager(p, self.MB, self.S, self.L, num_pages=self.num_pages)
            if self.tiers:
                import tempfile
                mgr.offgrid_disk_dir = (tempfile.mkdtemp(prefix="kvtvm-offgrid-")
                                        if self.tiers == "disk" else None)
                mgr.attach_tiers(host_pages=3 if self.tiers == "host" else 0,
                                 disk_dir=mgr.offgrid_disk_dir)
            return mgr
        if self.strategy == "continuous":
            return ContinuousBatchingKVCacheManager(p, self.MB, self.S, self.L)
        return LinearKVCache(p, self.MB, self.S, self.L)


def cache_numpy(view: torch.Tensor, D: int, storage: str) -> np.ndarray:
    """A per-layer view as float64 ``[..., D]`` (dequantized when ``storage`` is 8-bit)."""
    if storage in QUANT_DTYPES:
        rows = view.contiguous().view(torch.uint8).numpy().view(numpy_storage_dtype(storage))
        return dequantize_rows(rows, D, storage).astype(np.float64)
    return view[..., :D].float().numpy().astype(np.float64)


def attention(q, keys, vals, q_pos, causal=True, sm_scale=None, window=None):
    """float64 attention: q ``[n, Hq, D]`` at positions ``q_pos``; keys/vals ``[T, H, D]``
    -> ``[n, Hq, D]`` (a causal sliding ``window`` sees the last ``window`` positions)."""
    n, hq, d = q.shape
    g = hq // keys.shape[1]
    k = np.repeat(keys, g, axis=1)
    v = np.repeat(vals, g, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) * (1 / math.sqrt(d) if sm_scale is None else sm_scale)
    pos, qp = np.arange(len(keys))[None, :], np.asarray(q_pos)[:, None]
    vis = pos <= qp if causal else np.ones((n, len(keys)), bool)
    if window is not None:
        vis &= pos > qp - window
    s = np.where(vis[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


class Driver(HostileCalls):
    """Random operations on one manager, each checked against the shadow."""

    def __init__(self, shape: Shape, seed: int):
        self.cfg = shape
        self.rng = np.random.default_rng(seed)
        self.seed = seed
        self.params = shape.params()
        self.mgr = shape.make()
        self.linear = shape.strategy == "linear"
        self.storages = [[self.params.storage(layer, kv, shape.L) for kv in (0, 1)]
                         for layer in range(shape.L)]
        self._memo = {}
        self.shadow: dict[int, list[int]] = {}  # seq id (linear: batch index) -> tokens
        self.log: list[str] = []
        self.counts: dict[str, int] = {}
        gen = torch.Generator().manual_seed(seed)
        self.torch_gen = gen
        for b in self.blocks():  # garbage bytes (NaN included) where nothing was written
            b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape,
                                                    dtype=torch.uint8, generator=gen))

    # -- helpers --------------------------------------------------------------------------
    def blocks(self):
        return [self.mgr.get_kv_cache_buffer(0)] if self.linear else list(self.mgr.blocks)

    def kv_of(self, prefix: tuple) -> np.ndarray:
        """float32 ``[L, 2, H, D]`` (values of ``dtype``) of the last token of ``prefix``."""
        v = self._memo.get(prefix)
        if v is None:
            h = hash((self.seed, prefix)) % (2 ** 32)
            x = np.random.default_rng(h).uniform(-2, 2, (self.cfg.L, 2, self.cfg.H,
                                                         self.cfg.D)).astype(np.float32)
            x = torch.tensor(x).to(TORCH[self.cfg.dtype]).float().numpy()
            v = self._memo[prefix] = x
        return v

    def stored(self, kv: np.ndarray) -> np.ndarray:
        """``[n, L, 2, H, D]`` K/V as the cache holds them (8-bit layers quantized and back)."""
        out = kv.astype(np.float64).copy()
        for layer in range(self.cfg.L):
            for j in (0, 1):
                st = self.storages[layer][j]
                if st in QUANT_DTYPES:
                    q = quantize_rows(kv[:, layer, j], st)
                    out[:, layer, j] = dequantize_rows(q, self.cfg.D, st)
        return out

    def want(self, toks) -> np.ndarray:
        return self.stored(np.stack([self.kv_of(tuple(toks[:i + 1]))
                                     for i in range(len(toks))]))

    def view(self, layer: int, kv: int) -> torch.Tensor:
        blocks = self.blocks()[0]
        if self.params.quantized:
            return layer_view(blocks, self.params, self.cfg.L, layer, kv)
        if self.linear:
            return blocks[layer, :, kv]
        return blocks[:, kv, layer]

    def read_back(self, s: int, n: int) -> np.ndarray:
        """``[n, L, 2, H, D]`` float64 K/V of the first ``n`` tokens of ``s`` in the cache."""
        P = self.cfg.P if self.cfg.strategy == "paged" else self.cfg.S
        out = np.zeros((n, self.cfg.L, 2, self.cfg.H, self.cfg.D))
        pos = np.arange(n)
        if self.cfg.strategy == "paged":
            pages = np.asarray(self.mgr.pages_of(s))[pos // P]
        else:
            pages = np.full(n, s)
        for layer in range(self.cfg.L):
            for kv in (0, 1):
                v = self.view(layer, kv)
                if self.linear:
                    rows = v[torch.tensor(pages), :, torch.tensor(pos % P)]
                else:
                    rows = v[torch.tensor(pages), torch.tensor(pos % P)]
                out[:, layer, kv] = cache_numpy(rows, self.cfg.D, self.storages[layer][kv])
        return out

    def check(self):
        """Every live sequence's length and K/V equal the shadow's."""
        if self.linear:
            assert self.mgr.active_batch_size == len(self.shadow)
            assert self.mgr.host_lengths.tolist()[:len(self.shadow)] == \
                [len(self.shadow[b]) for b in range(len(self.shadow))]
        else:
            assert set(range(self.cfg.MB)) - set(self.mgr.slots_remaining) == set(self.shadow)
            if self.cfg.strategy == "paged":
                self.mgr.check_invariants()
        for s, toks in self.shadow.items():
            if not self.linear:
                assert self.mgr.cache_length(s) == len(toks), (s, self.log[-3:])
            if toks:
                got, want = self.read_back(s, len(toks)), self.want(toks)
                self.counts["kv_checked"] = self.counts.get("kv_checked", 0) + got.size
                bad = ~np.isclose(got, want, rtol=0, atol=0)
                assert not bad.any(), (f"seq {s}: {int(bad.sum())} K/V values differ, first at"
                                       f" {np.argwhere(bad)[0].tolist()}", self.log[-3:])

    def memory(self):
        """Exact memory arithmetic of the manager as built."""
        c, p = self.cfg, self.params
        cls = type(self.mgr)
        kw = dict(num_pages=c.num_pages) if c.strategy == "paged" else {}
        est = cls.estimated_memory_size(p, c.MB, c.S, c.L, **kw)
        assert est == self.mgr.device_nbytes(), (est, self.mgr.device_nbytes())
        cache = self.blocks()[0]
        nbytes = cache.numel() * cache.element_size()
        assert nbytes == p.cache_bytes(c.L, c.MB, c.S, num_pages=getattr(self.mgr, "num_pages",
                                                                            None))
        per_tok = p.bytes_per_token(c.L)
        if c.strategy == "paged":
            assert nbytes == self.mgr.num_pages * p.bytes_per_page(c.L)
            assert p.bytes_per_page(c.L) == c.P * per_tok
        else:
            assert nbytes == c.MB * c.S * per_tok
        if not p.quantized:
            assert per_tok == 2 * c.L * c.H * c.D * p.itemsize
        # the batch size inferred for exactly the estimate of a batch fits in it, and is it
        full = cls.estimated_memory_size(p, c.MB, c.S, c.L)
        best = cls.infer_optimal_batch_size(p, c.S, c.L, full)
        assert best == c.MB, (best, c.MB)
        assert cls.estimated_memory_size(p, best + 1, c.S, c.L) > full
        assert cls.infer_optimal_batch_size(p, c.S, c.L, full - 1) == max(1, c.MB - 1)
        if c.strategy == "paged":  # a byte budget: the most pages that fit with the tables
            for budget in (est, est + p.bytes_per_page(c.L) - 1, 2 * est + 7):
                got = cls.estimated_memory_size(p, c.MB, c.S, c.L,
                                                available_cache_memory=budget)
                assert got <= budget < got + p.bytes_per_page(c.L), (budget, got)
                m = cls(p, c.MB, c.S, c.L, available_cache_memory=budget)
                assert m.device_nbytes() == got

    # -- the step: append + attention + compare --------------------------------------------
    def run_layers(self, inp, rows_kv, q_pos_of, keys_of, use_plan: bool):
        """Append ``rows_kv`` ``[T, L, 2, H, D]`` through ``inp`` and check attention."""
        c = self.cfg
        T = rows_kv.shape[0]
        dt = TORCH[c.dtype]
        qo = np.asarray(inp.qo_indptr_host)
        decode = bool(np.all(np.diff(qo) == 1))
        # sometimes a scale, a sliding window, or (prefill) no causal mask
        kw = {}
        if self.rng.random() < 0.3:
            kw["sm_scale"] = float(self.rng.choice([0.05, 0.7, 2.0]))
        if self.rng.random() < 0.3:
            kw["sliding_window"] = int(self.rng.choice([1, 2, 5, 64]))
        if not decode and "sliding_window" not in kw and self.rng.random() < 0.2:
            kw["causal"] = False
        plan = plan_step(inp, **kw) if use_plan else None
        coll = inp.collection()
        for layer in range(c.L):
            k = torch.tensor(rows_kv[:, layer, 0]).to(dt)
            v = torch.tensor(rows_kv[:, layer, 1]).to(dt)
            q = (torch.rand(T, c.H * c.G, c.D, generator=self.torch_gen) * 2 - 1).to(dt)
            if plan is not None:
                plan.append_kv(layer, k, v)
                out, _ = plan.attention(layer, q)
            else:
                kc, vc = coll.get_key_cache(layer).blocks, coll.get_value_cache(layer).blocks
                ops.append_kv(kc, vc, k, v, inp.qo_indptr, inp.cache_lengths, inp.lookup_table,
                              layout=inp.layout)
                if decode:  # the split count chosen, or one given (splits past the length)
                    splits = [None, None, 1, 2, 3, 7][int(self.rng.integers(0, 6))]
                    out, _ = ops.decode_attention(q, kc, vc, inp.cache_lengths,
                                                  inp.lookup_table, layout=inp.layout,
                                                  num_splits=splits, **kw)
                else:
                    out, _ = ops.prefill_attention(q, kc, vc, inp.qo_indptr, inp.cache_lengths,
                                                   inp.lookup_table, layout=inp.layout, **kw)
            qf = q.float().numpy().astype(np.float64)
            got = out.float().numpy()
            for b in range(len(qo) - 1):
                lo, hi = int(qo[b]), int(qo[b + 1])
                if hi == lo:
                    continue
                keys = keys_of(b)  # [n, L, 2, H, D] stored
                want = attention(qf[lo:hi], keys[:, layer, 0], keys[:, layer, 1], q_pos_of(b),
                                 kw.get("causal", True), kw.get("sm_scale"),
                                 kw.get("sliding_window"))
                err = np.abs(got[lo:hi] - want).max()
                self.counts["attn_checked"] = self.counts.get("attn_checked", 0) + want.size
                assert err <= TOL[c.dtype], (f"layer {layer} item {b} "
                                             f"{'decode' if decode else 'prefill'} "
                                             f"{'plan' if use_plan else 'ops'}: err {err}",
                                             self.log[-3:])

    # -- operations (paged / continuous) ---------------------------------------------------
    def live(self):
        return sorted(self.shadow)

    def state(self):
        """Manager state a refused call must leave as it was."""
        m = self.mgr
        if self.linear:
            return (m.active_batch_size, m.host_lengths.tolist())
        st = {s: m.cache_length(s) for s in self.live()}
        if self.cfg.strategy == "paged":  # (a disk tier's counters move in the background)
            st = (st, {s: m.pages_of(s) for s in self.live()},
                  dataclasses.replace(m.stats(), tiers={}))
        return st, sorted(m.slots_remaining)

    def new_tokens(self, s):
        r = self.rng
        if not self.shadow.get(s):
            f = int(r.integers(0, 3))  # three families: prompts share prefixes
            fam = [f * 1000 + i for i in range(self.cfg.S)]
            n = int(r.integers(1, (self.cfg.S if self.cfg.long else
                                   min(self.cfg.S, 3 * (self.cfg.P or 4))) + 1))
            if self.cfg.tiers:  # whole prompts again and again: hits from the lower tiers
                n = min(self.cfg.S - 1, 3 * self.cfg.P + 1)
            elif self.cfg.prefix and self.cfg.P < self.cfg.S and r.random() < 0.5:
                n = int(r.integers(self.cfg.P + 1, min(self.cfg.S, 3 * self.cfg.P) + 1))
            return fam[:n]
        return [int(t) for t in r.integers(0, 5, int(r.integers(1, 4)))]

    def op_claim(self):
        free = len(self.mgr.slots_remaining)
        if free == 0:
            before = self.state()
            try:
                self.mgr.claim(1)
            except KVCacheCapacityError:
                assert self.state() == before
                return
            raise AssertionError("claim past capacity")
        n = int(self.rng.integers(1, free + 1))
        for s in self.mgr.claim(n):
            assert s not in self.shadow
            self.shadow[s] = []
        self.log.append(f"claim {n}")

    def op_step(self):
        r, c = self.rng, self.cfg
        live = self.live()
        if not live:
            return self.op_claim()
        k = int(r.integers(1, len(live) + 1))
        chosen = [int(x) for x in r.choice(live, k, replace=False)]
        items = [(s, self.new_tokens(s)) for s in chosen]
        num_steps = int(r.choice([1, 1, 2, 3]))
        form = r.choice(["items", "arrays"])
        batch = ([BatchItem(s, t) for s, t in items] if form == "items" else
                 TokenBatch([s for s, _ in items], [x for _, t in items for x in t],
                            [len(t) for _, t in items]))
        before = self.state()
        self.log.append(f"fetch {items} num_steps={num_steps}")
        try:
            (inp,) = self.mgr.fetch(batch, num_steps=num_steps)
        except (KVCacheCapacityError, SequenceTooLongError):
            assert self.state() == before, "a refused fetch changed the manager"
            return
        prevs = [list(self.shadow[s]) for s, _ in items]
        hits = [int(h) for h in inp.num_cached_tokens]
        self.counts["prefix_hit_tokens"] = self.counts.get("prefix_hit_tokens", 0) + sum(hits)
        for b, ((s, t), prev) in enumerate(zip(items, prevs)):
            assert int(inp.cache_lengths_host[b]) == len(prev) + hits[b]
            assert hits[b] < len(t) or not t
            if c.strategy == "paged":
                assert hits[b] % c.P == 0
        rows = np.stack([self.kv_of(tuple(p + t[:i + 1]))
                         for (s, t), p, h in zip(items, prevs, hits) for i in range(h, len(t))])
        use_plan = bool(r.integers(0, 2))
        if r.random() < 0.3 or not self.counts.get("refused"):
            self.hostile_ops(inp, rows.shape[0])
        self.run_layers(inp, rows,
                        lambda b: len(prevs[b]) + hits[b] + np.arange(len(items[b][1]) - hits[b]),
                        lambda b: self.want(prevs[b] + items[b][1]), use_plan)
        cur = [inp]
        run_steps = int(r.integers(1, num_steps + 1))
        for _ in range(run_steps - 1):
            cur = self.mgr.increment_cache_lengths(cur)
            done = [p + t for p, (_, t) in zip(prevs, items)]
            assert cur[0].cache_lengths.tolist() == [len(x) for x in done]
            extra = [int(x) for x in r.integers(0, 5, len(items))]
            rows = np.stack([self.kv_of(tuple(d + [e])) for d, e in zip(done, extra)])
            self.run_layers(cur[0], rows, lambda b: np.array([len(done[b])]),
                            lambda b: self.want(done[b] + [extra[b]]), use_plan)
            items = [(s, t + [e]) for (s, t), e in zip(items, extra)]
        if r.random() < 0.2:  # tokens other than fetched: refused, nothing changes
            s0, t0 = items[0]
            before = self.state(), self.raw_bytes()
            with pytest.raises(SequenceStateError):
                self.mgr.step([BatchItem(s0, [x + 1 for x in t0])] + [BatchItem(*i)
                                                                    for i in items[1:]])
            assert (self.state(), self.raw_bytes()) == before
        self.mgr.step([BatchItem(s, t) for s, t in items])
        self.log.append(f"step {items}")
        if r.random() < 0.2:
            self.stale_is_refused(cur[0], rows.shape[0])
        for s, t in items:
            self.shadow[s] = self.shadow[s] + t

    def op_release(self):
        if not self.shadow:
            return
        s = int(self.rng.choice(self.live()))
        self.mgr.release(s)
        del self.shadow[s]
        self.log.append(f"release {s}")

    def op_pop(self):
        cand = [s for s in self.live() if self.shadow[s]]
        if not cand:
            return
        s = int(self.rng.choice(cand))
        n = int(self.rng.integers(0, len(self.shadow[s]) + 1))
        self.mgr.pop(s, n)
        self.shadow[s] = self.shadow[s][:len(self.shadow[s]) - n]
        self.log.append(f"pop {s} {n}")

    def op_fork(self):
        if not self.shadow or not self.mgr.slots_remaining:
            return
        s = int(self.rng.choice(self.live()))
        pages = self.mgr.pages_of(s)
        raw = self.blocks()[0].view(torch.uint8)
        saved = raw[torch.tensor(pages, dtype=torch.long)].clone() if pages else None
        new = self.mgr.fork(s)
        self.shadow[new] = list(self.shadow[s])
        self.log.append(f"fork {s} -> {new}")
        # the child writes first: the parent's pages keep every byte (copy on write)
        child_items = [(new, [int(self.rng.integers(0, 5))])]
        before = self.shadow[new]
        try:
            (inp,) = self.mgr.fetch([BatchItem(*child_items[0])])
        except (KVCacheCapacityError, SequenceTooLongError):
            return
        rows = np.stack([self.kv_of(tuple(before + child_items[0][1]))])
        self.run_layers(inp, rows, lambda b: np.array([len(before)]),
                        lambda b: self.want(before + child_items[0][1]), False)
        self.mgr.step([BatchItem(*child_items[0])])
        self.shadow[new] = before + child_items[0][1]
        if saved is not None:
            assert torch.equal(raw[torch.tensor(pages, dtype=torch.long)], saved), \
                "the child's write changed a page of its parent"

    def op_export_import(self):
        """Export a sequence's pages into a second manager of the same shape; it holds the
        same K/V."""
        cand = [s for s in self.live() if self.shadow[s]]
        if not cand:
            return
        s = int(self.rng.choice(cand))
        other = self.cfg.make()
        ex = self.mgr.export_pages(s)
        (t,) = other.claim(1)
        other.import_pages(ex.header, ex.data, seq_id=t)
        assert self.mgr.end_lease(ex.lease_id)
        assert other.cache_length(t) == len(self.shadow[s])
        mine, self.mgr = self.mgr, other
        try:
            got = self.read_back(t, len(self.shadow[s]))
        finally:
            self.mgr = mine
            if getattr(other, "offgrid_disk_dir", None):
                import shutil
                other.close_tiers()
                shutil.rmtree(other.offgrid_disk_dir, ignore_errors=True)
        assert np.array_equal(got, self.want(self.shadow[s])), "imported K/V differ"
        self.mgr.check_invariants()
        self.log.append(f"export/import {s}")

    # -- operations (linear) ---------------------------------------------------------------
    def op_lin_reset(self):
        n = int(self.rng.integers(0, self.cfg.MB + 1))
        self.mgr.reset_for_new_sequences([0] * n)
        self.gen = getattr(self, "gen", 0) + 1
        self.shadow = {b: [] for b in range(n)}
        self.log.append(f"reset {n}")

    def op_lin_step(self):
        n = len(self.shadow)
        if n == 0:
            return self.op_lin_reset()
        r = self.rng
        new = [int(x) for x in r.integers(0, 4, n)]
        if self.cfg.long and r.random() < 0.3:
            new = [int(x) for x in r.integers(0, self.cfg.S // 2 + 1, n)]
        elif r.integers(0, 2):
            new = [1] * n
        before = self.state()
        self.log.append(f"step_inputs {new}")
        try:
            (inp,) = self.mgr.step_inputs(new)
        except SequenceTooLongError:
            assert self.state() == before
            return
        prevs = [list(self.shadow[b]) for b in range(n)]
        toks = [[int(x) + 10 * getattr(self, "gen", 0) for x in r.integers(0, 5, k)]
                for k in new]
        rows = [self.kv_of(tuple(p + t[:i + 1])) for p, t in zip(prevs, toks)
                for i in range(len(t))]
        if rows and r.random() < 0.3:
            self.hostile_ops(inp, len(rows))
        if rows:
            self.run_layers(inp, np.stack(rows), lambda b: len(prevs[b]) + np.arange(new[b]),
                            lambda b: self.want(prevs[b] + toks[b]), bool(r.integers(0, 2)))
        self.log.append(f"commit {new}")
        if r.random() < 0.2:
            self.mgr.commit_sequence_length(0)  # kills the inputs, changes no length
            self.stale_is_refused(inp, len(rows))
        self.mgr.commit_sequence_length(torch.tensor(new, dtype=torch.int32)
                                        if r.integers(0, 2) or len(set(new)) > 1 else new[0])
        for b in range(n):
            self.shadow[b] = prevs[b] + toks[b]

    def op_lin_evict(self):
        n = len(self.shadow)
        keep = sorted(int(x) for x in self.rng.choice(n, int(self.rng.integers(0, n + 1)),
                                                       replace=False)) if n else []
        self.mgr.evict(keep)
        self.shadow = {j: self.shadow[b] for j, b in enumerate(keep)}
        self.log.append(f"evict keep {keep}")

    def op_lin_active(self):
        n = int(self.rng.integers(0, self.cfg.MB + 1))
        self.mgr.set_active_batch_size(n)
        self.shadow = {b: (self.shadow.get(b, []) if b < len(self.shadow) else [])
                       for b in range(n)}
        self.log.append(f"active {n}")

    # -- the run ----------------------------------------------------------------------------
    def run(self, n_ops: int):
        self.memory()
        if self.linear:
            table = [(self.op_lin_step, 5), (self.op_lin_reset, 1), (self.op_lin_evict, 1),
                     (self.op_lin_active, 1)]
        else:
            table = [(self.op_step, 5), (self.op_claim, 1),
                     (self.op_release, 3 if self.cfg.tiers else 2 if self.cfg.prefix else 1),
                     (self.op_pop, 1)]
            if self.cfg.strategy == "paged":
                table += [(self.op_fork, 1)]
            if self.cfg.prefix:  # export records the pages' tokens: prefix caching only
                table += [(self.op_export_import, 1)]
        ops_, w = zip(*table)
        w = np.array(w, float) / sum(w)
        try:
            for _ in range(n_ops):
                op = ops_[int(self.rng.choice(len(ops_), p=w))]
                n_log = len(self.log)
                op()
                if len(self.log) > n_log:
                    self.counts[op.__name__] = self.counts.get(op.__name__, 0) + 1
                self.check()
        finally:
            disk = getattr(self.mgr, "offgrid_disk_dir", None)
            if disk:
                import shutil
                self.mgr.close_tiers()
                shutil.rmtree(disk, ignore_errors=True)
        if self.cfg.tiers:
            self.counts["tier_hits"] = sum(t.get("hits", 0)
                                           for t in self.mgr.stats().tiers.values())
        return self.counts
