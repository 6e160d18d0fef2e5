"""Stateful property test: random claim / fetch / write / step / fork / pop / release sequences
against a dense shadow model, with real K/V written by the append kernel (llvm).

After every rule: no page leaked or owned twice, refcounts equal owners
(``check_invariants``), the claimed set and every length match the shadow, and the K/V read
back through each sequence's pages equal what the shadow says was written. The K/V of a
token are a function of the whole token prefix up to it (as in a real model), so a prefix
cache hit must serve exactly the values the sequence would have computed.

Among the rules: inputs of a superseded fetch (a later fetch, their step, a release) given to
the append op raise ``StaleInputsError`` and leave the cache bytes as they were, and a ``step``
whose tokens differ from the fetched ones raises and changes nothing.

Size: ``make test`` runs a few thousand operations (seconds). ``KVTVM_SOAK_OPS=N`` runs about N
operations (rules) in all instead -- 60% on the paged manager with prefix caching, 20% each on
two devices and on the continuous manager, 100 per example -- e.g. the nightly soak
``KVTVM_SOAK_OPS=1000000 make soak`` (hours on the 2-core CPU; see docs/testing.md).
"""

import math
import os

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtvm import KVCacheParams, ops
from kvtvm.errors import (KVCacheCapacityError, SequenceStateError, SequenceTooLongError,
                          StaleInputsError, UnknownSequenceError)
from kvtvm.inputs import BatchItem, TokenBatch
from kvtvm.manager import ContinuousBatchingKVCacheManager, PagedKVCacheManager
from kvtvm.manager.hashing import block_hashes

H, D, L, P = 2, 8, 2, 4
MB, MAX_LEN, PAGES = 5, 24, 14
FAMILIES = [list(range(100, 113)), list(range(200, 209)), [7] * 12]

SETTINGS = settings(max_examples=40, stateful_step_count=30, deadline=None,
                    suppress_health_check=list(HealthCheck))
#: Operations of the nightly soak (0: the ``make test`` sizes above).
SOAK_OPS = int(os.environ.get("KVTVM_SOAK_OPS", "0") or 0)
SOAK_STEPS = 100


def sized(share: float, small: settings) -> settings:
    """``small`` in ``make test``; under ``KVTVM_SOAK_OPS``, ``share`` of the soak's
    operations in examples of ``SOAK_STEPS`` rules."""
    if not SOAK_OPS:
        return small
    return settings(small, max_examples=max(1, math.ceil(share * SOAK_OPS / SOAK_STEPS)),
                    stateful_step_count=SOAK_STEPS, database=None)

_kv_memo = {}


def kv_of(prefix):
    """[L, 2, H, D] K/V of the last token of ``prefix`` (a tuple)."""
    v = _kv_memo.get(prefix)
    if v is None:
        rng = np.random.default_rng(abs(hash(prefix)) % (2 ** 32))
        v = _kv_memo[prefix] = rng.standard_normal((L, 2, H, D)).astype(np.float32)
    return v


def as_batch(pairs, form):
    """``[(seq_id, tokens)]`` as a list of BatchItem or as a TokenBatch."""
    if form == "arrays":
        return TokenBatch([s for s, _ in pairs], [t for _, ts in pairs for t in ts],
                          [len(ts) for _, ts in pairs])
    return [BatchItem(s, t) for s, t in pairs]


class ManagerMachine(RuleBasedStateMachine):
    """Rules shared by every manager; subclasses make the manager."""

    def make(self):
        raise NotImplementedError

    def __init__(self):
        super().__init__()
        _kv_memo.clear()  # a pure function of the prefix: bounded memory over a long soak
        self.mgr = self.make()
        for b in self.mgr.blocks:
            b.copy_(torch.randn(b.shape))
        self.shadow = {}  # seq_id -> committed tokens

    # -- helpers ------------------------------------------------------------------------------
    def live(self):
        return sorted(self.shadow)

    def snapshot(self):
        state = {s: (self.mgr.cache_length(s), self.pages(s)) for s in self.live()}
        return state, sorted(self.mgr.slots_remaining), self.stats()

    def pages(self, s):
        return None

    def stats(self):
        return None

    def write(self, per_dev, batch_tokens, prevs):
        """append_kv the new rows of every item (skipping prefix hits) on every device."""
        inp = per_dev[0]
        rows = []
        for b, ((s, toks), prev) in enumerate(zip(batch_tokens, prevs)):
            full = prev + toks
            for i in range(inp.num_cached_tokens[b], len(toks)):
                rows.append(kv_of(tuple(full[:len(prev) + i + 1])))
        kv = np.stack(rows, axis=2)  # [L, 2, T, H, D]
        n_dev = len(per_dev)
        for dev, di in enumerate(per_dev):
            c = di.collection()
            hs = slice(dev * H // n_dev, (dev + 1) * H // n_dev)
            for layer in range(L):
                ops.append_kv(c.get_key_cache(layer).blocks, c.get_value_cache(layer).blocks,
                              torch.tensor(kv[layer, 0][:, hs]),
                              torch.tensor(kv[layer, 1][:, hs]),
                              di.qo_indptr, di.cache_lengths, di.lookup_table)

    def read_back(self, s, n):
        """[L, 2, n, H, D] K/V of the first n tokens of s, from the cache."""
        raise NotImplementedError

    # -- rules --------------------------------------------------------------------------------
    @initialize(n=st.integers(1, 3))
    def start(self, n):
        for s in self.mgr.claim(n):
            self.shadow[s] = []

    @rule()
    def claim(self):
        if not self.mgr.slots_remaining:
            before = self.snapshot()
            try:
                self.mgr.claim(1)
            except KVCacheCapacityError:
                assert self.snapshot() == before
                return
            raise AssertionError("claim past capacity did not raise")
        (s,) = self.mgr.claim(1)
        assert s not in self.shadow
        self.shadow[s] = []

    @rule(data=st.data(), num_steps=st.sampled_from([1, 1, 2, 3]),
          run_steps=st.integers(1, 3), forms=st.sampled_from(["items", "arrays"]) | st.just(
              "mixed"))
    def fetch_write_step(self, data, num_steps, run_steps, forms):
        fetch_form = "arrays" if forms == "mixed" else forms  # mixed: arrays, then items
        live = self.live()
        if not live:
            return
        chosen = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3, unique=True))
        batch_tokens = []
        for s in chosen:
            if not self.shadow[s]:  # a prompt, often sharing a prefix with another
                fam = data.draw(st.sampled_from(FAMILIES))
                cut = data.draw(st.integers(1, len(fam)))
                extra = data.draw(st.lists(st.integers(0, 3), max_size=3))
                toks = fam[:cut] + extra
            else:
                toks = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=3))
            batch_tokens.append((s, toks))
        prevs = [list(self.shadow[s]) for s, _ in batch_tokens]
        batch = as_batch(batch_tokens, fetch_form)
        before = self.snapshot()
        try:
            per_dev = self.mgr.fetch(batch, num_steps=num_steps)
        except (KVCacheCapacityError, SequenceTooLongError):
            assert self.snapshot() == before, "a failed fetch changed the manager"
            return
        inp = per_dev[0]
        assert inp.seq_ids == tuple(chosen)
        for b, (s, toks) in enumerate(batch_tokens):
            hit = inp.num_cached_tokens[b]
            assert hit % self.page_size() == 0 and hit < len(toks) + len(prevs[b])
            assert hit == 0 or not prevs[b]
            assert inp.cache_lengths_host[b] == len(prevs[b]) + hit
            if self.pages(s) is not None:
                pages = self.pages(s)
                assert inp.lookup_table[b, :len(pages)].tolist() == pages
        assert inp.cache_lengths.tolist() == inp.cache_lengths_host.tolist()
        assert inp.max_lengths.shape == (num_steps, 2)
        self.write(per_dev, batch_tokens, prevs)
        # later steps of a multistep run: one token per sequence each
        run_steps = min(run_steps, num_steps)
        cur = per_dev
        for _ in range(run_steps - 1):
            cur = self.mgr.increment_cache_lengths(cur)
            extra = [(s, [data.draw(st.integers(0, 3))]) for s, _ in batch_tokens]
            done = [p + t for p, (_, t) in zip(prevs, batch_tokens)]
            assert cur[0].cache_lengths.tolist() == [len(x) for x in done]
            self.write(cur, extra, done)
            batch_tokens = [(s, t + e) for (s, t), (_, e) in zip(batch_tokens, extra)]
        self.mgr.step(as_batch(batch_tokens, "items" if forms == "mixed" else forms))
        for s, t in batch_tokens:
            self.shadow[s] = self.shadow[s] + t

    @rule(data=st.data())
    def fetch_then_release(self, data):
        if not self.shadow:
            return
        s = data.draw(st.sampled_from(self.live()))
        try:
            self.mgr.fetch([BatchItem(s, [1])])
        except (KVCacheCapacityError, SequenceTooLongError):
            pass
        self.mgr.release(s)
        del self.shadow[s]

    @rule(data=st.data())
    def release(self, data):
        if not self.shadow:
            return
        s = data.draw(st.sampled_from(self.live()))
        self.mgr.release(s)
        del self.shadow[s]
        before = self.snapshot()
        try:
            self.mgr.release(s)
        except UnknownSequenceError:
            assert self.snapshot() == before
            return
        raise AssertionError("double release did not raise")

    @rule(data=st.data(), supersede=st.sampled_from(["fetch", "step", "release"]))
    def stale_inputs_are_refused(self, data, supersede):
        """Inputs outlive their fetch only as refusals: the append op given them raises
        StaleInputsError and writes nothing."""
        live = self.live()
        if not live:
            return
        s = data.draw(st.sampled_from(live))
        toks = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=2))
        prev = list(self.shadow[s])
        try:
            old = self.mgr.fetch([BatchItem(s, toks)])
        except (KVCacheCapacityError, SequenceTooLongError):
            return
        if supersede == "fetch":
            others = [o for o in live if o != s]
            if not others:
                supersede = "release"
            else:
                o = data.draw(st.sampled_from(others))
                try:
                    nxt = self.mgr.fetch([BatchItem(o, [1])])
                except (KVCacheCapacityError, SequenceTooLongError):
                    supersede = "release"
                else:
                    self.write(nxt, [(o, [1])], [list(self.shadow[o])])
                    self.mgr.step([BatchItem(o, [1])])
                    self.shadow[o] = self.shadow[o] + [1]
                    self.mgr.release(s)   # its fetch can no longer be written: drop it
                    del self.shadow[s]
        if supersede == "step":
            self.write(old, [(s, toks)], [prev])
            self.mgr.step([BatchItem(s, toks)])
            self.shadow[s] = prev + toks
        elif supersede == "release":
            self.mgr.release(s)
            self.shadow.pop(s, None)
        saved = [b.clone() for b in self.mgr.blocks]
        try:
            self.write(old, [(s, toks)], [prev])
        except StaleInputsError:
            pass
        else:
            raise AssertionError(f"inputs superseded by {supersede} were accepted")
        assert all(torch.equal(b, w) for b, w in zip(self.mgr.blocks, saved))
        assert not old[0].token.live

    @rule(data=st.data())
    def step_with_other_tokens_is_refused(self, data):
        """step refuses tokens other than fetched (so the prefix cache never learns K/V it
        does not hold) and changes nothing; the right tokens still commit."""
        live = self.live()
        if not live:
            return
        s = data.draw(st.sampled_from(live))
        toks = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=3))
        prev = list(self.shadow[s])
        try:
            per_dev = self.mgr.fetch([BatchItem(s, toks)])
        except (KVCacheCapacityError, SequenceTooLongError):
            return
        self.write(per_dev, [(s, toks)], [prev])
        i = data.draw(st.integers(0, len(toks) - 1))
        wrong = list(toks)
        wrong[i] += data.draw(st.integers(1, 5))
        form = data.draw(st.sampled_from(["items", "arrays"]))
        before = self.snapshot()
        try:
            self.mgr.step(as_batch([(s, wrong)], form))
        except SequenceStateError:
            assert self.snapshot() == before, "a refused step changed the manager"
        else:
            raise AssertionError("step with other tokens than fetched was accepted")
        per_dev[0].check_live()  # the refused step did not end the fetch
        self.mgr.step(as_batch([(s, toks)], form))
        self.shadow[s] = prev + toks

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def matches_shadow(self):
        self.check_structure()
        assert set(range(MB)) - self.mgr.slots_remaining == set(self.shadow)
        for s, toks in self.shadow.items():
            assert self.mgr.cache_length(s) == len(toks)
            if toks:
                want = np.stack([kv_of(tuple(toks[:t + 1])) for t in range(len(toks))], 2)
                assert np.array_equal(self.read_back(s, len(toks)), want), s

    def check_structure(self):
        pass

    def page_size(self):
        return 1

    @rule(data=st.data())
    def pop(self, data):            # paged and continuous: roll back committed tokens
        if not any(self.shadow.values()):
            return
        s = data.draw(st.sampled_from([s for s in self.live() if self.shadow[s]]))
        n_len = len(self.shadow[s])
        before = self.snapshot()
        try:
            self.mgr.pop(s, n_len + 1)  # past zero
        except ValueError:
            assert self.snapshot() == before
        else:
            raise AssertionError("pop past zero did not raise")
        n = data.draw(st.integers(0, n_len))
        self.mgr.pop(s, n)
        self.shadow[s] = self.shadow[s][:n_len - n]


class PagedMachine(ManagerMachine):
    prefix = True
    devices = ("cpu",)

    def make(self):
        return PagedKVCacheManager(
            KVCacheParams("float32", H, D, "paged", page_size=P,
                          enable_prefix_caching=self.prefix),
            MB, MAX_LEN, L, self.devices, num_pages=PAGES)

    def pages(self, s):
        return self.mgr.pages_of(s)

    def stats(self):
        st_ = self.mgr.stats()
        return (st_.pages_used, st_.pages_free, st_.pages_cached, st_.pages_shared)

    def page_size(self):
        return P

    def check_structure(self):
        self.mgr.check_invariants()
        st_ = self.mgr.stats()
        assert st_.pages_free + st_.pages_used + st_.pages_cached + st_.pages_leased \
            == st_.pages_total
        for s, toks in self.shadow.items():
            assert len(self.mgr.pages_of(s)) >= -(-len(toks) // P)
        # a leased page is never rewritten: its bytes are those it had when leased
        for pages, saved in getattr(self, "leases", {}).values():
            for blocks, want in zip(self.mgr.blocks, saved):
                assert torch.equal(blocks[pages], want)

    @invariant()
    def hashes_find_what_tokens_find(self):
        """The peer-facing lookup by chained hashes (an index kept up to date as pages are
        cached and evicted) answers what the prefix cache's token lookup answers."""
        mgr = self.mgr
        if not self.prefix:
            return
        probes = [toks for toks in self.shadow.values() if toks] + FAMILIES
        for toks in probes:
            full = len(toks) // P
            chunks = [np.asarray(toks[i * P:(i + 1) * P], np.int64).tobytes()
                      for i in range(full)]
            pages, _ = mgr._prefix.lookup(chunks)
            hashes = block_hashes(toks, P, mgr.hash_bits, mgr._root_chain()[0])
            assert mgr.held_prefix_pages(hashes) == len(pages)

    @rule(data=st.data())
    def export_by_hashes(self, data):
        """Export the cached chain of a prompt named by its hashes: the pages its tokens
        find (a lease the lease rules end)."""
        mgr = self.mgr
        if not self.prefix:
            return
        toks = data.draw(st.sampled_from([t for t in self.shadow.values() if t] + FAMILIES))
        hashes = block_hashes(toks, P, mgr.hash_bits, mgr._root_chain()[0])
        n = mgr.held_prefix_pages(hashes)
        if not n:
            return
        ex = mgr.export_pages(block_hashes=hashes[:n])
        chunks = [np.asarray(toks[i * P:(i + 1) * P], np.int64).tobytes() for i in range(n)]
        assert ex.pages == mgr._prefix.lookup(chunks)[0]
        self.leases = getattr(self, "leases", {})
        self.leases[ex.lease_id] = (ex.pages, [b[ex.pages].clone() for b in mgr.blocks])

    # -- leases (export / import): issue 17 -------------------------------------------------
    @rule(data=st.data())
    def export_lease(self, data):
        live = [s for s in self.live() if self.shadow[s]]
        if not self.prefix or not live:
            return
        s = data.draw(st.sampled_from(live))
        ex = self.mgr.export_pages(s, timeout=data.draw(st.sampled_from([None, 1.0])))
        pages = self.mgr.pages_of(s)[:-(-len(self.shadow[s]) // P)]
        self.leases = getattr(self, "leases", {})
        self.leases[ex.lease_id] = (pages, [b[pages].clone() for b in self.mgr.blocks])

    @rule(data=st.data(), twice=st.booleans())
    def end_lease(self, data, twice):
        if not getattr(self, "leases", None):
            return
        lid = data.draw(st.sampled_from(sorted(self.leases)))
        assert self.mgr.end_lease(lid)
        del self.leases[lid]
        if twice:
            assert not self.mgr.end_lease(lid)

    @rule()
    def expire_leases(self):
        if not getattr(self, "leases", None):
            return
        for lid in self.mgr.expire_leases(now=float("inf")):
            del self.leases[lid]

    @rule(data=st.data())
    def copy_via_import(self, data):
        """Export a sequence and import it into a fresh one of the same cache (the full pages
        are found by their tokens, only the partial one is written)."""
        live = [s for s in self.live() if self.shadow[s]]
        if not self.prefix or not live or not self.mgr.slots_remaining:
            return
        s = data.draw(st.sampled_from(live))
        ex = self.mgr.export_pages(s)
        (t,) = self.mgr.claim(1)
        before = self.snapshot()
        try:
            self.mgr.import_pages(ex.header, ex.data, seq_id=t)
        except KVCacheCapacityError:
            assert self.snapshot() == before
            self.mgr.release(t)
        else:
            self.shadow[t] = list(self.shadow[s])
        assert self.mgr.end_lease(ex.lease_id)

    def read_back(self, s, n):
        pages = self.mgr.pages_of(s)
        parts = []
        for blocks in self.mgr.blocks:
            x = blocks[pages].numpy()  # [npages, 2, L, P, h, D]
            x = x.transpose(2, 1, 0, 3, 4, 5).reshape(L, 2, len(pages) * P, -1, D)
            parts.append(x[:, :, :n])
        return np.concatenate(parts, axis=3)

    @rule(data=st.data())
    def fork(self, data):
        if not self.shadow:
            return
        s = data.draw(st.sampled_from(self.live()))
        if not self.mgr.slots_remaining:
            before = self.snapshot()
            try:
                self.mgr.fork(s)
            except KVCacheCapacityError:
                assert self.snapshot() == before
                return
            raise AssertionError("fork without a free slot did not raise")
        new = self.mgr.fork(s)
        assert new not in self.shadow
        self.shadow[new] = list(self.shadow[s])
        k = -(-len(self.shadow[s]) // P)
        assert self.mgr.pages_of(new) == self.mgr.pages_of(s)[:k]


class PagedNoPrefixTwoDevices(PagedMachine):
    prefix = False
    devices = ("cpu", "cpu")


class ContinuousMachine(ManagerMachine):
    def make(self):
        return ContinuousBatchingKVCacheManager(
            KVCacheParams("float32", H, D, "continuous"), MB, MAX_LEN, L)

    def read_back(self, s, n):
        x = self.mgr.blocks[0][s].numpy()  # [2, L, S, H, D]
        return x.transpose(1, 0, 2, 3, 4)[:, :, :n]


TestPagedPrefixCaching = PagedMachine.TestCase
TestPagedPrefixCaching.settings = sized(0.6, SETTINGS)
TestPagedTwoDevices = PagedNoPrefixTwoDevices.TestCase
TestPagedTwoDevices.settings = sized(0.2, settings(SETTINGS, max_examples=12))
TestContinuous = ContinuousMachine.TestCase
TestContinuous.settings = sized(0.2, settings(SETTINGS, max_examples=12))
