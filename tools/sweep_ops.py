"""Off-grid sweep of the public ops through the three managers, on the CPU.

Drives ``kvtvm.ops`` (append_kv, decode_attention, prefill_attention) and ``kvtvm.plan.plan_step``
through the paged (with prefix caching, fork and pop), continuous and linear managers with
shapes away from the test suite's grid -- head_dim, page_size, GQA ratio, n_kv_heads, ragged
batches, chunked prefill, long contexts, dtypes, 8-bit caches (K-only, V-only, skipped layers),
sm_scale -- and checks every attention output and LSE against a dense float64 numpy
attention over a *shadow* of each sequence: the K/V row of a token is a fixed function of
(layer, token id, position), so the shadow is just each sequence's token list and a manager bug
(a wrong page after fork, pop or a prefix hit) shows up as a wrong number, not only a kernel bug.

Usage::

    python tools/sweep_ops.py                 # small: 12 random cases + the fixed ones
    python tools/sweep_ops.py --cases 200     # full size
    python tools/sweep_ops.py --seed 3 --cases 50 --long   # + 5000-token contexts

Prints one line per case (PASS / FAIL with the reason) and exits 1 when any case failed.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtvm import KVCacheParams, ops
from kvtvm.errors import KVCacheError
from kvtvm.manager import (BatchItem, ContinuousBatchingKVCacheManager, LinearKVCache,
                           PagedKVCacheManager)
from kvtvm.params import torch_dtype
from kvtvm.plan import plan_step
from kvtvm.quant import dequantize_rows, quantize_rows

HEAD_DIMS = [32, 48, 64, 80, 96, 112, 128, 160, 256]
PAGE_SIZES = [1, 2, 3, 5, 7, 8, 16, 33, 64, 128, 256]
GROUPS = [1, 2, 3, 4, 5, 6, 7, 8, 16]
KV_HEADS = [1, 2, 3, 5, 8]
DTYPES = ["float32", "float16", "bfloat16"]
STORAGES = ["full", "int8", "float8_e4m3fn", "k_int8", "v_fp8", "int8_skip"]
STRATEGIES = ["paged", "continuous", "linear"]
TOL = {"float32": 2e-3, "float16": 2e-2, "bfloat16": 3e-2}
VOCAB = 97


@dataclass
class Case:
    strategy: str
    dtype: str
    storage: str
    n_kv_heads: int
    group: int
    head_dim: int
    page_size: int
    batch: int
    prompt_lens: list
    chunk: int            # chunked prefill: the prompt goes in pieces of at most this many
    decode_steps: int
    sm_scale: float | None
    use_plan: bool
    prefix: bool = False
    fork_pop: bool = False
    multistep: int = 0    # paged / continuous: a final fetch(num_steps=multistep)
    max_seq_len: int = 0
    num_layers: int = 2

    def label(self) -> str:
        return (f"{self.strategy} {self.dtype} {self.storage} H={self.n_kv_heads} G={self.group} "
                f"D={self.head_dim} ps={self.page_size} B={self.batch} "
                f"lens={self.prompt_lens[:6]}{'...' if len(self.prompt_lens) > 6 else ''} "
                f"chunk={self.chunk} dec={self.decode_steps} scale={self.sm_scale} "
                f"plan={self.use_plan} prefix={self.prefix} forkpop={self.fork_pop} "
                f"multistep={self.multistep}")


def make_params(c: Case) -> KVCacheParams:
    extra = {}
    if c.storage == "int8":
        extra = dict(cache_dtype="int8")
    elif c.storage == "float8_e4m3fn":
        extra = dict(cache_dtype="float8_e4m3fn")
    elif c.storage == "k_int8":
        extra = dict(k_cache_dtype="int8")
    elif c.storage == "v_fp8":
        extra = dict(v_cache_dtype="float8_e4m3fn")
    elif c.storage == "int8_skip":
        extra = dict(cache_dtype="int8", skip_layers=(0,))
    return KVCacheParams(c.dtype, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                         cache_strategy=c.strategy,
                         page_size=c.page_size if c.strategy == "paged" else None,
                         enable_prefix_caching=c.prefix, **extra)


class RowSource:
    """K/V rows as a fixed function of (layer, kv, token id, position), in the op dtype, and
    the same rows as the cache stores them (dequantized for an 8-bit layer), float64."""

    def __init__(self, c: Case, params: KVCacheParams, max_pos: int, rng):
        self.c, self.params = c, params
        H, D = c.n_kv_heads, c.head_dim
        shape = (c.num_layers, 2)
        self.tok = rng.standard_normal(shape + (VOCAB, H, D)).astype(np.float32)
        self.pos = (0.5 * rng.standard_normal(shape + (max_pos, H, D))).astype(np.float32)
        self.tdt = torch_dtype(c.dtype)

    def rows(self, layer, kv, tokens, positions) -> torch.Tensor:
        x = self.tok[layer, kv][np.asarray(tokens) % VOCAB] + self.pos[layer, kv][positions]
        return torch.from_numpy(x).to(self.tdt)

    def stored(self, layer, kv, tokens, positions) -> np.ndarray:
        x = self.rows(layer, kv, tokens, positions).float().numpy()
        storage = self.params.storage(layer, kv, self.c.num_layers)
        if storage in ("int8", "float8_e4m3fn"):
            x = dequantize_rows(quantize_rows(x, storage), self.c.head_dim)
        return x.astype(np.float64)


def dense_attention(q, K, V, clen, sm_scale):
    """q [n, Hq, D] (float64), K/V [L, H, D]: causal attention of the n new tokens at positions
    clen..clen+n-1. Returns out [n, Hq, D], lse [n, Hq]."""
    n, Hq, D = q.shape
    H = K.shape[1]
    G = Hq // H
    Kr, Vr = np.repeat(K, G, axis=1), np.repeat(V, G, axis=1)
    s = np.einsum("qhd,khd->hqk", q, Kr) * sm_scale
    mask = np.arange(K.shape[0])[None, :] <= (clen + np.arange(n))[:, None]
    s = np.where(mask[None], s, -np.inf)
    top = s.max(-1, keepdims=True)
    p = np.exp(s - top)
    tot = p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p / tot, Vr), (np.log(tot) + top)[..., 0].T


class Failure(Exception):
    pass


def compare(what, got_o, got_l, ref_o, ref_l, tol):
    o = got_o.float().numpy()
    lo = got_l.float().numpy()
    if not np.isfinite(o).all() or not np.isfinite(lo).all():
        raise Failure(f"{what}: non-finite output")
    err_o = np.abs(o - ref_o) - tol * np.abs(ref_o)
    err_l = np.abs(lo - ref_l) - tol * np.abs(ref_l)
    if err_o.max() > tol or err_l.max() > tol:
        bad = np.unravel_index(np.argmax(err_o), err_o.shape)
        raise Failure(f"{what}: max |out-ref| {np.abs(o - ref_o).max():.3g} at {bad}, "
                      f"max |lse-ref| {np.abs(lo - ref_l).max():.3g} (tol {tol})")


class Driver:
    """One case: a manager, its shadow (token lists) and the step loop."""

    def __init__(self, c: Case, rng):
        self.c, self.rng = c, rng
        self.params = make_params(c)
        c.max_seq_len = c.max_seq_len or (max(c.prompt_lens) + c.decode_steps + c.multistep
                                           + 8)
        self.src = RowSource(c, self.params, c.max_seq_len + 1, rng)
        self.scale = c.sm_scale if c.sm_scale is not None else 1.0 / math.sqrt(c.head_dim)
        self.tol = TOL[c.dtype] * (3 if self.params.quantized else 1)
        self.tokens: dict[int, list] = {}
        self.calls = 0
        if c.strategy == "linear":
            self.mgr = LinearKVCache(self.params, max_batch_size=c.batch,
                                     max_seq_len=c.max_seq_len, num_layers=c.num_layers)
        elif c.strategy == "continuous":
            self.mgr = ContinuousBatchingKVCacheManager(
                self.params, max_batch_size=c.batch + 1, max_seq_len=c.max_seq_len,
                num_layers=c.num_layers)
        else:
            self.mgr = PagedKVCacheManager(self.params, max_batch_size=c.batch + 2,
                                           max_seq_len=c.max_seq_len, num_layers=c.num_layers)

    # -- one step over layers ---------------------------------------------------------------
    def run_layers(self, inputs, seqs, new_tokens, starts):
        """Append + attention for every layer; ``new_tokens[b]`` the rows computed this step,
        starting at position ``starts[b]``; compare with the dense reference."""
        c = self.c
        n_rows = sum(len(t) for t in new_tokens)
        qo = np.concatenate([[0], np.cumsum([len(t) for t in new_tokens])]).astype(np.int64)
        decode = all(len(t) == 1 for t in new_tokens)
        plan = plan_step(inputs, sm_scale=c.sm_scale) if c.use_plan else None
        tdt = torch_dtype(c.dtype)
        for layer in range(c.num_layers):
            toks = np.concatenate([np.asarray(t, np.int64) for t in new_tokens]) \
                if n_rows else np.zeros(0, np.int64)
            pos = np.concatenate([np.arange(s, s + len(t)) for s, t in zip(starts, new_tokens)]) \
                if n_rows else np.zeros(0, np.int64)
            k = self.src.rows(layer, 0, toks, pos)
            v = self.src.rows(layer, 1, toks, pos)
            q = torch.from_numpy(self.rng.standard_normal(
                (n_rows, c.n_kv_heads * c.group, c.head_dim)).astype(np.float32)).to(tdt)
            kc, vc = inputs.k_cache(layer), inputs.v_cache(layer)
            if plan is not None:
                plan.append_kv(layer, k, v)
                out, lse = plan.attention(layer, q)
            else:
                ops.append_kv(kc, vc, k, v, inputs.qo_indptr, inputs.cache_lengths,
                              inputs.lookup_table, layout=inputs.layout)
                if decode:
                    out, lse = ops.decode_attention(q, kc, vc, inputs.cache_lengths,
                                                    inputs.lookup_table, layout=inputs.layout,
                                                    sm_scale=c.sm_scale)
                else:
                    out, lse = ops.prefill_attention(q, kc, vc, inputs.qo_indptr,
                                                     inputs.cache_lengths, inputs.lookup_table,
                                                     layout=inputs.layout, sm_scale=c.sm_scale)
            self.calls += 1
            qd = q.float().numpy().astype(np.float64)
            for b, seq in enumerate(seqs):
                a, e = int(qo[b]), int(qo[b + 1])
                if a == e:
                    continue
                full = self.tokens[seq] + list(new_tokens[b]) if starts[b] == len(self.tokens[seq]) \
                    else None
                if full is None:
                    raise Failure(f"internal: seq {seq} start {starts[b]} vs shadow "
                                  f"{len(self.tokens[seq])}")
                allpos = np.arange(len(full))
                K = self.src.stored(layer, 0, full, allpos)
                V = self.src.stored(layer, 1, full, allpos)
                ro, rl = dense_attention(qd[a:e], K, V, starts[b], self.scale)
                compare(f"layer {layer} seq {seq} ({'decode' if decode else 'prefill'}, "
                        f"cache {starts[b]} + {e - a})", out[a:e], lse[a:e], ro, rl, self.tol)

    # -- paged / continuous -----------------------------------------------------------------
    def manager_step(self, items, num_steps: int = 1):
        """items: list of (seq, tokens this step); with ``num_steps > 1`` a multistep fetch
        whose later steps add one random token per sequence through
        ``increment_cache_lengths``. Updates the shadow."""
        (inputs,) = self.mgr.fetch([BatchItem(s, t) for s, t in items], num_steps=num_steps)
        seqs, new, starts = [], [], []
        for b, (s, t) in enumerate(items):
            skip = int(inputs.num_cached_tokens[b]) if inputs.num_cached_tokens else 0
            seqs.append(s)
            new.append(list(t[skip:]))
            starts.append(len(self.tokens[s]) + skip)
            if skip:  # prefix hit: those tokens' K/V are already in the shared pages
                self.tokens[s] = self.tokens[s] + list(t[:skip])
        self.run_layers(inputs, seqs, new, starts)
        for b, s in enumerate(seqs):
            self.tokens[s] = self.tokens[s] + new[b]
        fed = [list(t) for _, t in items]
        for _ in range(num_steps - 1):
            inputs = self.mgr.increment_cache_lengths(inputs)
            more = [[int(self.rng.integers(0, VOCAB))] for _ in seqs]
            self.run_layers(inputs, seqs, more, [len(self.tokens[s]) for s in seqs])
            for b, s in enumerate(seqs):
                self.tokens[s] = self.tokens[s] + more[b]
                fed[b] += more[b]
        self.mgr.step([BatchItem(s, t) for s, t in zip(seqs, fed)])

    def run_managed(self):
        c, rng = self.c, self.rng
        seqs = self.mgr.claim(c.batch)
        prompts = {}
        shared = list(rng.integers(0, VOCAB, size=max(c.prompt_lens)))
        for s, n in zip(seqs, c.prompt_lens):
            self.tokens[s] = []
            # with prefix caching, prompts share a common head so later ones hit the cache
            prompts[s] = (shared[:n] if c.prefix and s % 2 == 0
                          else list(rng.integers(0, VOCAB, size=n)))
        done = {s: 0 for s in seqs}
        if c.prefix:  # the first sequence alone first, so the others can hit its pages
            first = seqs[0]
            while done[first] < len(prompts[first]):
                piece = prompts[first][done[first]:done[first] + c.chunk]
                self.manager_step([(first, piece)])
                done[first] += len(piece)
        while any(done[s] < len(prompts[s]) for s in seqs):
            items = []
            for s in seqs:
                if done[s] < len(prompts[s]):
                    piece = prompts[s][done[s]:done[s] + int(rng.integers(1, c.chunk + 1))]
                    items.append((s, piece))
                    done[s] += len(piece)
            self.manager_step(items)
        for _ in range(c.decode_steps):
            self.manager_step([(s, [int(rng.integers(0, VOCAB))]) for s in seqs])
        if c.multistep:
            self.manager_step([(s, [int(rng.integers(0, VOCAB))]) for s in seqs],
                              num_steps=c.multistep)
        if c.fork_pop and c.strategy == "paged":
            parent = seqs[-1]
            child = self.mgr.fork(parent)
            self.tokens[child] = list(self.tokens[parent])
            cut = min(len(self.tokens[child]), int(rng.integers(1, max(2, c.page_size + 2))))
            self.mgr.pop(child, cut)
            self.tokens[child] = self.tokens[child][:len(self.tokens[child]) - cut]
            odd = min(len(self.tokens[parent]) - 1, 3)
            if odd > 0:
                self.mgr.pop(parent, odd)
                self.tokens[parent] = self.tokens[parent][:-odd]
            for _ in range(3):
                self.manager_step([(s, [int(rng.integers(0, VOCAB))]) for s in (parent, child)])
            # a 2-token speculative step on the child, rolled back by one
            self.manager_step([(child, list(rng.integers(0, VOCAB, size=2)))])
            self.mgr.pop(child, 1)
            self.tokens[child] = self.tokens[child][:-1]
            self.manager_step([(child, [int(rng.integers(0, VOCAB))])])
        for s in list(self.tokens):
            self.mgr.release(s)

    # -- linear -----------------------------------------------------------------------------
    def run_linear(self):
        c, rng = self.c, self.rng
        lin = self.mgr
        lin.reset_for_new_sequences([0] * c.batch)
        seqs = list(range(c.batch))
        prompts = {s: list(rng.integers(0, VOCAB, size=n)) for s, n in zip(seqs, c.prompt_lens)}
        self.tokens = {s: [] for s in seqs}
        while any(len(self.tokens[s]) < len(prompts[s]) for s in seqs):
            new = []
            for s in seqs:
                have = len(self.tokens[s])
                take = min(len(prompts[s]) - have, int(rng.integers(0, c.chunk + 1)))
                new.append(prompts[s][have:have + take])
            (inputs,) = lin.step_inputs([len(t) for t in new])
            starts = [len(self.tokens[s]) for s in seqs]
            if sum(map(len, new)):
                self.run_layers(inputs, seqs, new, starts)
            lin.commit_sequence_length(np.array([len(t) for t in new], np.int32))
            for s, t in zip(seqs, new):
                self.tokens[s] += t
        for _ in range(c.decode_steps):
            new = [[int(rng.integers(0, VOCAB))] for _ in seqs]
            (inputs,) = lin.step_inputs(1)
            self.run_layers(inputs, seqs, new, [len(self.tokens[s]) for s in seqs])
            lin.commit_sequence_length(1)
            for s, t in zip(seqs, new):
                self.tokens[s] += t

    def run(self):
        if self.c.strategy == "linear":
            self.run_linear()
        else:
            self.run_managed()


def boundary_lengths(rng, batch, page_size, chunk_max=300):
    """Ragged prompt lengths: 1 token, exact page multiples, one past, random."""
    picks = [1, page_size, page_size + 1, 2 * page_size, 2 * page_size - 1]
    out = []
    for i in range(batch):
        if i < len(picks) and rng.random() < 0.7:
            out.append(max(1, picks[i]))
        else:
            out.append(int(rng.integers(1, chunk_max + 1)))
    return out


def random_case(rng, i) -> Case:
    """Case i: every axis value appears round-robin, the rest random."""
    pick = lambda xs: xs[i % len(xs)] if rng.random() < 0.6 else xs[int(rng.integers(len(xs)))]
    strategy = STRATEGIES[i % 3]
    D = pick(HEAD_DIMS)
    H = pick(KV_HEADS)
    G = pick(GROUPS)
    while H * G > 40:  # keep the numpy reference quick
        G = max(1, G // 2)
    ps = pick(PAGE_SIZES)
    batch = int(rng.choice([1, 2, 3, 5, 8, 13, 33])) if rng.random() < 0.7 else int(
        rng.integers(1, 34))
    heavy = batch * D * H * G
    cap = 300 if heavy < 20000 else 120
    lens = boundary_lengths(rng, batch, ps, cap)
    return Case(strategy=strategy, dtype=pick(DTYPES), storage=pick(STORAGES), n_kv_heads=H,
                group=G, head_dim=D, page_size=ps, batch=batch, prompt_lens=lens,
                chunk=int(rng.choice([1, 7, 64, 300])), decode_steps=int(rng.integers(1, 4)),
                sm_scale=None if rng.random() < 0.6 else float(rng.choice([0.05, 0.3, 1.0])),
                use_plan=bool(rng.random() < 0.5),
                prefix=strategy == "paged" and rng.random() < 0.4,
                fork_pop=strategy == "paged" and rng.random() < 0.7,
                multistep=int(rng.choice([0, 2, 3])) if strategy != "linear" else 0)


def fixed_cases(long: bool) -> list[Case]:
    cases = [
        # single-token prompts and one decode, every page boundary, odd GQA
        Case("paged", "float32", "full", 3, 5, 48, 7, 5, [1, 7, 8, 14, 15], 300, 2, None, False,
             fork_pop=True),
        Case("paged", "bfloat16", "int8", 5, 3, 80, 3, 4, [1, 3, 4, 6], 2, 2, 0.3, True,
             fork_pop=True, prefix=True, multistep=3),
        Case("continuous", "float16", "float8_e4m3fn", 1, 7, 112, 0, 3, [1, 33, 2], 300, 2,
             None, False),
        Case("linear", "float32", "k_int8", 2, 6, 160, 0, 4, [1, 30, 5, 17], 9, 2, None, True),
    ]
    if long:
        for strat in STRATEGIES:
            cases.append(Case(strat, "float16", "full", 1, 4, 64, 128, 2, [4999, 2500], 2600,
                              2, None, False))
    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=12, help="random cases (full size: 200)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long", action="store_true", help="also 5000-token contexts")
    ap.add_argument("--only", type=int, default=None, help="run random case number N only")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    cases = [] if args.only is not None else fixed_cases(args.long)
    randoms = [random_case(rng, i) for i in range(args.cases)]
    if args.only is not None:
        randoms = [randoms[args.only]]
    cases += randoms
    failed = 0
    t0 = time.time()
    for i, c in enumerate(cases):
        t = time.time()
        drv = None
        try:
            drv = Driver(c, np.random.default_rng([args.seed, i]))
            drv.run()
            status = "PASS"
        except Failure as err:
            status, failed = f"FAIL {err}", failed + 1
        except KVCacheError as err:
            status, failed = f"FAIL typed {type(err).__name__}: {err}", failed + 1
        except Exception as err:  # a crash, not a typed error
            tb = traceback.format_exc().strip().splitlines()[-3:]
            status, failed = f"FAIL crash {type(err).__name__}: {err} | {' / '.join(tb)}", \
                failed + 1
        calls = drv.calls if drv else 0
        print(f"[{i:3d}] {time.time() - t:6.1f}s {calls:4d} calls {status[:400]}\n      "
              f"{c.label()}", flush=True)
    print(f"{len(cases) - failed}/{len(cases)} passed in {time.time() - t0:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
