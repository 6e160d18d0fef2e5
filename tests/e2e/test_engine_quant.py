"""kvtvm.engine over 8-bit KV caches: greedy tokens against transformers whose attention
quantizes K/V with kvtvm's reference quantizer (kvtvm.engine.quantref), the
cache's bytes against KVCacheParams, and bad storage arguments refused before any allocation."""

import numpy as np
import pytest

from kvtvm.engine import quantref
from kvtvm.engine import Engine, Request, build_toy_model, reference_tokens
from kvtvm.errors import InvalidArgumentError

pytestmark = pytest.mark.e2e

LAYERS = 2


@pytest.fixture(scope="module")
def toy():
    return build_toy_model(num_layers=LAYERS)


@pytest.fixture(scope="module")
def fake_quant_toy():
    """The same toy weights, its attention quantizing K/V row by row (kvtvm.quant reference)
    as each test sets in ``quantref.state``."""
    model = build_toy_model(num_layers=LAYERS)
    quantref.quantize_attention(model, None, None)
    return model


def _engine(model, cache, **kw):
    e = Engine(model, cache, max_batch_size=3, max_seq_len=64, page_size=16, **kw)
    e.log = lambda s: None
    return e


STORAGE = [  # (engine keywords, K storage, V storage, skipped layers) of the reference
    (dict(cache_dtype="int8"), "int8", "int8", ()),
    (dict(k_cache_dtype="float8_e4m3fn"), "float8_e4m3fn", None, ()),
    (dict(cache_dtype="int8", skip_layers=(-1,)), "int8", "int8", (LAYERS - 1,)),
]


@pytest.mark.parametrize("cache", ["paged", "continuous", "linear"])
@pytest.mark.parametrize("kw,k,v,skip", STORAGE, ids=["int8", "fp8-K-only", "int8-skip-last"])
def test_quantized_engine_matches_fake_quantized_transformers(toy, fake_quant_toy, monkeypatch,
                                                             cache, kw, k, v, skip):
    monkeypatch.setitem(quantref.state, "k", k)
    monkeypatch.setitem(quantref.state, "v", v)
    monkeypatch.setitem(quantref.state, "skip", skip)
    rng = np.random.default_rng(0)
    reqs = [Request(i, rng.integers(3, 1000, 14 + 9 * i).tolist(), 8, arrival=i)
            for i in range(3)]
    e = _engine(toy, cache, max_step_tokens=24, **kw)   # chunked prefill and mixed steps
    e.serve(reqs)
    assert e.params.quantized
    plain = 0
    for r in reqs:
        assert r.status == "done"
        assert r.output == reference_tokens(fake_quant_toy, r.prompt, 8), r.rid
        plain += r.output != reference_tokens(toy, r.prompt, 8)
    # quantizing every layer changes tokens of these prompts (request 1 with either storage),
    # so the equality above tells a quantized cache from a full-precision one
    if not skip:
        assert plain > 0


@pytest.mark.parametrize("cache", ["paged", "continuous", "linear"])
def test_int8_cache_bytes_are_bytes_per_token(toy, cache):
    full, int8 = _engine(toy, cache), _engine(toy, cache, cache_dtype="int8")
    bpt_full = full.params.bytes_per_token(LAYERS)
    bpt_int8 = int8.params.bytes_per_token(LAYERS)
    # 2 heads x (K, V) x 2 layers rows: float32 32 x 4 bytes; int8 32 bytes + a float32 scale,
    # padded to 16 bytes
    assert (bpt_full, bpt_int8) == (2 * 2 * LAYERS * 128, 2 * 2 * LAYERS * 48)
    tokens = (full.kv.mgr.num_pages * 16 if cache == "paged" else 3 * 64)
    # same tables, so the allocations differ by exactly the cache tensor's bytes
    assert (full.stats.allocated_bytes - int8.stats.allocated_bytes
            == tokens * (bpt_full - bpt_int8))
    req = Request(0, list(range(5, 25)), 4)
    int8.serve([req])
    assert int8.stats.peak_live_bytes == (
        (int8.params.pages_for_tokens(23) * 16 if cache == "paged" else 23) * bpt_int8)


@pytest.mark.parametrize("kw,name", [(dict(cache_dtype="int4"), "cache_dtype"),
                                     (dict(v_cache_dtype="float16"), "v_cache_dtype"),
                                     (dict(skip_layers=(0, 0)), "skip_layers"),
                                     (dict(cache_dtype="int8", skip_layers=(5,)), "skip_layers")])
def test_bad_storage_is_refused_before_allocation(toy, monkeypatch, kw, name):
    import kvtvm.engine.core as core

    def no_cache(*a, **k):
        raise AssertionError("a cache was built")

    if name != "skip_layers" or "cache_dtype" not in kw:
        monkeypatch.setattr(core, "make_cache", no_cache)
    with pytest.raises(InvalidArgumentError, match=name):
        Engine(toy, "paged", **kw)


def test_quantized_reference_sets_the_cache_storage_then_restores(toy):
    from kvtvm.engine import quantized_reference

    before, state = toy.config._attn_implementation, dict(quantref.state)
    e = _engine(toy, "continuous", k_cache_dtype="int8", v_cache_dtype="float8_e4m3fn",
                skip_layers=(-1,))
    with quantized_reference(toy, e.params) as model:
        assert model.config._attn_implementation == quantref.ATTN_NAME
        assert quantref.state == {"k": "int8", "v": "float8_e4m3fn", "skip": (LAYERS - 1,)}
    assert toy.config._attn_implementation == before and quantref.state == state


@pytest.mark.parametrize("kw", [dict(cache_dtype="int8"), dict(cache_dtype="float8_e4m3fn"),
                                dict(k_cache_dtype="int8", v_cache_dtype="float8_e4m3fn"),
                                dict(v_cache_dtype="int8"), dict(k_cache_dtype="float8_e4m3fn")])
def test_8bit_cache_on_cuda_has_every_kernel(kw):
    """K and V 8-bit, or one side only (K-only, V-only): CUDA has the append, prefill and
    decode over them."""
    import torch

    from kvtvm.engine.core import _check_quantized_kernels
    from kvtvm.params import KVCacheParams

    _check_quantized_kernels(KVCacheParams("float16", 2, 64, "paged", page_size=16, **kw),
                             torch.device("cuda"))
