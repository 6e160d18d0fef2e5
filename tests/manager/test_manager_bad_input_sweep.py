"""Every public method of the paged, continuous and linear managers driven with each kind of
bad argument (wrong type, bool ids, negative / huge / NaN values, wrong dtype or shape, unknown
ids, stale inputs, tokens other than fetched, no room): each raises a kvtvm error (a
``ValueError`` / ``TypeError`` / ``RuntimeError``) naming the argument, and leaves the
manager's whole state -- every attribute, recursively, the live fetch token included -- and
the cache bytes as they were."""

from __future__ import annotations

import enum
import math
import threading
from collections import OrderedDict
from types import SimpleNamespace as Item

import numpy as np
import pytest
import torch

from kvtvm import KVCacheParams
from kvtvm.errors import KVCacheError, StaleInputsError
from kvtvm.inputs import FetchToken, TokenBatch
from kvtvm.manager import (ContinuousBatchingKVCacheManager, LinearKVCache,
                           PagedKVCacheManager)

H, D, L, P = 2, 8, 2, 4
HUGE = 10 ** 12
NAN = float("nan")


# -- a deep snapshot of a manager -----------------------------------------------------------

def _snap(v, seen):
    if isinstance(v, np.ndarray):
        return ("nd", v.dtype.str, v.shape, v.tobytes())
    if isinstance(v, torch.Tensor):
        return ("t", str(v.dtype), tuple(v.shape), v.detach().cpu().clone())
    if isinstance(v, FetchToken):
        return ("token", id(v), v.live, v.why)
    if isinstance(v, (int, float, str, bytes, bool, type(None), enum.Enum, np.generic)):
        return v
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, [_snap(x, seen) for x in v])
    if isinstance(v, (dict, OrderedDict)):
        return ("dict", [(_snap(k, seen), _snap(x, seen)) for k, x in v.items()])
    if isinstance(v, (set, frozenset)):
        return ("set", sorted(map(repr, v)))
    if type(v).__module__.startswith("kvtvm") and id(v) not in seen:
        seen.add(id(v))
        attrs = vars(v) if hasattr(v, "__dict__") else {
            s: getattr(v, s) for s in getattr(type(v), "__slots__", ()) if hasattr(v, s)}
        return (type(v).__name__, {k: _snap(x, seen) for k, x in attrs.items()})
    return ("opaque", type(v).__name__)  # locks, devices, copiers: not state


#: scratch and memo attributes: not state (a duplicate check's marks, a hash memo)
SCRATCH = {"_mark", "_chain_memo", "_index_cache"}


def snapshot(mgr):
    return {k: _snap(v, set()) for k, v in vars(mgr).items() if k not in SCRATCH}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _diff(a, b) -> list:
    return [k for k in a if not _same(a[k], b[k])]


# -- managers in a busy state ---------------------------------------------------------------

def _fill_random(tensors):
    gen = torch.Generator().manual_seed(0)
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))


def paged():
    """a: 10 committed tokens (exported: an open lease); b: 6 tokens, forked into e; c: a
    two-step fetch of 3 tokens in flight (the live token); d: claimed, empty."""
    params = KVCacheParams("float32", H, D, "paged", page_size=P, enable_prefix_caching=True)
    mgr = PagedKVCacheManager(params, 6, 32, L, num_pages=16)
    _fill_random(mgr.blocks)
    a, b, c, d = mgr.claim(4)
    for sid, n in ((a, 10), (b, 6)):
        toks = list(range(100 * sid, 100 * sid + n))
        mgr.fetch([Item(seq_id=sid, tokens=toks)])
        mgr.step([Item(seq_id=sid, tokens=toks)])
    e = mgr.fork(b)
    stale = mgr.fetch([Item(seq_id=d, tokens=[1])])[0]
    mgr.release(d)
    (d,) = mgr.external_claim([d]) or [d]
    export = mgr.export_pages(a)
    live = mgr.fetch([Item(seq_id=c, tokens=[7, 8, 9])], num_steps=2)[0]
    free = sorted(mgr.slots_remaining)[0]
    last = mgr.increment_cache_lengths(live)  # its last step: none left to increment
    return mgr, SimpleIds(a, b, c, d, e, free), dict(stale=stale, live=live, export=export,
                                                      last=last)


def continuous():
    params = KVCacheParams("float32", H, D, "continuous")
    mgr = ContinuousBatchingKVCacheManager(params, 4, 16, L)
    _fill_random(mgr.blocks)
    a, b, c = mgr.claim(3)
    mgr.fetch([Item(seq_id=a, tokens=[1, 2, 3])])
    mgr.step([Item(seq_id=a, tokens=[1, 2, 3])])
    stale = mgr.fetch([Item(seq_id=b, tokens=[4])])[0]
    mgr.step([Item(seq_id=b, tokens=[4])])
    live = mgr.fetch([Item(seq_id=c, tokens=[7, 8, 9])], num_steps=2)[0]
    free = sorted(mgr.slots_remaining)[0]
    last = mgr.increment_cache_lengths(live)
    return mgr, SimpleIds(a, b, c, b, b, free), dict(stale=stale, live=live, last=last)


class SimpleIds:
    def __init__(self, a, b, c, d, e, free):
        self.a, self.b, self.c, self.d, self.e, self.free = a, b, c, d, e, free


BAD_IDS = ["x", 1.5, None, True, np.bool_(True), -1, HUGE, NAN, [0]]


def _table_cases(ids, inp):
    """(case id, method, args, kwargs, words one of which the message must hold) shared by
    the paged and continuous managers."""
    a, c, d, free = ids.a, ids.c, ids.d, ids.free
    cases = []
    for v in ["x", 1.5, -1, True, NAN, None, HUGE]:
        cases.append((f"claim-{v!r}", "claim", (v,), {}, ("n", "claim")))
    for v in ["x", None, 1.5, [True], [-1], [HUGE], [1.5], [free, free], [a], [NAN]]:
        cases.append((f"external_claim-{v!r}", "external_claim", (v,), {}, ("seq_id",)))
    for m in ("release", "cache_length"):
        for v in BAD_IDS + [free]:
            cases.append((f"{m}-{v!r}", m, (v,), {}, ("seq_id",)))
    batches = [
        ("none", None, "batch"), ("str", "x", "batch"), ("int", 5, "batch"),
        ("dict", {}, "batch"), ("empty", [], "batch"), ("object", [object()], "batch"),
        ("bool id", [Item(seq_id=True, tokens=[1])], "seq_id"),
        ("np bool id", [Item(seq_id=np.bool_(False), tokens=[1])], "seq_id"),
        ("float id", [Item(seq_id=1.0, tokens=[1])], "seq_id"),
        ("nan id", [Item(seq_id=NAN, tokens=[1])], "seq_id"),
        ("negative id", [Item(seq_id=-1, tokens=[1])], "seq_id"),
        ("huge id", [Item(seq_id=HUGE, tokens=[1])], "seq_id"),
        ("unclaimed", [Item(seq_id=free, tokens=[1])], "seq_id"),
        ("duplicate", [Item(seq_id=d, tokens=[1]), Item(seq_id=d, tokens=[2])], "seq_id"),
        ("str tokens", [Item(seq_id=d, tokens=["a"])], "tokens"),
        ("float tokens", [Item(seq_id=d, tokens=[1.5])], "tokens"),
        ("nan tokens", [Item(seq_id=d, tokens=[NAN])], "tokens"),
        ("bool tokens", [Item(seq_id=d, tokens=[True, False])], "tokens"),
        ("nested tokens", [Item(seq_id=d, tokens=[[1, 2]])], "tokens"),
        ("huge tokens", [Item(seq_id=d, tokens=[2 ** 70])], "tokens"),
        ("no tokens", [Item(seq_id=d, tokens=[])], "token"),
        ("none tokens", [Item(seq_id=d, tokens=None)], "tokens"),
        ("array batch unclaimed", TokenBatch([free], [1]), "seq_id"),
    ]
    for name, batch, word in batches:
        cases.append((f"fetch-{name}", "fetch", (batch,), {}, (word,)))
        if isinstance(batch, list) and batch and isinstance(batch[0], Item) \
                and batch[0].seq_id == d and word.startswith("token"):
            batch = [Item(seq_id=c, tokens=it.tokens) for it in batch]  # one in flight
        cases.append((f"step-{name}", "step", (batch,), {}, (word,)))
    cases += [
        ("fetch-in flight", "fetch", ([Item(seq_id=c, tokens=[1])],), {}, ("seq_id",)),
        ("fetch-too long", "fetch", ([Item(seq_id=d, tokens=[1] * 40)],), {},
         ("max_seq_len",)),
        ("step-not fetched", "step", ([Item(seq_id=a, tokens=[1])],), {}, ("seq_id",)),
        ("step-count", "step", ([Item(seq_id=c, tokens=[7, 8, 9, 1, 2])],), {}, ("tokens",)),
        ("step-mismatch", "step", ([Item(seq_id=c, tokens=[7, 8, 10])],), {}, ("tokens",)),
        ("step-mismatch multistep", "step", ([Item(seq_id=c, tokens=[9, 8, 7, 1])],), {},
         ("tokens",)),
        ("step-mismatch arrays", "step", (TokenBatch([c], [7, 9, 8], counts=[3]),), {},
         ("tokens",)),
    ]
    # 2**63 - 1 and up wrapped the int64 length check (then an untyped error, a fetch left
    # in flight)
    for v in [0, -1, 1.5, True, "x", NAN, None, HUGE, 2 ** 63 - 1, 2 ** 63, 2 ** 64 + 5]:
        cases.append((f"fetch-num_steps {v!r}", "fetch", ([Item(seq_id=d, tokens=[1])],),
                      {"num_steps": v}, ("num_steps",)))
    for name, args, word in [
            ("none", (None,), "kv_cache_inputs"), ("str", ("x",), "kv_cache_inputs"),
            ("list of none", ([None],), "kv_cache_inputs"),
            ("stale", (inp["stale"],), "superseded"),
            ("prev str", (inp["live"], "x"), "prev_model_inputs"),
            ("prev shape", (inp["live"], torch.zeros(7, dtype=torch.int32)), "row offsets"),
            ("prev float", (inp["live"], torch.zeros(2)), "prev_model_inputs"),
            ("prev numpy bool", (inp["live"], np.zeros(2, bool)), "prev_model_inputs"),
            ("no steps left", (inp["last"],), "max_lengths")]:
        cases.append((f"increment-{name}", "increment_cache_lengths", args, {}, (word,)))
    return cases


def _pop_cases(ids):
    """``pop`` (paged and continuous): ``a`` holds fewer than 11 tokens, ``c`` is in flight."""
    cases = [(f"pop-id {v!r}", "pop", (v, 1), {}, ("seq_id",)) for v in BAD_IDS]
    for v in ["x", 1.5, -1, True, NAN, None, 11, HUGE]:
        cases.append((f"pop-n {v!r}", "pop", (ids.a, v), {}, ("n",)))
    cases.append(("pop-in flight", "pop", (ids.c, 1), {}, ("seq_id",)))
    return cases


def _paged_cases(mgr, ids, inp):
    a, c, d, e = ids.a, ids.c, ids.d, ids.e
    cases = _table_cases(ids, inp)
    cases.append(("fetch-no room", "fetch", ([Item(seq_id=d, tokens=[1] * 32),
                                               Item(seq_id=e, tokens=[2] * 20)],), {},
                  ("pages",)))
    for m in ("fork", "pages_of", "block_hashes_of"):
        for v in BAD_IDS + [ids.free]:
            cases.append((f"{m}-{v!r}", m, (v,), {}, ("seq_id",)))
    cases.append(("fork-in flight", "fork", (c,), {}, ("seq_id",)))
    cases += _pop_cases(ids)
    for v in BAD_IDS:
        cases.append((f"export-id {v!r}", "export_pages", (v,), {}, ("seq_id",)))
    cases += [
        ("export-neither", "export_pages", (), {}, ("seq_id",)),
        ("export-both", "export_pages", (a,), {"block_hashes": [1]}, ("seq_id",)),
        ("export-in flight", "export_pages", (c,), {}, ("seq_id",)),
        ("export-hash unknown", "export_pages", (), {"block_hashes": [12345]},
         ("block_hashes", "hash")),
        ("export-hash str", "export_pages", (), {"block_hashes": "x"}, ("block_hashes",)),
        ("export-hash none items", "export_pages", (), {"block_hashes": [None]},
         ("block_hashes",)),
    ]
    for v in ["x", 1.5, -1, True, NAN, HUGE]:
        cases.append((f"export-first_page {v!r}", "export_pages", (a,), {"first_page": v},
                      ("first_page",)))
    for v in ["x", (0, 99), (1, 0), (-1, 1), (0.5, 1), (True, 2), 5]:
        cases.append((f"export-heads {v!r}", "export_pages", (a,), {"heads": v}, ("heads",)))
    for v in ["x", NAN, -1.0, float("inf"), True]:
        cases.append((f"export-timeout {v!r}", "export_pages", (a,), {"timeout": v},
                      ("timeout",)))
    header, data = inp["export"].header, inp["export"].data
    cases += [
        ("import-header str", "import_pages", ("x", data), {}, ("header",)),
        ("import-data str", "import_pages", (header, "x"), {}, ("data",)),
        ("import-data shape", "import_pages", (header, data[:1]), {}, ("data",)),
        ("import-data dtype", "import_pages", (header, data.double()), {}, ("data", "dtype")),
        ("import-data numpy", "import_pages", (header, data.numpy()), {}, ("data",)),
        ("import-seq holds tokens", "import_pages", (header, data), {"seq_id": a},
         ("seq_id",)),
        ("import-seq in flight", "import_pages", (header, data), {"seq_id": c}, ("seq_id",)),
        ("import-seq bool", "import_pages", (header, data), {"seq_id": True}, ("seq_id",)),
        ("import-seq unknown", "import_pages", (header, data), {"seq_id": ids.free},
         ("seq_id",)),
        ("begin_import-header", "begin_import", (None,), {}, ("header",)),
        ("begin_import-timeout", "begin_import", (header,), {"timeout": NAN}, ("timeout",)),
    ]
    export_lease = inp["export"].lease_id
    for v in ["x", None, 1.5, True, -1, 999, export_lease]:
        cases.append((f"finish_import-{v!r}", "finish_import", (v, data), {}, ("lease",)))
        cases.append((f"import_runs-{v!r}", "import_runs", (v,), {}, ("lease",)))
    for v in ["x", None, 1.5, True, NAN]:
        cases.append((f"end_lease-{v!r}", "end_lease", (v,), {}, ("lease_id",)))
    for v in ["x", NAN, True, [1.0]]:
        cases.append((f"expire_leases-{v!r}", "expire_leases", (v,), {}, ("now",)))
    for v in (NAN, -1.0, "1", True):
        cases.append((f"flush_tiers-{v!r}", "flush_tiers", (v,), {}, ("timeout",)))
    for v in ["x", None, 5, [None], ["a"], [1.5], [True]]:
        cases.append((f"held_prefix_pages-{v!r}", "held_prefix_pages", (v,), {},
                      ("block_hashes",)))
    for v in ["x", None, 5, [1.5], [True], [[1, 2]], [None], np.zeros(3, np.float32)]:
        cases.append((f"cached_prefix_tokens-{v!r}", "cached_prefix_tokens", (v,), {},
                      ("tokens",)))
    for kw, word in [({"host_pages": -1}, "host_pages"), ({"host_pages": "x"}, "host_pages"),
                     ({"host_pages": True}, "host_pages"), ({"host_pages": NAN}, "host_pages"),
                     ({"disk_bytes": -5, "disk_dir": "/nonexistent/x"}, "disk_bytes"),
                     ({"disk_bytes": NAN, "disk_dir": "/nonexistent/x"}, "disk_bytes"),
                     ({"disk_dir": 5}, "disk_dir")]:
        cases.append((f"attach_tiers-{kw!r}", "attach_tiers", (), kw, (word,)))
    return cases


def linear():
    params = KVCacheParams("float32", H, D, "linear")
    cache = LinearKVCache(params, 4, 16, L)
    _fill_random([cache.get_kv_cache_buffer()])
    cache.reset_for_new_sequences([3, 0, 5])
    live = cache.step_inputs(1)[0]
    return cache, None, dict(live=live)


def _linear_cases():
    cases = []
    for v in ["x", None, [1.5], [-1], [99], [[1]], [True], [1] * 5, [NAN], 3,
              np.zeros(2, np.float32)]:
        cases.append((f"reset-{v!r}", "reset_for_new_sequences", (v,), {},
                      ("host_reuse_kv_cache_lengths",)))
    for v in [True, 1.5, "x", None, [-1, 0, 0], [1, 1], [99, 0, 0], 99, -1, NAN, [[1, 1, 1]],
              torch.ones(3), np.array([1.0, 1.0, 1.0])]:
        cases.append((f"commit-{v!r}", "commit_sequence_length", (v,), {},
                      ("new_context_lengths", "length")))
    for v in [-1, 99, 1.5, True, "x", NAN, None]:
        cases.append((f"set_active-{v!r}", "set_active_batch_size", (v,), {},
                      ("new_active_batch_size",)))
    for v in [[-1], [99], [0, 0], "x", [1.5], [[0]], None, [True], [NAN], 3]:
        cases.append((f"evict-{v!r}", "evict", (v,), {}, ("keep",)))
    for v in [True, 1.5, "x", [1, 1], [-1, 0, 0], [99, 0, 0], None, [NAN, 1, 1], 99]:
        cases.append((f"step_inputs-{v!r}", "step_inputs", (v,), {},
                      ("new_tokens", "length")))
    for v in [-1, 99, True, "x", 1.5, None]:
        cases.append((f"layer-{v!r}", "get_kv_cache_for_decoder_layer", (v,), {}, ("layer",)))
    for v in [5, -2, "x", True, 1.5, None]:
        cases.append((f"layer device-{v!r}", "get_kv_cache_for_decoder_layer", (0,),
                      {"device": v}, ("device",)))
        cases.append((f"buffer device-{v!r}", "get_kv_cache_buffer", (v,), {}, ("device",)))
        cases.append((f"lengths device-{v!r}", "kv_cache_lengths_of", (v,), {}, ("device",)))
    return cases


def _cases_of(kind):
    """A fresh manager of ``kind`` in its busy state and its cases (same order every build)."""
    if kind == "paged":
        mgr, ids, inp = paged()
        return mgr, inp, _paged_cases(mgr, ids, inp)
    if kind == "continuous":
        mgr, ids, inp = continuous()
        return mgr, inp, _table_cases(ids, inp) + _pop_cases(ids)
    mgr, _, inp = linear()
    return mgr, inp, _linear_cases()


_CASES = [(kind, i, c[0]) for kind in ("paged", "continuous", "linear")
          for i, c in enumerate(_cases_of(kind)[2])]


def _names(msg: str, words) -> bool:
    return any(any(x in msg for x in w.split("|")) for w in words)


@pytest.mark.parametrize("kind,index", [(k, i) for k, i, _ in _CASES],
                         ids=[f"{k}-{name}" for k, _, name in _CASES])
def test_bad_argument_raises_a_named_kvtvm_error_and_changes_nothing(kind, index):
    mgr, inp, cases = _cases_of(kind)
    _, method, args, kwargs, words = cases[index]
    before = snapshot(mgr)
    with pytest.raises(KVCacheError) as info:
        getattr(mgr, method)(*args, **kwargs)
    err = info.value
    assert isinstance(err, (ValueError, TypeError, RuntimeError)), type(err)
    assert _names(str(err), words), f"{method}: {str(err)!r} names none of {words}"
    after = snapshot(mgr)
    assert not _diff(before, after), f"{method} changed {_diff(before, after)}"
    if "live" in inp:
        inp["live"].check_live()   # a refused call kills no live inputs
    if kind == "paged":
        mgr.check_invariants()


def test_the_sweep_covers_every_public_method():
    """A public method added later must join the sweep (or this list of those that take no
    argument to get wrong)."""
    no_args = {"active_leases", "check_invariants", "device_nbytes", "input_specs",
               "input_symbols", "num_kv_inputs", "stats", "storage_name",
               "persist_prefix_cache", "estimated_memory_size", "infer_optimal_batch_size",
               "contains", "close_tiers", "get_active_batch_size", "get_config",
               "get_kv_cache_all_empty", "get_kv_cache_lengths"}
    for kind, cls in (("paged", PagedKVCacheManager),
                      ("continuous", ContinuousBatchingKVCacheManager),
                      ("linear", LinearKVCache)):
        public = {n for n in dir(cls) if not n.startswith("_")
                  and callable(getattr(cls, n)) and not isinstance(getattr(cls, n), type)}
        swept = {c[1] for c in _cases_of(kind)[2]}
        missing = public - swept - no_args
        assert not missing, f"{kind}: not swept: {sorted(missing)}"


_PARAMS = {"paged": KVCacheParams("float32", H, D, "paged", page_size=P),
           "continuous": KVCacheParams("float32", H, D, "continuous"),
           "linear": KVCacheParams("float32", H, D, "linear")}
_CLASSES = {"paged": PagedKVCacheManager, "continuous": ContinuousBatchingKVCacheManager,
            "linear": LinearKVCache}


@pytest.mark.parametrize("kind", list(_CLASSES))
@pytest.mark.parametrize("name", ["max_batch_size", "max_seq_len", "num_layers"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "x", NAN, None, 1 << 31, 2 ** 70])
def test_bad_sizes_are_named_by_constructor_and_size_classmethods(kind, name, value):
    """The sizes of the constructor, estimated_memory_size and infer_optimal_batch_size: a
    non-int, non-positive or past-int32 size is an InvalidArgumentError naming it (the
    classmethods returned floats or negative byte counts for some)."""
    cls, params = _CLASSES[kind], _PARAMS[kind]
    sizes = dict(max_batch_size=2, max_seq_len=16, num_layers=L)
    sizes[name] = value
    calls = [lambda: cls(params, **sizes),
             lambda: cls.estimated_memory_size(params, **sizes)]
    if name != "max_batch_size":
        calls.append(lambda: cls.infer_optimal_batch_size(
            params, sizes["max_seq_len"], sizes["num_layers"], 10 ** 6))
    for call in calls:
        with pytest.raises(KVCacheError, match=name):
            call()


@pytest.mark.parametrize("kind", list(_CLASSES))
def test_size_classmethods_refuse_other_params(kind):
    cls = _CLASSES[kind]
    other = _PARAMS["linear" if kind != "linear" else "paged"]
    for call in (lambda: cls.estimated_memory_size(other, 2, 16, L),
                 lambda: cls.infer_optimal_batch_size(other, 16, L, 10 ** 6),
                 lambda: cls.estimated_memory_size("x", 2, 16, L)):
        with pytest.raises(KVCacheError, match="params"):
            call()


def test_cache_too_big_to_allocate_is_a_capacity_error():
    """A size that passes the checks but not the allocator (about a petabyte) is a
    KVCacheCapacityError naming the cache and its bytes, not the allocator's RuntimeError."""
    from kvtvm.errors import KVCacheCapacityError

    params = KVCacheParams("float32", H, 256, "paged", page_size=64)
    with pytest.raises(KVCacheCapacityError, match="cache"):
        PagedKVCacheManager(params, 2, 128, L, num_pages=(1 << 31) - 1)
