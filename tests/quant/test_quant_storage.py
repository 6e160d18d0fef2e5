"""Quantized cache storage: params, exact memory arithmetic, manager allocation, per-layer
views, page copies, prefix keys, rollback/fork exactness (kvtvm.params, kvtvm.storage,
kvtvm.manager)."""

import itertools

import numpy as np
import pytest
import torch

from kvtvm import KVCacheParams
from kvtvm.errors import DTypeMismatchError, InvalidArgumentError
from kvtvm.inputs import BatchItem
from kvtvm.kernels.reference import reference_append
from kvtvm.manager import (ContinuousBatchingKVCacheManager, LinearKVCache,
                           PagedKVCacheManager)
from kvtvm.quant import QMAX, quant_row_bytes, quantize_rows, row_scales
from kvtvm.storage import split_rows, view_storage
from helpers import numpy_of as _np

FORMATS = [dict(cache_dtype="int8"), dict(cache_dtype="float8_e4m3fn"),
           dict(k_cache_dtype="int8"),                                  # K-only
           dict(k_cache_dtype="int8", v_cache_dtype="float8_e4m3fn"),
           dict(cache_dtype="int8", skip_layers=(0, -1)), dict()]


def _tensor(m):
    """One device's cache tensor of any manager."""
    return m.get_kv_cache_buffer(0) if isinstance(m, LinearKVCache) else m.blocks[0]


def _inputs(m):
    """Step inputs of one new sequence of 3 tokens, for any manager."""
    if isinstance(m, LinearKVCache):
        m.reset_for_new_sequences([0])
        return m.step_inputs(3)[0]
    (sid,) = m.claim(1)
    return m.fetch([BatchItem(sid, [1, 2, 3])])[0]


def _managers(fmt, *, dtype="float32", H=2, D=64, page_size=4, L=3, B=2, S=24, prefix=False):
    paged = KVCacheParams(dtype, H, D, "paged", page_size=page_size,
                          enable_prefix_caching=prefix, **fmt)
    cont = KVCacheParams(dtype, H, D, "continuous", **fmt)
    lin = KVCacheParams(dtype, H, D, "linear", **fmt)
    return [PagedKVCacheManager(paged, B, S, L), ContinuousBatchingKVCacheManager(cont, B, S, L),
            LinearKVCache(lin, B, S, L)]


def test_defaults_change_nothing():
    p = KVCacheParams("float16", 4, 64, "paged", page_size=16)
    assert (p.cache_dtype, p.k_cache_dtype, p.v_cache_dtype) == ("float16",) * 3
    assert not p.quantized and p.tensor_dtype == "float16"
    assert p.bytes_per_token(2) == 2 * 2 * 4 * 64 * 2
    assert p.cache_shape(2, 1, 16, num_pages=3) == (3, 2, 2, 16, 4, 64)


def test_bad_params_name_the_argument():
    with pytest.raises(InvalidArgumentError, match="cache_dtype"):
        KVCacheParams("float32", 2, 64, "paged", page_size=4, cache_dtype="int4")
    with pytest.raises(InvalidArgumentError, match="v_cache_dtype"):
        KVCacheParams("float32", 2, 64, "paged", page_size=4, v_cache_dtype="float16")
    with pytest.raises(InvalidArgumentError, match="skip_layers"):
        KVCacheParams("float32", 2, 64, "paged", page_size=4, skip_layers=(1, 1))
    with pytest.raises(InvalidArgumentError, match="skip_layers"):
        KVCacheParams("float32", 2, 64, "paged", page_size=4, skip_layers=3)
    p = KVCacheParams("float32", 2, 64, "paged", page_size=4, cache_dtype="int8",
                      skip_layers=(0, 3))
    with pytest.raises(InvalidArgumentError, match="skip_layers"):
        PagedKVCacheManager(p, 1, 8, 3)
    with pytest.raises(InvalidArgumentError, match="skip_layers"):   # 2 and -1 alias
        PagedKVCacheManager(p.__class__("float32", 2, 64, "paged", page_size=4,
                                        cache_dtype="int8", skip_layers=(2, -1)), 1, 8, 3)
    assert KVCacheParams("float32", 2, 64, "paged", page_size=4, cache_dtype="fp8"
                         ).cache_dtype == "float8_e4m3fn"



@pytest.mark.parametrize("skip", [1.5, object(), 2, "0", b"0", [0, 1.0], [np.float32(0)],
                                  [np.bool_(True)], [None]])
def test_skip_layers_of_a_wrong_type_is_a_typed_error(skip):
    with pytest.raises(InvalidArgumentError, match="skip_layers"):
        KVCacheParams("float32", 2, 64, "paged", page_size=4, cache_dtype="int8",
                      skip_layers=skip)


def test_skip_layers_takes_numpy_ints_and_none():
    p = KVCacheParams("float32", 2, 64, "paged", page_size=4, cache_dtype="int8",
                      skip_layers=np.array([-1, 0]))
    assert p.skip_layers == (-1, 0) and all(type(i) is int for i in p.skip_layers)
    assert hash(p) == hash(p.__class__("float32", 2, 64, "paged", page_size=4,
                                       cache_dtype="int8", skip_layers=(0, -1)))
    assert KVCacheParams("float32", 2, 64, "paged", page_size=4, cache_dtype="int8",
                         skip_layers=None).skip_layers == ()


GRID = list(itertools.product(
    ["float32", "float16"], FORMATS, [1, 5, 16], [1, 3], [40, 64, 128]))


@pytest.mark.parametrize("dtype,fmt,page_size,H,D", GRID)
def test_memory_arithmetic_equals_allocation(dtype, fmt, page_size, H, D):
    L, B, S = 3, 2, 33
    mgrs = _managers(fmt, dtype=dtype, H=H, D=D, page_size=page_size, L=L, B=B, S=S)
    for m in mgrs:
        cls, p = type(m), m.params
        est = cls.estimated_memory_size(p, B, S, L)
        assert est == m.device_nbytes()
        t = _tensor(m)
        pages = getattr(m, "num_pages", None)
        assert t.numel() * t.element_size() == p.cache_bytes(L, B, S, num_pages=pages)
        assert str(t.dtype) == "torch." + p.tensor_dtype
        for mem in (est, 3 * est + 7):
            b = cls.infer_optimal_batch_size(p, S, L, mem)
            assert cls.estimated_memory_size(p, b, S, L) <= mem
            assert cls.estimated_memory_size(p, b + 1, S, L) > mem
    p = mgrs[0].params
    rows = [p.row_bytes(p.storage(layer, kv, L)) for kv in (0, 1) for layer in range(L)]
    assert p.bytes_per_token(L) == H * sum(rows)
    assert p.bytes_per_page(L) == page_size * H * sum(rows)
    assert _tensor(mgrs[0]).numel() * _tensor(mgrs[0]).element_size() == \
        mgrs[0].num_pages * p.bytes_per_page(L)
    if p.quantized:
        assert all(r % 16 == 0 for r in rows)
        q = [r for kv in (0, 1) for layer in range(L) for r in [p.row_bytes(
            p.storage(layer, kv, L))] if p.storage(layer, kv, L) in ("int8", "float8_e4m3fn")]
        assert all(r == quant_row_bytes(D) for r in q)


@pytest.mark.parametrize("fmt", FORMATS[:5])
def test_views_tile_the_cache_aligned_and_typed(fmt):
    L, D = 3, 64
    for m in _managers(fmt, L=L, D=D):
        inp = _inputs(m)
        blocks = inp.blocks
        owner = torch.zeros(blocks.numel(), dtype=torch.int32)
        base = blocks.data_ptr()
        for layer in range(L):
            for kv, view in ((0, inp.k_cache(layer)), (1, inp.v_cache(layer))):
                storage = m.params.storage(layer, kv, L)
                assert str(view.dtype) == "torch." + storage
                assert view_storage("k_cache", view, D, "float32") == storage
                assert view.stride()[-1] == 1
                assert (view.stride()[-2] * view.element_size()) % 16 == 0
                start = (view.data_ptr() - base)
                assert start % 16 == 0
                ix = np.indices(view.shape).reshape(len(view.shape), -1)
                elem = start // view.element_size() + (np.array(view.stride())[:, None]
                                                       * ix).sum(0)
                for byte in range(view.element_size()):
                    pos = torch.from_numpy(elem * view.element_size() + byte)
                    assert (owner[pos] == 0).all()
                    owner[pos] = 1 + kv * L + layer
        if not m.params.skip_layers and m.params.quantized:
            assert (owner > 0).all()          # no padding between segments


def test_quantized_view_rows_split_into_values_and_scale():
    m = _managers(dict(cache_dtype="int8"))[0]
    (sid,) = m.claim(1)
    inp = m.fetch([BatchItem(sid, [1, 2, 3])])[0]
    view = inp.k_cache(1)
    rows = quantize_rows(np.random.default_rng(0).standard_normal((2, 64)), "int8")
    _np(view)[3, 1] = rows
    values, scales = split_rows(view, 64)
    assert values.shape == (*view.shape[:-1], 64) and scales.dtype == torch.float32
    assert scales[3, 1].tolist() == pytest.approx(
        (np.abs(np.random.default_rng(0).standard_normal((2, 64))).max(-1) / 127).tolist())


@pytest.mark.parametrize("storage", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("head_dim", [5, 6, 7, 12])
def test_split_rows_of_any_head_dim(storage, head_dim):
    """Was: a raw torch RuntimeError (no float32 view at byte offset D) for D not a multiple
    of 4, which the params, managers and kernels take."""
    p = KVCacheParams("float32", 2, head_dim, "paged", page_size=4, cache_dtype=storage)
    m = PagedKVCacheManager(p, 1, 16, 1)
    (sid,) = m.claim(1)
    (inp,) = m.fetch([BatchItem(sid, [1, 2, 3])])
    view = inp.k_cache(0)
    x = np.random.default_rng(head_dim).standard_normal((2, head_dim))
    _np(view)[2, 1] = quantize_rows(x, storage)
    values, scales = split_rows(view, head_dim)
    assert values.shape == (*view.shape[:-1], head_dim) and scales.shape == view.shape[:-1]
    assert scales.dtype == torch.float32
    rows = quantize_rows(x, storage)
    assert scales[2, 1].tolist() == row_scales(rows, head_dim).tolist()
    assert scales[2, 1].tolist() == pytest.approx(np.abs(x).max(-1) / QMAX[storage], rel=1e-6)
    assert _np(values)[2, 1].tobytes() == rows[:, :head_dim].tobytes()


def test_view_storage_rejects_foreign_views():
    v = torch.zeros(2, 4, 2, quant_row_bytes(128), dtype=torch.int8)
    with pytest.raises(InvalidArgumentError, match="k_cache.shape"):
        view_storage("k_cache", v, 64, "float32")           # a view made for head_dim 128
    with pytest.raises(DTypeMismatchError, match="float16"):
        view_storage("k_cache", torch.zeros(2, 4, 2, 64, dtype=torch.float16), 64, "float32")


def test_a_view_of_another_head_dim_with_equal_rows_is_refused():
    """head_dim 96 and 100 rows are both 112 bytes: the op still names the foreign view
    (through the view's params), and writes nothing."""
    from kvtvm import ops

    views = {}
    for D in (96, 100):
        m = _managers(dict(cache_dtype="int8"), D=D)[0]
        views[D] = (m, _inputs(m))
    assert quant_row_bytes(96) == quant_row_bytes(100)
    m, inp = views[96]
    before = m.blocks[0].clone()
    k = torch.randn(3, 2, 100)
    with pytest.raises(InvalidArgumentError, match="k_cache.*head_dim=96"):
        ops.append_kv(inp.k_cache(0), inp.v_cache(0), k, k, inp.qo_indptr, inp.cache_lengths,
                      inp.lookup_table)
    with pytest.raises(InvalidArgumentError, match="v_cache.*head_dim=100"):
        ops.append_kv(inp.k_cache(0), views[100][1].v_cache(0), torch.randn(3, 2, 96),
                      torch.randn(3, 2, 96), inp.qo_indptr, inp.cache_lengths,
                      inp.lookup_table)
    with pytest.raises(InvalidArgumentError, match="k_cache.*head_dim=96"):
        ops.decode_attention(torch.randn(1, 4, 100), inp.k_cache(1), inp.v_cache(1),
                             inp.cache_lengths, inp.lookup_table)
    with pytest.raises(InvalidArgumentError, match="k_cache.*head_dim=96"):
        ops.prefill_attention(torch.randn(3, 2, 100), inp.k_cache(1), inp.v_cache(1),
                              inp.qo_indptr, inp.cache_lengths, inp.lookup_table)
    assert torch.equal(before, m.blocks[0])
    ops.append_kv(inp.k_cache(0), inp.v_cache(0), torch.randn(3, 2, 96), torch.randn(3, 2, 96),
                  inp.qo_indptr, inp.cache_lengths, inp.lookup_table)   # its own head_dim


def _append_step(m, batch, rng, L, D=64):
    """Append random rows for ``batch`` through the reference (on the manager's views)."""
    (inp,) = m.fetch(batch)
    n = int(inp.qo_indptr_host[-1])
    H = m.device_params.n_kv_heads
    for layer in range(L):
        k = rng.standard_normal((n, H, D)).astype(np.float32)
        v = rng.standard_normal((n, H, D)).astype(np.float32)
        kc, vc = _np(inp.k_cache(layer)), _np(inp.v_cache(layer))
        ko, vo = reference_append(kc, vc, k, v, inp.qo_indptr_host, inp.cache_lengths_host,
                                  inp.lookup_table.numpy(), layout=inp.layout)
        kc[...], vc[...] = ko, vo
    m.step(batch)


@pytest.mark.parametrize("fmt", FORMATS[:4])
def test_pop_and_reappend_gives_identical_bytes(fmt):
    L = 2
    for m in _managers(fmt, L=L, page_size=4)[:1]:
        (sid,) = m.claim(1)
        _append_step(m, [BatchItem(sid, list(range(6)))], np.random.default_rng(0), L)
        before = m.blocks[0].clone()
        _append_step(m, [BatchItem(sid, [7, 8, 9])], np.random.default_rng(1), L)
        m.pop(sid, 3)
        _append_step(m, [BatchItem(sid, [7, 8, 9])], np.random.default_rng(1), L)
        after = m.blocks[0].clone()
        m.pop(sid, 3)
        _append_step(m, [BatchItem(sid, [7, 8, 9])], np.random.default_rng(1), L)
        assert torch.equal(after, m.blocks[0])
        assert not torch.equal(before, after)


@pytest.mark.parametrize("fmt", [dict(cache_dtype="int8"),
                                 dict(k_cache_dtype="float8_e4m3fn", skip_layers=(1,))])
def test_fork_copy_on_write_copies_bytes(fmt):
    L = 2
    seen = []

    def copier(blocks, src, dst):                      # what the kernel copier gets
        seen.append((blocks.dtype, tuple(blocks.shape)))
        blocks[dst.long()] = blocks[src.long()]

    p = KVCacheParams("float32", 2, 64, "paged", page_size=4, **fmt)
    m = PagedKVCacheManager(p, 3, 24, L, page_copier=copier)
    (sid,) = m.claim(1)
    _append_step(m, [BatchItem(sid, list(range(6)))], np.random.default_rng(0), L)
    child = m.fork(sid)
    _append_step(m, [BatchItem(child, [9])], np.random.default_rng(5), L)
    assert seen and seen[0][0] == torch.float32 and seen[0][1][1:4] == (1, 1, 1) and seen[0][1][5] == 4
    (inp,) = m.fetch([BatchItem(sid, [6]), BatchItem(child, [10])])
    table = inp.lookup_table.numpy()
    assert table[0, 1] != table[1, 1]                  # the tail page was copied
    for layer in range(L):
        for view in (inp.k_cache(layer), inp.v_cache(layer)):
            a = view[table[0, 1]].view(torch.uint8) if view.element_size() == 1 else \
                view[table[0, 1]]
            b = view[table[1, 1]].view(torch.uint8) if view.element_size() == 1 else \
                view[table[1, 1]]
            assert torch.equal(a[:2], b[:2])           # tokens 4, 5 copied bit for bit
            assert not torch.equal(a[2], b[2])         # token 6: the child's own row


def test_prefix_keys_include_the_storage_format():
    keys = set()
    for fmt in FORMATS:
        p = KVCacheParams("float32", 2, 64, "paged", page_size=4, enable_prefix_caching=True,
                          **fmt)
        keys.add(p.storage_key(3))
        m = PagedKVCacheManager(p, 2, 16, 3)
        assert m._prefix.root == p.storage_key(3)
    assert len(keys) == len(FORMATS)
    a = KVCacheParams("float32", 2, 64, "paged", page_size=4, cache_dtype="int8",
                      skip_layers=(0,))
    assert a.storage_key(3) != a.__class__("float32", 2, 64, "paged", page_size=4,
                                           cache_dtype="int8", skip_layers=(1,)).storage_key(3)
    # every layer skipped: full-precision rows, but padded byte rows -- not the plain format
    skipped = a.__class__("float16", 2, 3, "paged", page_size=4, cache_dtype="int8",
                          skip_layers=(0, -1))
    plain = a.__class__("float16", 2, 3, "paged", page_size=4)
    assert skipped.bytes_per_page(2) != plain.bytes_per_page(2)
    assert skipped.storage_key(2) != plain.storage_key(2)
    # the same format still hits
    m = _managers(dict(cache_dtype="int8"), prefix=True)[0]
    (s1,) = m.claim(1)
    _append_step(m, [BatchItem(s1, list(range(8)))], np.random.default_rng(0), 3)
    (s2,) = m.claim(1)
    (inp,) = m.fetch([BatchItem(s2, list(range(9)))])
    assert inp.num_cached_tokens[0] == 8


def test_kernel_copiers_move_quantized_bytes_bit_for_bit():
    """The default (kernel) copiers get the float32 word view: random bytes, NaN patterns
    included, arrive unchanged."""
    p = KVCacheParams("float32", 2, 64, "paged", page_size=4, cache_dtype="int8")
    m = PagedKVCacheManager(p, 3, 24, 2)
    m.blocks[0].random_(0, 256)
    before = m.blocks[0].clone()
    m._copy_pages([1, 2], [5, 7])
    after = m.blocks[0]
    assert torch.equal(after[5], before[1]) and torch.equal(after[7], before[2])
    assert torch.equal(after[:5], before[:5])
    lin = LinearKVCache(KVCacheParams("float32", 2, 64, "linear",
                                      k_cache_dtype="float8_e4m3fn"), 4, 8, 2)
    cache = lin.get_kv_cache_buffer(0)
    cache.random_(0, 256)
    before = cache.clone()
    lin.reset_for_new_sequences([1, 1, 1, 1])
    lin.evict([1, 3])
    assert torch.equal(cache[0, 0], before[0, 1]) and torch.equal(cache[0, 1], before[0, 3])
    with pytest.raises(InvalidArgumentError, match="get_kv_cache_for_decoder_layer.*"
                       "k_cache_dtype=float8_e4m3fn, v_cache_dtype=float32"):
        lin.get_kv_cache_for_decoder_layer(0)
