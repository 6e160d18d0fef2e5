"""Stateful test of transfers between two paged managers over a fake transport that delays,
reorders, drops and duplicates messages and completions (issue 17).

A prefill cache exports sequences (the wire reads the exported view only when the message is
delivered: zero copy, protected by the lease); a decode cache begins the import on the header,
finishes it when the data arrives, and acknowledges. Messages sit in flight until a rule
delivers one (any one: reordering), drops one, or delivers it and keeps it (duplicate); leases
of lost messages end by timeout. After every rule: both caches' invariants, ``free + used +
cached + leased == total``, the leased pages of the prefill cache are unchanged, and every
sequence the decode cache holds reads back the K/V its tokens define.
"""

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtvm import KVCacheParams
from kvtvm.errors import CorruptTransferError, KVCacheCapacityError, SequenceStateError
from kvtvm.manager import BatchItem, PagedKVCacheManager

H, D, L, P = 2, 4, 2, 4
FAMILIES = [list(range(10, 23)), list(range(30, 39)), [7] * 11]
_memo = {}


def kv_of(prefix):
    """[2, L, H, D] K/V of the last token of ``prefix`` (a tuple): a function of the prefix."""
    v = _memo.get(prefix)
    if v is None:
        rng = np.random.default_rng(abs(hash(prefix)) % (2 ** 32))
        v = _memo[prefix] = torch.from_numpy(rng.standard_normal((2, L, H, D)).astype(np.float32))
    return v


def make(pages, devices=("cpu",)):
    return PagedKVCacheManager(
        KVCacheParams("float32", H, D, "paged", page_size=P, enable_prefix_caching=True),
        4, 24, L, devices, num_pages=pages)


def read_back(mgr, s, n):
    pages = mgr.pages_of(s)
    full = torch.cat([b[pages] for b in mgr.blocks], dim=4)  # [n_pages, 2, L, P, H, D]
    return [full[t // P, :, :, t % P] for t in range(n)]


def on_the_wire(ex, first_row):
    """What a wire reading the export now carries: the cache pages themselves (zero copy)."""
    runs = [v for _, v in ex.page_runs(first_row)]
    if not runs:
        return torch.empty((0, *ex.header.page_shape))
    return torch.cat(runs).clone()


def conserved(mgr):
    mgr.check_invariants()
    st_ = mgr.stats()
    assert st_.pages_free + st_.pages_used + st_.pages_cached + st_.pages_leased \
        == st_.pages_total


class TransferMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.a, self.b = make(12), make(10, ("cpu", "cpu"))
        for blk in self.a.blocks + self.b.blocks:
            blk.copy_(torch.randn(blk.shape))
        self.a_seqs = {}     # prefill seq -> tokens
        self.b_seqs = {}     # decode seq -> tokens (import finished)
        self.b_pending = {}  # decode seq -> import lease (header arrived, data not yet)
        self.wire = []       # messages in flight: (kind, payload)
        self.exports = {}    # prefill lease -> (export, its data as exported)

    # -- prefill side -----------------------------------------------------------------------
    @rule(data=st.data())
    def prefill(self, data):
        if not self.a.slots_remaining:
            return
        fam = data.draw(st.sampled_from(FAMILIES))
        toks = fam[:data.draw(st.integers(2, len(fam)))] + data.draw(
            st.lists(st.integers(0, 3), max_size=2))
        (s,) = self.a.claim(1)
        try:
            (inp,) = self.a.fetch([BatchItem(s, toks)])
        except KVCacheCapacityError:
            self.a.release(s)
            return
        pages = self.a.pages_of(s)
        for t in range(inp.num_cached_tokens[0], len(toks)):
            self.a.blocks[0][pages[t // P], :, :, t % P] = kv_of(tuple(toks[:t + 1]))
        self.a.step([BatchItem(s, toks)])
        self.a_seqs[s] = toks

    @rule(data=st.data(), release_after=st.booleans())
    def send(self, data, release_after):
        if not self.a_seqs:
            return
        s = data.draw(st.sampled_from(sorted(self.a_seqs)))
        ex = self.a.export_pages(s, timeout=1.0)
        self.exports[ex.lease_id] = (ex, on_the_wire(ex, 0))
        self.wire.append(("header", ex))
        if release_after:  # the prefill side is done with it while the pages are in flight
            self.a.release(s)
            del self.a_seqs[s]

    # -- the wire ---------------------------------------------------------------------------
    @rule(data=st.data(), duplicate=st.booleans())
    def deliver(self, data, duplicate, index=None):
        if not self.wire:
            return
        i = data.draw(st.integers(0, len(self.wire) - 1)) if index is None else index
        kind, msg = self.wire[i] if duplicate else self.wire.pop(i)
        if kind == "header":
            ex = msg
            if not self.b.slots_remaining:
                self.wire.append(("ack", (ex.lease_id, False)))
                return
            (t,) = self.b.claim(1)
            try:
                lid, first_row = self.b.begin_import(ex.header, t, timeout=1.0)
            except KVCacheCapacityError:
                self.b.release(t)
                self.wire.append(("ack", (ex.lease_id, False)))
                return
            self.b_pending[t] = lid
            # the data travels later: the wire reads the exported view when delivered
            self.wire.append(("data", (ex, t, lid, first_row)))
        elif kind == "data":
            ex, t, lid, first_row = msg
            try:
                self.b.finish_import(lid, on_the_wire(ex, first_row))
            except SequenceStateError:  # a duplicate, or the import lease timed out
                assert self.b_pending.get(t) != lid
                return
            except CorruptTransferError:
                # the wire read pages whose export lease had already ended (timed out) and
                # that were reused since: caught by the checksums, the import is dropped
                assert ex.lease_id not in self.exports
                assert lid not in self.b.active_leases()
                assert self.b.cache_length(t) == 0
                self.b.release(t)
                del self.b_pending[t]
                return
            del self.b_pending[t]
            self.b_seqs[t] = list(ex.header.tokens)
            self.wire.append(("ack", (ex.lease_id, True)))
        else:
            lid, ok = msg
            ended = self.a.end_lease(lid)
            if ended:
                del self.exports[lid]
            else:  # a duplicate completion, or the lease already timed out
                assert lid not in self.exports

    @rule(data=st.data())
    def pump(self, data):
        """A healthy stretch: deliver everything in flight, oldest first (two rounds, so a
        header's data and the data's acknowledgement arrive too)."""
        for _ in range(3):
            for _ in range(len(self.wire)):
                self.deliver(data, duplicate=False, index=0)

    @rule(data=st.data())
    def drop(self, data):
        if self.wire:
            self.wire.pop(data.draw(st.integers(0, len(self.wire) - 1)))

    @rule()
    def timeout(self):
        for lid in self.a.expire_leases(now=float("inf")):
            del self.exports[lid]
        gone = set(self.b.expire_leases(now=float("inf")))
        for t, lid in list(self.b_pending.items()):
            if lid in gone:  # aborted import: the claimed sequence stays empty
                assert self.b.cache_length(t) == 0
                self.b.release(t)
                del self.b_pending[t]

    # -- decode side ------------------------------------------------------------------------
    @rule(data=st.data())
    def decode_and_release(self, data):
        if not self.b_seqs:
            return
        t = data.draw(st.sampled_from(sorted(self.b_seqs)))
        if data.draw(st.booleans()):
            tok = data.draw(st.integers(0, 3))
            try:
                (inp,) = self.b.fetch([BatchItem(t, [tok])])[:1]
            except (KVCacheCapacityError, ValueError):
                return
            toks = self.b_seqs[t] + [tok]
            n = len(toks) - 1
            page = self.b.pages_of(t)[n // P]
            kv = kv_of(tuple(toks))
            for d, blk in enumerate(self.b.blocks):
                blk[page, :, :, n % P] = kv[:, :, d * H // 2:(d + 1) * H // 2]
            self.b.step([BatchItem(t, [tok])])
            self.b_seqs[t] = toks
        else:
            self.b.release(t)
            del self.b_seqs[t]

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        conserved(self.a)
        conserved(self.b)
        assert set(self.a.active_leases()) == set(self.exports)
        assert set(self.b.active_leases()) == set(self.b_pending.values())
        for ex, sent in self.exports.values():  # leased pages are never rewritten
            assert torch.equal(on_the_wire(ex, 0), sent)
        for t, toks in self.b_seqs.items():
            assert self.b.cache_length(t) == len(toks)
            got = read_back(self.b, t, len(toks))
            for i in range(len(toks)):
                assert torch.equal(got[i], kv_of(tuple(toks[:i + 1]))), (t, i)

    def teardown(self):
        self.timeout()
        assert not self.a.active_leases() and not self.b.active_leases()
        assert self.a.stats().pages_leased == 0 and self.b.stats().pages_leased == 0
        conserved(self.a)
        conserved(self.b)


TestTransferFaultyWire = TransferMachine.TestCase
TestTransferFaultyWire.settings = settings(max_examples=100, stateful_step_count=40,
                                           deadline=None,
                                           suppress_health_check=list(HealthCheck))
