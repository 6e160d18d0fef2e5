"""Hostile input the bad-input sweeps did not reach: the per-layer accessors of a collection
(bool / negative / huge indices, positions past the step's pages, stale inputs), KVCacheParams'
flags and its memory arithmetic's sizes, uint64 ids and tokens past int64, and cache views of
another manager given with a fetch's tables. Each raises a typed kvtvm error naming the
argument and changes nothing (the cache bytes compared)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtvm import KVCacheParams, ops
from kvtvm.errors import InvalidArgumentError, StaleInputsError
from kvtvm.inputs import BatchItem, TokenBatch
from kvtvm.manager import ContinuousBatchingKVCacheManager, PagedKVCacheManager

H, D, P = 2, 8, 4


def _paged(**kw):
    params = KVCacheParams("float32", H, D, "paged", page_size=P, **kw)
    mgr = PagedKVCacheManager(params, 3, 16, 2)
    gen = torch.Generator().manual_seed(0)
    for b in mgr.blocks:
        b.copy_(torch.randn(b.shape, generator=gen))
    return mgr


def _accessor():
    """A paged manager whose seq a holds 6 tokens and seq b 9; the fetch of one more token of
    a (batch entry 0) is live; returns (mgr, inputs, K accessor of layer 1)."""
    mgr = _paged()
    a, b = mgr.claim(2)
    for s, n in ((a, 6), (b, 9)):
        mgr.fetch([BatchItem(s, list(range(n)))])
        mgr.step([BatchItem(s, list(range(n)))])
    (inp,) = mgr.fetch([BatchItem(a, [1])])
    return mgr, inp, inp.collection().get_key_cache(1)


BAD_INDEX = [True, np.bool_(False), -1, 10 ** 12, 1.0, "0", None, float("nan")]


@pytest.mark.parametrize("value", BAD_INDEX, ids=repr)
@pytest.mark.parametrize("where", ["layer", "batch_idx", "bs_idx", "tok_idx", "head_idx"])
def test_collection_accessors_refuse_bad_indices_and_write_nothing(where, value):
    """Before: a bool layer was layer 1, a negative entry or position wrapped to the last one,
    a huge one was an IndexError, and ``store`` at a position past the sequence's pages wrote
    into page 0 -- another sequence's page."""
    mgr, inp, kc = _accessor()
    col = inp.collection()
    saved = mgr.blocks[0].clone()
    calls = {"layer": [lambda: col.get_key_cache(value), lambda: col.get_value_cache(value)],
             "batch_idx": [lambda: kc.cache_length(value), lambda: kc.row_idx(value, 0),
                           lambda: kc.store(value, 0, 0, slice(None), torch.zeros(D))],
             "bs_idx": [lambda: col.cache_length(value)],
             "tok_idx": [lambda: kc.row_idx(0, value), lambda: kc.page_and_slot(0, value),
                         lambda: kc.load(0, 0, value),
                         lambda: kc.store(0, 0, value, slice(None), torch.zeros(D))],
             "head_idx": [lambda: kc.col_idx(value), lambda: kc.load(0, value, 0),
                          lambda: kc.store(0, value, 0, slice(None), torch.zeros(D))]}[where]
    for call in calls:
        with pytest.raises(InvalidArgumentError, match=where):
            call()
    assert torch.equal(mgr.blocks[0], saved)
    inp.check_live()


def test_accessor_positions_end_at_the_steps_new_tokens():
    """Entry 0 holds 6 tokens and adds 1: positions 0..6 are its own, 7 (page 1, slot 3 of a
    page it holds) is past the step, and 8 was page 0 of the table's zero fill."""
    mgr, inp, kc = _accessor()
    pages = mgr.pages_of(inp.seq_ids[0])
    assert kc.row_idx(0, 6) == pages[1] * P + 2
    saved = mgr.blocks[0].clone()
    for pos in (7, 8, 15):
        with pytest.raises(InvalidArgumentError, match=r"tok_idx.*\[0, 7\)"):
            kc.store(0, 0, pos, slice(None), torch.zeros(D))
    assert torch.equal(mgr.blocks[0], saved)


@pytest.mark.parametrize("supersede", ["step", "fetch", "release"])
def test_accessors_of_stale_inputs_raise_and_write_nothing(supersede):
    """Before: ``store`` through the collection of a superseded fetch wrote with its old
    tables (after a release, into pages another sequence may now hold)."""
    mgr, inp, kc = _accessor()
    a = inp.seq_ids[0]
    if supersede == "step":
        mgr.step([BatchItem(a, [1])])
    elif supersede == "fetch":
        mgr.step([BatchItem(a, [1])])
        mgr.fetch([BatchItem(a, [2])])
    else:
        mgr.release(a)
    saved = mgr.blocks[0].clone()
    for call in (lambda: kc.store(0, 0, 1, slice(None), torch.zeros(D)),
                 lambda: kc.load(0, 0, 1), lambda: kc.row_idx(0, 1)):
        with pytest.raises(StaleInputsError):
            call()
    assert torch.equal(mgr.blocks[0], saved)


@pytest.mark.parametrize("value", ["x", None, 1, 0, 1.0, "False"], ids=repr)
def test_enable_prefix_caching_must_be_a_bool(value):
    """Before: any truthy value turned prefix caching on (``"False"`` included) and None
    passed as False."""
    with pytest.raises(InvalidArgumentError, match="enable_prefix_caching"):
        KVCacheParams("float32", H, D, "paged", page_size=P, enable_prefix_caching=value)
    assert KVCacheParams("float32", H, D, "paged", page_size=P,
                         enable_prefix_caching=np.bool_(True)).enable_prefix_caching is True


@pytest.mark.parametrize("call,name", [
    (lambda p: p.bytes_per_token(0), "num_layers"),
    (lambda p: p.bytes_per_token(-1), "num_layers"),
    (lambda p: p.bytes_per_token(1.5), "num_layers"),
    (lambda p: p.bytes_per_page(True), "num_layers"),
    (lambda p: p.bytes_per_token(2, "x"), "devices"),
    (lambda p: p.bytes_per_token(2, 1.0), "devices"),
    (lambda p: p.pages_for_tokens(-5), "n_tokens"),
    (lambda p: p.pages_for_tokens(2.5), "n_tokens"),
    (lambda p: p.cache_bytes(2, -3, 16, num_pages=4), "max_batch_size"),
    (lambda p: p.cache_bytes(2, 3, 0, num_pages=4), "max_seq_len"),
    (lambda p: p.cache_bytes(2, 3, 16, num_pages=-4), "num_pages"),
    (lambda p: p.cache_shape(-2, 3, 16, num_pages=4), "num_layers"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_memory_arithmetic_refuses_bad_sizes(call, name):
    """Before: 0 or -1 layers gave 0 or negative bytes, -5 tokens -1 pages, a str device
    count a TypeError."""
    for params in (KVCacheParams("float32", H, D, "paged", page_size=P),
                   KVCacheParams("float16", H, D, "paged", page_size=P, cache_dtype="int8")):
        with pytest.raises(InvalidArgumentError, match=name):
            call(params)


def test_uint64_tokens_and_ids_past_int64_are_refused():
    """Before: 2**64 - 1 wrapped to the token -1 (the prefix cache then keyed both as one
    token) and to the seq id -1."""
    mgr = _paged(enable_prefix_caching=True)
    (a,) = mgr.claim(1)
    huge = np.array([2 ** 64 - 1], np.uint64)
    saved = mgr.blocks[0].clone()
    with pytest.raises(InvalidArgumentError, match="tokens"):
        mgr.fetch(TokenBatch([a], huge))
    with pytest.raises(InvalidArgumentError, match="seq_ids"):
        mgr.fetch(TokenBatch(huge, [1]))
    for tokens in ([2 ** 63], [2 ** 64 - 1, 1], np.array([2 ** 63 + 5], np.uint64)):
        with pytest.raises(InvalidArgumentError, match="tokens"):   # as batch items too
            mgr.fetch([BatchItem(a, tokens)])
    assert mgr.cache_length(a) == 0 and torch.equal(mgr.blocks[0], saved)
    (inp,) = mgr.fetch(TokenBatch([a], np.array([2 ** 63 - 1], np.uint64)))  # still fine
    assert inp.qo_indptr.tolist() == [0, 1]


def _two_managers(cache_dtype=None, kind="paged"):
    if kind == "continuous":
        params = KVCacheParams("float32", H, D, "continuous", cache_dtype=cache_dtype)
        make = lambda: ContinuousBatchingKVCacheManager(params, 2, 16, 2)  # noqa: E731
    else:
        params = KVCacheParams("float32", H, D, "paged", page_size=P, cache_dtype=cache_dtype)
        make = lambda: PagedKVCacheManager(params, 2, 16, 2)  # noqa: E731
    out = []
    for _ in range(2):
        mgr = make()
        (s,) = mgr.claim(1)
        (inp,) = mgr.fetch([BatchItem(s, [1, 2, 3])])
        out.append((mgr, inp))
    return out


@pytest.mark.parametrize("cache_dtype", [None, "int8"])
@pytest.mark.parametrize("kind", ["paged", "continuous"])
@pytest.mark.parametrize("op", ["append", "prefill", "decode", "plan rebind"])
def test_a_fetchs_tables_with_another_managers_cache_are_refused(op, kind, cache_dtype):
    """Before: manager A's tables with manager B's cache views (same shapes) wrote B's pages
    at A's positions -- a write into memory no fetch of B had handed out; a copy of the views
    was read as if it were the cache."""
    (ma, ia), (mb, ib) = _two_managers(cache_dtype, kind)
    saved = [m.blocks[0].clone() for m in (ma, mb)]
    k, v, q = torch.randn(3, H, D), torch.randn(3, H, D), torch.randn(3, 2 * H, D)
    for kc, vc in ((ib.k_cache(0), ib.v_cache(0)), (ia.k_cache(0).clone(), ia.v_cache(0))):
        with pytest.raises(InvalidArgumentError, match="k_cache|v_cache"):
            if op == "append":
                ops.append_kv(kc, vc, k, v, ia.qo_indptr, ia.cache_lengths, ia.lookup_table)
            elif op == "prefill":
                ops.prefill_attention(q, kc, vc, ia.qo_indptr, ia.cache_lengths,
                                      ia.lookup_table)
            elif op == "decode":
                ops.decode_attention(q[:1], kc, vc, ia.cache_lengths, ia.lookup_table)
            else:  # a plan of A's step given B's views by rebinding A's launch
                from kvtvm.plan import plan_step
                plan = plan_step(ia)
                plan.append_kv(0, k, v)
                launch = plan._append
                launch.rebind(k_cache=kc, v_cache=vc).run()
    assert all(torch.equal(m.blocks[0], s) for m, s in zip((ma, mb), saved)) or op == "plan rebind"
    ia.check_live()


def test_tables_of_two_fetches_are_refused():
    """Before: qo_indptr of one fetch with the cache_lengths and lookup_table of another
    (both live, two managers) were taken as one batch."""
    (ma, ia), (mb, ib) = _two_managers()
    saved = ma.blocks[0].clone()
    with pytest.raises(InvalidArgumentError, match="one fetch"):
        ops.append_kv(ia.k_cache(0), ia.v_cache(0), torch.randn(3, H, D),
                      torch.randn(3, H, D), ib.qo_indptr, ia.cache_lengths, ia.lookup_table)
    assert torch.equal(ma.blocks[0], saved)


@pytest.mark.parametrize("kind", ["paged", "linear"])
def test_a_layout_other_than_the_fetchs_views_is_refused(kind):
    """With ``page_size == n_kv_heads`` (paged) or ``max_seq_len == n_kv_heads`` (linear) an
    ``nhd`` view has the shape of an ``hnd`` one; before, the other layout wrote every row at
    a transposed (page slot, head) position."""
    if kind == "paged":
        params = KVCacheParams("float32", 3, D, "paged", page_size=3)
        mgr = PagedKVCacheManager(params, 2, 9, 1)
        (s,) = mgr.claim(1)
        (inp,) = mgr.fetch([BatchItem(s, [1, 2])])
        blocks = mgr.blocks[0]
    else:
        from kvtvm.manager import LinearKVCache
        mgr = LinearKVCache(KVCacheParams("float32", 3, D, "linear"), 2, 3, 1)
        mgr.reset_for_new_sequences([0])
        (inp,) = mgr.step_inputs([2])
        blocks = mgr.get_kv_cache_buffer()
    wrong = "hnd" if inp.layout == "nhd" else "nhd"
    kc, vc = inp.k_cache(0), inp.v_cache(0)
    k = torch.randn(2, 3, D)
    saved = blocks.clone()
    with pytest.raises(InvalidArgumentError, match="layout"):
        ops.append_kv(kc, vc, k, k, inp.qo_indptr, inp.cache_lengths, inp.lookup_table,
                      layout=wrong)
    with pytest.raises(InvalidArgumentError, match="layout"):
        ops.prefill_attention(torch.randn(2, 3, D), kc, vc, inp.qo_indptr, inp.cache_lengths,
                              inp.lookup_table, layout=wrong)
    assert torch.equal(blocks, saved)


@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
@pytest.mark.parametrize("kind", ["paged", "linear"])
def test_the_other_layout_is_named_before_the_shapes_it_confuses(kind, cache_dtype):
    """Was: the layout check ran after the shape checks, so unless the page size happened to
    equal the head count, forgetting ``layout="hnd"`` on a linear cache's views (or passing
    it to a paged one's) was an error about ``n_kv_heads`` (``k.shape[1]: expected 32``, the
    sequence length) -- never naming ``layout``. Now every op names it, nothing written."""
    if kind == "paged":
        params = KVCacheParams("float32", 2, D, "paged", page_size=16, cache_dtype=cache_dtype)
        mgr = PagedKVCacheManager(params, 2, 64, 1)
        (s,) = mgr.claim(1)
        (inp,) = mgr.fetch([BatchItem(s, [1, 2, 3])])
        blocks = mgr.blocks[0]
    else:
        from kvtvm.manager import LinearKVCache
        params = KVCacheParams("float32", 2, D, "linear", cache_dtype=cache_dtype)
        mgr = LinearKVCache(params, 2, 32, 1)
        mgr.reset_for_new_sequences([0])
        (inp,) = mgr.step_inputs([3])
        blocks = mgr.get_kv_cache_buffer()
    wrong = "hnd" if inp.layout == "nhd" else "nhd"
    kc, vc = inp.k_cache(0), inp.v_cache(0)
    k, q = torch.randn(3, 2, D), torch.randn(3, 8, D)
    saved = blocks.clone()
    want = f"layout: expected '{inp.layout}'.*got '{wrong}'"
    with pytest.raises(InvalidArgumentError, match=want):
        ops.append_kv(kc, vc, k, k, inp.qo_indptr, inp.cache_lengths, inp.lookup_table,
                      layout=wrong)
    with pytest.raises(InvalidArgumentError, match=want):
        ops.prefill_attention(q, kc, vc, inp.qo_indptr, inp.cache_lengths, inp.lookup_table,
                              layout=wrong)
    with pytest.raises(InvalidArgumentError, match=want):
        ops.decode_attention(q[:1], kc, vc, inp.cache_lengths, inp.lookup_table, layout=wrong)
    assert torch.equal(blocks, saved)


def test_prefill_names_q_when_its_rows_disagree_with_qo_indptr():
    """Was: ``qo_indptr[-1]: expected 4 (rows of k)`` -- prefill has no ``k``."""
    mgr = PagedKVCacheManager(KVCacheParams("float32", 2, D, "paged", page_size=16), 2, 64, 1)
    (s,) = mgr.claim(1)
    (inp,) = mgr.fetch([BatchItem(s, [1, 2, 3, 4, 5])])
    with pytest.raises(InvalidArgumentError, match=r"qo_indptr\[-1\]: expected 4 \(rows of q\)"):
        ops.prefill_attention(torch.randn(4, 8, D), inp.k_cache(0), inp.v_cache(0),
                              inp.qo_indptr, inp.cache_lengths, inp.lookup_table)


@pytest.mark.parametrize("kind", ["paged", "continuous", "linear"])
def test_inferred_batch_size_is_one_the_manager_takes(kind):
    """Before: 10**30 bytes inferred a batch of about 10**27, which every size check (int32
    tables) then refused."""
    from kvtvm.manager import LinearKVCache
    cls = {"paged": PagedKVCacheManager, "continuous": ContinuousBatchingKVCacheManager,
           "linear": LinearKVCache}[kind]
    params = KVCacheParams("float16", H, D, kind, page_size=P if kind == "paged" else None)
    best = cls.infer_optimal_batch_size(params, 64, 2, 10 ** 30)
    assert 1 <= best <= (1 << 31) - 1
    assert cls.estimated_memory_size(params, best, 64, 2) > 0  # sizes it accepts
    for mb in (1, 3, 7):  # and for a real budget: exactly the batch whose estimate it is
        full = cls.estimated_memory_size(params, mb, 64, 2)
        assert cls.infer_optimal_batch_size(params, 64, 2, full) == mb
        assert cls.infer_optimal_batch_size(params, 64, 2, full - 1) == max(1, mb - 1)


def _config(**kw):
    from types import SimpleNamespace
    base = dict(num_attention_heads=4, hidden_size=64, num_key_value_heads=2, head_dim=None,
                dtype="float16")
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("kw,name", [
    (dict(num_attention_heads=3, hidden_size=100, num_key_value_heads=None),
     "hidden_size"),                                                 # was: head_dim 33
    (dict(num_key_value_heads=3), "num_key_value_heads"),           # 4 heads, 3 KV heads
    (dict(num_key_value_heads=0), "num_key_value_heads"),           # was: 0 -> 4 heads
    (dict(num_key_value_heads=2.5), "num_key_value_heads"),         # was: int(2.5) = 2
    (dict(num_attention_heads=0), "num_attention_heads"),           # was: ZeroDivisionError
    (dict(head_dim=0), "head_dim"),
    (dict(hidden_size=None), "hidden_size"),
    (dict(head_dim=12.5), "head_dim"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_from_hf_config_refuses_configs_it_cannot_size(kw, name):
    with pytest.raises(InvalidArgumentError, match=name):
        KVCacheParams.from_hf_config(_config(**kw), page_size=4)


def test_from_hf_config_sizes_real_configs():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                                   intermediate_size=64, num_hidden_layers=1)
    p = KVCacheParams.from_hf_config(cfg, dtype="float32", page_size=5)
    assert (p.n_kv_heads, p.head_dim) == (3, 16)
    cfg = transformers.MistralConfig(hidden_size=96, num_attention_heads=6,
                                     num_key_value_heads=2, head_dim=40, intermediate_size=64,
                                     num_hidden_layers=1)
    p = KVCacheParams.from_hf_config(cfg, dtype="bfloat16", page_size=5)
    assert (p.n_kv_heads, p.head_dim) == (2, 40)
    p = KVCacheParams.from_hf_config(_config(num_key_value_heads=None), page_size=4)
    assert (p.n_kv_heads, p.head_dim, p.dtype) == (4, 16, "float16")


def test_from_hf_config_off_the_llama_grid():
    """Found by a helper: Falcon's ``multi_query`` (one K/V head) sized 71 heads; MLA
    (DeepSeek) was sized by ``qk_rope_head_dim`` (neither K's 192 nor V's 128); a multimodal
    config naming its dtype at the top (what ``save_pretrained`` writes) was "names no
    dtype"; a numpy ``num_attention_heads`` was "not a decoder config"."""
    transformers = pytest.importorskip("transformers")
    small = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=1)
    falcon = transformers.FalconConfig
    for kw, kv in ((dict(multi_query=True), 1), (dict(multi_query=False), 4),
                   (dict(new_decoder_architecture=True, num_kv_heads=2), 2)):
        p = KVCacheParams.from_hf_config(falcon(**small, **kw), dtype="float32", page_size=4)
        assert (p.n_kv_heads, p.head_dim) == (kv, 16), kw
    with pytest.raises(InvalidArgumentError, match="multi-head latent attention"):
        KVCacheParams.from_hf_config(transformers.DeepseekV3Config(), dtype="float32",
                                     page_size=4)
    with pytest.raises(InvalidArgumentError, match="v_head_dim"):
        KVCacheParams.from_hf_config(_config(head_dim=16, v_head_dim=8), page_size=4)
    llava = transformers.LlavaConfig(text_config=transformers.LlamaConfig(
        **small, num_key_value_heads=2), dtype="bfloat16")
    p = KVCacheParams.from_hf_config(llava, page_size=4)
    assert (p.n_kv_heads, p.head_dim, p.dtype) == (2, 16, "bfloat16")
    p = KVCacheParams.from_hf_config(_config(num_attention_heads=np.int64(4)), page_size=4)
    assert (p.n_kv_heads, p.head_dim) == (2, 16)
    with pytest.raises(InvalidArgumentError, match="config.num_attention_heads"):
        KVCacheParams.from_hf_config(_config(num_attention_heads="4"), page_size=4)


@pytest.mark.parametrize("kind", ["paged", "continuous", "linear"])
def test_sizing_classmethods_refuse_keywords_they_do_not_take(kind):
    """Found by a helper: ``**kwargs`` swallowed anything -- ``num_page=3`` (a typo) sized the
    default pool; the continuous estimate took ``available_cache_memory="junk"``. A keyword of
    the constructor that changes no size (a copier) is still taken."""
    from kvtvm.manager import LinearKVCache

    cls = {"paged": PagedKVCacheManager, "continuous": ContinuousBatchingKVCacheManager,
           "linear": LinearKVCache}[kind]
    params = KVCacheParams("float32", 2, 8, kind, page_size=4 if kind == "paged" else None)
    exact = cls.estimated_memory_size(params, 2, 16, 1)
    with pytest.raises(InvalidArgumentError, match="unexpected keyword 'num_page'"):
        cls.estimated_memory_size(params, 2, 16, 1, num_page=3)
    with pytest.raises(InvalidArgumentError, match="unexpected keyword 'num_page'"):
        cls.infer_optimal_batch_size(params, 16, 1, 10 ** 6, num_page=3)
    copier = {"paged": "page_copier", "linear": "slot_copier"}.get(kind)
    if copier:
        assert cls.estimated_memory_size(params, 2, 16, 1, **{copier: None}) == exact
    if kind == "paged":
        with pytest.raises(InvalidArgumentError, match="num_pages"):
            cls.infer_optimal_batch_size(params, 16, 1, 10 ** 6, num_pages=3)
    else:
        with pytest.raises(InvalidArgumentError, match="available_cache_memory"):
            cls.estimated_memory_size(params, 2, 16, 1, available_cache_memory="junk")


def test_skip_layers_without_an_8bit_cache_is_refused():
    """As the command line refuses ``--skip-layers`` without an 8-bit cache: was a silent
    no-op that made the params unequal to the same cache's."""
    with pytest.raises(InvalidArgumentError, match="skip_layers.*8-bit"):
        KVCacheParams("float16", 2, 8, "paged", page_size=4, skip_layers=(0, -1))
    p = KVCacheParams("float16", 2, 8, "paged", page_size=4, k_cache_dtype="int8",
                      skip_layers=(0, -1))
    assert p.skip_layers == (-1, 0)


@pytest.mark.parametrize("inputs,word", [("list", "inputs[0]"), (None, "inputs"),
                                         ("str", "inputs")])
def test_plan_step_refuses_what_is_not_one_devices_inputs(inputs, word):
    """Before: an AttributeError -- for the list ``fetch`` returns too, the likeliest slip."""
    from kvtvm.plan import plan_step
    mgr = _paged()
    (s,) = mgr.claim(1)
    fetched = mgr.fetch([BatchItem(s, [1, 2])])
    arg = {"list": fetched, None: None, "str": "x"}[inputs]
    with pytest.raises(InvalidArgumentError, match=word.replace("[", r"\[")):
        plan_step(arg)
    with pytest.raises(InvalidArgumentError, match="decode"):
        plan_step(fetched[0], decode="yes")
    plan_step(fetched[0])  # the inputs stay good


@pytest.mark.parametrize("tokens", [{1, 2}, frozenset({3}), {1: 2}], ids=repr)
def test_unordered_tokens_are_refused(tokens):
    """Before: a set of tokens was taken in its iteration order."""
    mgr = _paged(enable_prefix_caching=True)
    (a,) = mgr.claim(1)
    with pytest.raises(InvalidArgumentError, match="tokens"):
        mgr.fetch([BatchItem(a, tokens)])
    assert mgr.cache_length(a) == 0
    mgr.fetch([BatchItem(a, [1, 2])])


def test_increment_cache_lengths_refuses_another_managers_inputs():
    """Before: manager A incremented manager B's inputs (B's tables and cache) as its own."""
    import dataclasses
    (ma, ia), (mb, ib) = _two_managers()
    mb.release(ib.seq_ids[0])
    (s,) = mb.claim(1)
    (ib,) = mb.fetch([BatchItem(s, [1, 2])], num_steps=2)
    with pytest.raises(InvalidArgumentError, match="kv_cache_inputs"):
        ma.increment_cache_lengths(ib)
    with pytest.raises(InvalidArgumentError, match="kv_cache_inputs"):
        mb.increment_cache_lengths(dataclasses.replace(ib, token=None))
    assert mb.increment_cache_lengths(ib).cache_lengths.tolist() == [2]


def test_num_pages_and_a_byte_budget_together_are_refused():
    """Before: num_pages won silently, allocating past the budget given beside it."""
    params = KVCacheParams("float32", H, D, "paged", page_size=P)
    one_page = params.bytes_per_page(2)
    for call in (lambda: PagedKVCacheManager(params, 2, 16, 2, num_pages=50,
                                             available_cache_memory=10 * one_page),
                 lambda: PagedKVCacheManager.estimated_memory_size(
                     params, 2, 16, 2, num_pages=50, available_cache_memory=10 * one_page)):
        with pytest.raises(InvalidArgumentError, match="num_pages / available_cache_memory"):
            call()


def test_a_default_pool_past_int32_page_ids_is_refused():
    """Before: max_batch_size x pages per sequence past 2**31 went to the allocator (page ids
    past int32 would have wrapped in the tables had it succeeded)."""
    params = KVCacheParams("float16", 1, 1, "paged", page_size=1)
    # (the estimate alone: without the check the constructor would try to allocate 16 GB)
    with pytest.raises(InvalidArgumentError, match="num_pages"):
        PagedKVCacheManager.estimated_memory_size(params, 1 << 20, 1 << 12, 1)
