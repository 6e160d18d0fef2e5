"""Hostile calls the off-grid driver (``offgrid_driver.py``) mixes into its run: the ops
given a live step's inputs and one bad argument each, and superseded inputs -- each must
raise a typed kvtvm error (naming the argument) and change neither the manager's state nor a
byte of its cache."""

from __future__ import annotations

import torch

from kvtvm import ops
from kvtvm.errors import KVCacheError, StaleInputsError
from kvtvm.plan import plan_step

TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class HostileCalls:
    """Mixin of the driver: needs ``cfg``, ``rng``, ``state()`` and ``blocks()``."""

    # -- hostile calls: a typed error naming the argument, nothing changed ----------------
    def raw_bytes(self) -> bytes:
        return b"".join(b.view(torch.uint8).numpy().tobytes() for b in self.blocks())

    def refused(self, what: str, call, error=KVCacheError, names=None):
        before = self.state(), self.raw_bytes()
        try:
            call()
        except error as e:
            if names is not None:
                assert any(n in str(e) for n in names), (what, str(e))
        else:
            raise AssertionError(f"{what}: accepted")
        assert (self.state(), self.raw_bytes()) == before, f"{what}: changed the manager"
        self.counts["refused"] = self.counts.get("refused", 0) + 1

    def hostile_ops(self, inp, T: int):
        """The ops given this step's live inputs and one bad argument each."""
        c, r = self.cfg, self.rng
        dt = TORCH[c.dtype]
        kc, vc = inp.k_cache(0), inp.v_cache(0)
        good = lambda *shape: torch.zeros(*shape, dtype=dt)  # noqa: E731
        k = good(T, c.H, c.D)
        tabs = (inp.qo_indptr, inp.cache_lengths, inp.lookup_table)
        other = torch.float64 if c.dtype != "float64" else torch.float32
        cases = [
            ("k dtype", lambda: ops.append_kv(kc, vc, k.to(other), k, *tabs, layout=inp.layout),
             ("k",)),
            ("k head_dim", lambda: ops.append_kv(kc, vc, good(T, c.H, c.D + 1),
                                                 good(T, c.H, c.D + 1), *tabs,
                                                 layout=inp.layout), ("k", "head_dim")),
            ("k heads", lambda: ops.append_kv(kc, vc, good(T, c.H + 1, c.D),
                                              good(T, c.H + 1, c.D), *tabs,
                                              layout=inp.layout), ("k", "n_kv_heads")),
            ("k rows", lambda: ops.append_kv(kc, vc, good(T + 1, c.H, c.D),
                                             good(T + 1, c.H, c.D), *tabs,
                                             layout=inp.layout), ("k", "num_tokens", "qo_indptr")),
            ("k strided", lambda: ops.append_kv(kc, vc, good(T, c.H, 2 * c.D)[..., ::2]
                                                if c.D > 1 and c.H * T > 1 else k.to(other), k,
                                                *tabs, layout=inp.layout), ("k",)),
            ("k expanded", lambda: ops.append_kv(kc, vc, good(1, c.H, c.D).expand(T, -1, -1)
                                                 if T > 1 else good(T, c.H, c.D).to(other), k,
                                                 *tabs, layout=inp.layout), ("k",)),
            ("lengths float", lambda: ops.append_kv(kc, vc, k, k, tabs[0], tabs[1].float(),
                                                    tabs[2], layout=inp.layout),
             ("cache_lengths",)),
            ("lengths int64", lambda: ops.append_kv(kc, vc, k, k, tabs[0], tabs[1].long(),
                                                    tabs[2], layout=inp.layout),
             ("cache_lengths",)),
            ("layout", lambda: ops.append_kv(kc, vc, k, k, *tabs,
                                             layout="hnd" if inp.layout == "nhd" else "nhd"),
             ("layout", "k_cache", "shape", "v_cache")),
            ("q heads", lambda: ops.prefill_attention(good(T, c.H * c.G + 1 if c.H > 1 else 0,
                                                           c.D), kc, vc,
                                                      *tabs, layout=inp.layout), ("q",)),
            ("q dtype", lambda: ops.prefill_attention(good(T, c.H * c.G, c.D).to(other), kc, vc,
                                                      *tabs, layout=inp.layout), ("q",)),
            ("sm_scale nan", lambda: ops.prefill_attention(good(T, c.H * c.G, c.D), kc, vc,
                                                           *tabs, layout=inp.layout,
                                                           sm_scale=float("nan")),
             ("sm_scale",)),
            ("plan layer", lambda: plan_step(inp).append_kv(c.L, k, k), ("layer",)),
            ("plan layer bool", lambda: plan_step(inp).append_kv(True, k, k), ("layer",)),
            ("collection layer", lambda: inp.collection().get_key_cache(-1), ("layer",)),
        ]
        for i in r.choice(len(cases), 3, replace=False):
            what, call, names = cases[int(i)]
            self.refused(what, call, names=names)
        inp.check_live()

    def stale_is_refused(self, inp, T: int):
        c = self.cfg
        dt = TORCH[c.dtype]
        k = torch.zeros(T, c.H, c.D, dtype=dt)
        kc, vc = inp.k_cache(0), inp.v_cache(0)
        self.refused("stale append", lambda: ops.append_kv(
            kc, vc, k, k, inp.qo_indptr, inp.cache_lengths, inp.lookup_table,
            layout=inp.layout), StaleInputsError)
        self.refused("stale plan", lambda: plan_step(inp).append_kv(0, k, k), StaleInputsError)
