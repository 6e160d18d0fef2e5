"""LinearKVCache driven by random seed-004 verbs against a dense shadow (hypothesis).

The shadow holds, per active slot, the K/V rows written through ``kvtvm.ops.append_kv``; after
every rule the lengths match it and the cache reads back exactly those rows.
"""

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtvm import KVCacheParams, ops
from kvtvm.errors import InvalidArgumentError, SequenceTooLongError
from kvtvm.manager import LinearKVCache

H, D, L, MB, S = 2, 8, 2, 4, 12


class LinearMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        params = KVCacheParams("float32", n_kv_heads=H, head_dim=D, cache_strategy="linear")
        self.cache = LinearKVCache(params, MB, S, L)
        buf = self.cache.get_kv_cache_buffer()
        buf.copy_(torch.randn(buf.shape))  # garbage: a missed write cannot pass as zeros
        self.rows = []  # per active slot: list of [L, 2, H, D] rows
        self.rng = np.random.default_rng(0)

    def lengths(self):
        return [len(r) for r in self.rows]

    @rule(data=st.data())
    def reset(self, data):
        n = data.draw(st.integers(0, MB))
        reuse = [data.draw(st.integers(0, len(self.rows[b]) if b < len(self.rows) else 0))
                 for b in range(n)]
        self.cache.reset_for_new_sequences(reuse)
        self.rows = [list(self.rows[b][:k]) if k else [] for b, k in enumerate(reuse)]

    @rule(data=st.data())
    def append_and_commit(self, data):
        n = len(self.rows)
        if n == 0:
            return
        new = [data.draw(st.integers(0, 4)) for _ in range(n)]
        before = self.lengths()
        if any(len(r) + k > S for r, k in zip(self.rows, new)):
            try:
                self.cache.step_inputs(new)
            except SequenceTooLongError:
                assert self.cache.host_lengths[:n].tolist() == before
                return
            raise AssertionError("step_inputs past max_seq_len did not raise")
        (inp,) = self.cache.step_inputs(new)
        rows = self.rng.standard_normal((sum(new), L, 2, H, D)).astype(np.float32)
        for layer in range(L):
            buf = self.cache.get_kv_cache_for_decoder_layer(layer)
            ops.append_kv(buf[:, 0], buf[:, 1], torch.from_numpy(rows[:, layer, 0].copy()),
                          torch.from_numpy(rows[:, layer, 1].copy()), inp.qo_indptr,
                          inp.cache_lengths, inp.lookup_table, layout="hnd")
        if data.draw(st.booleans()) and len(set(new)) == 1:
            self.cache.commit_sequence_length(new[0])  # the decode form: one int for all
        else:
            self.cache.commit_sequence_length(torch.tensor(new, dtype=torch.int32))
        off = 0
        for b, k in enumerate(new):
            self.rows[b].extend(rows[off:off + k])
            off += k

    @rule(data=st.data())
    def evict(self, data):
        n = len(self.rows)
        keep = data.draw(st.lists(st.integers(0, max(n - 1, 0)), unique=True, max_size=n)) \
            if n else []
        self.cache.evict(keep)
        self.rows = [self.rows[b] for b in sorted(keep)]

    @rule(data=st.data())
    def set_active(self, data):
        n = data.draw(st.integers(0, MB))
        self.cache.set_active_batch_size(n)
        self.rows = self.rows[:n] + [[] for _ in range(n - len(self.rows))]

    @rule(data=st.data())
    def bad_commit_changes_nothing(self, data):
        n = len(self.rows)
        before = self.lengths()
        bad = data.draw(st.sampled_from(["negative", "too_long", "wrong_size"]))
        try:
            if bad == "negative" and n:
                self.cache.commit_sequence_length([-1] * n)
            elif bad == "too_long" and n:
                self.cache.commit_sequence_length(S + 1)
            else:
                self.cache.commit_sequence_length([1] * (n + 1))
        except (InvalidArgumentError, SequenceTooLongError):
            pass
        else:
            raise AssertionError(f"bad commit ({bad}) did not raise")
        assert self.cache.host_lengths[:n].tolist() == before

    @invariant()
    def matches_shadow(self):
        n = len(self.rows)
        assert self.cache.active_batch_size == n
        assert self.cache.kv_cache_lengths.tolist() == self.lengths()
        assert self.cache.kv_cache_all_empty == (sum(self.lengths()) == 0)
        for layer in range(L):
            buf = self.cache.get_kv_cache_for_decoder_layer(layer)  # [MB, 2, H, S, D]
            for b, rows in enumerate(self.rows):
                if rows:
                    want = np.stack([r[layer] for r in rows], axis=2)  # [2, H, len, D]
                    got = buf[b, :, :, :len(rows)].numpy()
                    np.testing.assert_array_equal(got, want)


LinearMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30,
                                           deadline=None, suppress_health_check=list(HealthCheck))
TestLinear = LinearMachine.TestCase
