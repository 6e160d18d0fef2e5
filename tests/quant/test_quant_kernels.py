"""The CPU kernels over quantized caches (kvtvm.kernels.append_quant, and the decode / prefill
families' storage-aware loads, kvtvm.kernels.quant_access): append writes exactly the reference bytes, decode/prefill equal attention over the
reference-dequantized K/V, through the ops and through the managers (pop + re-append, fork),
and the typed refusals."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from kvtvm import KVCacheParams, ops
from kvtvm.compiler import KernelSpec
from kvtvm.compiler.knobs import schedule_module_name
from kvtvm.errors import DTypeMismatchError, InvalidArgumentError
from kvtvm.inputs import BatchItem
from kvtvm.kernels.reference import reference_append, reference_decode, reference_prefill
from kvtvm.manager import PagedKVCacheManager
from kvtvm.quant import quant_row_bytes, quantize_rows
from helpers import append_writes_reference_bytes, numpy_of as _np, ragged_batch

#: max |kernel - reference over the dequantized cache| of the outputs, per q dtype
TOL = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}


def _tdt(name):
    return getattr(torch, name)


def _cache(rng, storage, dtype, shape, D):
    """A random cache view: quantized rows of random data (garbage in the padding for an
    8-bit view, so a kernel that skips it is caught), or ``dtype`` rows."""
    if not storage:
        return torch.from_numpy(rng.standard_normal(shape + (D,)).astype(np.float32)).to(
            _tdt(dtype))
    x = rng.standard_normal(shape + (D,)).astype(np.float32) \
        * rng.uniform(0.05, 4, shape[:1] + (1,) * len(shape))
    rows = quantize_rows(x, storage).view(np.int8)
    return torch.from_numpy(rows).view(_tdt(storage))


def _special_rows(rng, n, H, D, dtype):
    """Random rows with an outlier channel, an all-zero row, a -0.0 row, a subnormal row,
    NaN and inf rows mixed in (float32 first, then cast)."""
    x = (rng.standard_normal((n, H, D)) * rng.uniform(1e-3, 50, (n, H, 1))).astype(np.float32)
    x[0, 0] = 0
    x[1 % n, -1, 3] *= 100                      # one channel 100x the rest
    x[2 % n, 0] = -0.0
    if dtype == "float32":
        x[3 % n, -1] = rng.standard_normal(D) * 1e-40   # subnormal amax: inv overflows
    x[4 % n, 0, 5] = np.nan
    x[5 % n, -1, 1] = -np.inf
    return torch.from_numpy(x).to(_tdt(dtype))


def _batch(rng, counts, starts, page_size, spare=3):
    return ragged_batch(rng, counts, starts, page_size, spare)


def _shape(layout, pages, page_size, H):
    return (pages, page_size, H) if layout == "nhd" else (pages, H, page_size)


# (k storage, v storage, dtype, layout, page_size, H, head_dim)
APPEND_CASES = [
    ("int8", "int8", "float32", "nhd", 16, 2, 64),
    ("float8_e4m3fn", "float8_e4m3fn", "float16", "hnd", 1, 3, 128),
    ("int8", "float8_e4m3fn", "bfloat16", "nhd", 300, 2, 64),
    ("float8_e4m3fn", "", "float32", "nhd", 16, 1, 128),
]


@pytest.mark.parametrize("ks,vs,dtype,layout,page_size,H,D", APPEND_CASES)
def test_append_writes_the_reference_bytes(ks, vs, dtype, layout, page_size, H, D):
    rng = np.random.default_rng(7)
    counts, starts = [5, 1, 9], [3, 17, 0]
    pages, indptr, lengths, table = _batch(rng, counts, starts, page_size)
    shape = _shape(layout, pages, page_size, H)
    kc, vc = _cache(rng, ks, dtype, shape, D), _cache(rng, vs, dtype, shape, D)
    if ks:  # garbage in the whole rows, padding included
        kc.view(torch.int8).copy_(torch.from_numpy(
            rng.integers(-128, 128, kc.shape, dtype=np.int8)))
    k, v = _special_rows(rng, sum(counts), H, D, dtype), _special_rows(rng, sum(counts), H, D,
                                                                        dtype)
    append_writes_reference_bytes(kc, vc, k, v, indptr, lengths, table, layout)


def test_parallel_append_writes_the_reference_bytes():
    """A large append runs the parallel kernel (the variant the ops pick above 8 MiB)."""
    rng = np.random.default_rng(3)
    H, D, page_size = 8, 128, 16
    pages, indptr, lengths, table = _batch(rng, [2100], [0], page_size, spare=0)
    shape = _shape("nhd", pages, page_size, H)
    kc, vc = _cache(rng, "int8", "float32", shape, D), _cache(rng, "float8_e4m3fn", "float32",
                                                              shape, D)
    k, v = _special_rows(rng, 2100, H, D, "float32"), _special_rows(rng, 2100, H, D, "float32")
    assert 2 * k.numel() * 4 >= ops.append.CPU_PARALLEL_APPEND_BYTES
    want_k, want_v = reference_append(_np(kc), _np(vc), k.numpy(), v.numpy(), indptr.numpy(),
                                      lengths.numpy(), table.numpy())
    ops.append_kv(kc, vc, k, v, indptr, lengths, table)
    np.testing.assert_array_equal(kc.view(torch.uint8).numpy(), want_k.view(np.uint8))
    np.testing.assert_array_equal(vc.view(torch.uint8).numpy(), want_v.view(np.uint8))


# (k storage, v storage, dtype, layout, page_size, H, G, head_dim)
ATTN_CASES = [
    ("int8", "int8", "float32", "nhd", 16, 2, 4, 128),
    ("float8_e4m3fn", "float8_e4m3fn", "float16", "hnd", 1, 2, 1, 64),
    ("int8", "float8_e4m3fn", "float32", "nhd", 300, 1, 8, 64),
    ("int8", "", "bfloat16", "nhd", 16, 4, 2, 128),
]


def _full_precision_bound(ks, vs):
    """Stated bound of max |quantized-cache decode - float32-cache decode| for standard normal
    K/V/q, head_dim 128, 90-200 tokens (measured: int8 0.0055, fp8 0.023, outputs up to 0.53)."""
    return 0.08 if "float8_e4m3fn" in (ks, vs) else 0.02


@pytest.mark.parametrize("ks,vs,dtype,layout,page_size,H,G,D", ATTN_CASES)
def test_decode_equals_attention_over_the_dequantized_cache(ks, vs, dtype, layout, page_size,
                                                            H, G, D):
    rng = np.random.default_rng(11)
    starts = [0, 40, 333, 7]
    pages, _, lengths, table = _batch(rng, [1] * 4, starts, page_size)
    shape = _shape(layout, pages, page_size, H)
    kc, vc = _cache(rng, ks, dtype, shape, D), _cache(rng, vs, dtype, shape, D)
    q = torch.from_numpy(rng.standard_normal((4, H * G, D)).astype(np.float32)).to(_tdt(dtype))
    want, want_lse = reference_decode(_np(q), _np(kc), _np(vc), lengths.numpy(),
                                      table.numpy(), layout=layout)
    for splits in (1, 3):
        out, lse = ops.decode_attention(q, kc, vc, lengths, table, layout=layout,
                                        num_splits=splits)
        np.testing.assert_allclose(out.float().numpy(), want, atol=TOL[dtype], rtol=0)
        np.testing.assert_allclose(lse.numpy(), want_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("ks,vs,dtype,layout,page_size,H,G,D", ATTN_CASES)
def test_prefill_equals_attention_over_the_dequantized_cache(ks, vs, dtype, layout, page_size,
                                                             H, G, D):
    rng = np.random.default_rng(12)
    counts, starts = [7, 1, 30], [0, 45, 20]
    pages, indptr, lengths, table = _batch(rng, counts, starts, page_size)
    shape = _shape(layout, pages, page_size, H)
    kc, vc = _cache(rng, ks, dtype, shape, D), _cache(rng, vs, dtype, shape, D)
    q = torch.from_numpy(rng.standard_normal((sum(counts), H * G, D)).astype(
        np.float32)).to(_tdt(dtype))
    for causal in (True, False):
        want, want_lse = reference_prefill(_np(q), _np(kc), _np(vc), indptr.numpy(),
                                           lengths.numpy(), table.numpy(), layout=layout,
                                           causal=causal)
        out, lse = ops.prefill_attention(q, kc, vc, indptr, lengths, table, layout=layout,
                                         causal=causal)
        np.testing.assert_allclose(out.float().numpy(), want, atol=TOL[dtype], rtol=0)
        np.testing.assert_allclose(lse.numpy(), want_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("storage", ["int8", "float8_e4m3fn"])
def test_quantized_attention_is_near_full_precision(storage):
    """Append real float32 rows through the quantizing kernel, then decode: within the stated
    bound of attention over the unquantized rows."""
    rng = np.random.default_rng(5)
    H, G, D, page_size = 2, 4, 128, 16
    pages, indptr, lengths0, table = _batch(rng, [200, 90], [0, 0], page_size)
    shape = _shape("nhd", pages, page_size, H)
    kq, vq = (torch.zeros(shape + (quant_row_bytes(D),), dtype=torch.int8).view(_tdt(storage))
              for _ in range(2))
    kf, vf = (torch.zeros(shape + (D,)) for _ in range(2))
    k = torch.from_numpy(rng.standard_normal((290, H, D)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((290, H, D)).astype(np.float32))
    ops.append_kv(kq, vq, k, v, indptr, lengths0, table)
    ops.append_kv(kf, vf, k, v, indptr, lengths0, table)
    q = torch.from_numpy(rng.standard_normal((2, H * G, D)).astype(np.float32))
    lengths = torch.tensor([199, 89], dtype=torch.int32)
    got, _ = ops.decode_attention(q, kq, vq, lengths, table)
    full, _ = ops.decode_attention(q, kf, vf, lengths, table)
    err = float((got - full).abs().max())
    assert 0 < err <= _full_precision_bound(storage, storage)


FORMATS = [dict(cache_dtype="int8"), dict(cache_dtype="float8_e4m3fn"),
           dict(k_cache_dtype="int8", v_cache_dtype="float8_e4m3fn", skip_layers=(0,)),
           dict(k_cache_dtype="float8_e4m3fn")]


def _kernel_step(m, batch, rng, L, check=None):
    """Append random rows for ``batch`` through the kernels, then attention per layer,
    compared with the reference over the same views when ``check``."""
    (inp,) = m.fetch(batch)
    n = int(inp.qo_indptr_host[-1])
    H, D = m.device_params.n_kv_heads, m.device_params.head_dim
    for layer in range(L):
        k = torch.from_numpy(rng.standard_normal((n, H, D)).astype(np.float32))
        v = torch.from_numpy(rng.standard_normal((n, H, D)).astype(np.float32))
        q = torch.from_numpy(rng.standard_normal((n, 2 * H, D)).astype(np.float32))
        kc, vc = inp.k_cache(layer), inp.v_cache(layer)
        ops.append_kv(kc, vc, k, v, inp.qo_indptr, inp.cache_lengths, inp.lookup_table)
        if check:
            out, _ = ops.prefill_attention(q, kc, vc, inp.qo_indptr, inp.cache_lengths,
                                           inp.lookup_table)
            want, _ = reference_prefill(q.numpy(), _np(kc), _np(vc), inp.qo_indptr_host,
                                        inp.cache_lengths_host, inp.lookup_table.numpy())
            np.testing.assert_allclose(out.numpy(), want, atol=TOL["float32"], rtol=0)
    m.step(batch)


@pytest.mark.parametrize("fmt", FORMATS)
def test_pop_reappend_and_fork_through_the_kernels(fmt):
    """Random page tables from the manager, pages crossing; pop + re-append gives identical
    bytes; a fork's pages are copied bit for bit and diverge only where the child writes."""
    L = 2
    rng = np.random.default_rng(0)
    p = KVCacheParams("float32", 2, 64, "paged", page_size=4, **fmt)
    m = PagedKVCacheManager(p, 3, 32, L)
    (sid,) = m.claim(1)
    _kernel_step(m, [BatchItem(sid, list(range(6)))], rng, L, check=True)
    _kernel_step(m, [BatchItem(sid, [7, 8, 9])], np.random.default_rng(1), L, check=True)
    after = m.blocks[0].clone()
    m.pop(sid, 3)
    _kernel_step(m, [BatchItem(sid, [7, 8, 9])], np.random.default_rng(1), L)
    assert torch.equal(after, m.blocks[0])
    child = m.fork(sid)
    _kernel_step(m, [BatchItem(child, [5, 6])], np.random.default_rng(2), L, check=True)
    _kernel_step(m, [BatchItem(sid, [4]), BatchItem(child, [3])], np.random.default_rng(3), L,
                 check=True)


def test_a_view_of_another_params_or_type_is_refused_and_nothing_written():
    rng = np.random.default_rng(1)
    pages, indptr, lengths, table = _batch(rng, [3], [0], 16)
    kc = _cache(rng, "int8", "float32", (pages, 16, 2), 128)          # rows of head_dim 128
    vc = _cache(rng, "int8", "float32", (pages, 16, 2), 128)
    before = kc.clone()
    k = torch.randn(3, 2, 64)                                           # a call of head_dim 64
    with pytest.raises(InvalidArgumentError, match=r"k_cache.shape\[-1\].*144"):
        ops.append_kv(kc, vc, k, k, indptr, lengths, table)
    with pytest.raises(DTypeMismatchError, match="k_cache dtype"):
        ops.append_kv(kc.view(torch.uint8), vc, torch.randn(3, 2, 128), torch.randn(3, 2, 128),
                      indptr, lengths, table)
    with pytest.raises(InvalidArgumentError, match="v_cache.shape"):
        ops.decode_attention(torch.randn(1, 2, 128), kc, vc[:-1], lengths, table)
    # head_dim 0 (16-byte rows: only a scale) and an empty page axis: named, not a crash
    empty = torch.zeros(pages, 16, 2, 16, dtype=torch.int8)
    with pytest.raises(InvalidArgumentError, match=r"q.shape\[2\] \(head_dim\)"):
        ops.decode_attention(torch.randn(1, 2, 0), empty, empty.clone(), lengths, table)
    with pytest.raises(InvalidArgumentError, match="page_size"):
        ops.append_kv(kc[:, :0], vc[:, :0], torch.randn(3, 2, 128), torch.randn(3, 2, 128),
                      indptr, lengths, table)
    assert torch.equal(kc.view(torch.uint8), before.view(torch.uint8))


def test_targets_without_quantized_kernels_are_refused_by_name():
    from kvtvm.ops.quant import check_quant_cache_pair, check_quant_target

    kc = torch.zeros(2, 4, 1, quant_row_bytes(64), dtype=torch.float8_e4m3fn)
    pair = check_quant_cache_pair(kc, kc, "nhd", "float16", 64)
    cuda = torch.device("cuda", 0)
    for op in ("append", "decode", "prefill"):
        check_quant_target(torch.device("cpu"), pair, op)
    # CUDA: append, decode and prefill have kernels
    for op in ("append", "decode", "prefill"):
        check_quant_target(cuda, pair, op)
    k_only = check_quant_cache_pair(kc, torch.zeros(2, 4, 1, 64, dtype=torch.float16), "nhd",
                                    "float16", 64)
    check_quant_target(torch.device("cpu"), k_only, "decode")
    # the CUDA append, decode and prefill take either side either way
    for op in ("append", "decode", "prefill"):
        check_quant_target(cuda, k_only, op)


def test_kernel_spec_storage_names_and_refusals():
    s = KernelSpec("decode", "float16", 128, 8, 4, k_storage="int8", v_storage="float16")
    assert s.quantized and s.v_storage == "" and s.uri.endswith("_ki8_vfull")
    # decode is defined (and scheduled on the CPU) once for every storage type
    assert s.family_module == "kvtvm.kernels.decode"
    assert schedule_module_name(s) == "decode.cpu"
    assert schedule_module_name(replace(s, target="cuda", arch="sm_90a")) == "decode.cuda_quant"
    a = KernelSpec("append", "float16", 128, 8, k_storage="int8")
    assert a.family_module == "kvtvm.kernels.append_quant"
    assert schedule_module_name(a) == "append.cpu_quant"
    assert s.file_name() != KernelSpec("decode", "float16", 128, 8, 4).file_name()
    with pytest.raises(InvalidArgumentError, match="k_storage"):
        KernelSpec("decode", "float16", 128, 8, 4, k_storage="int4")
    with pytest.raises(InvalidArgumentError, match="copy"):
        KernelSpec("copy", "float16", 128, 8, k_storage="int8")


@pytest.mark.parametrize("table,what", [([[1, 9], [3, 4]], "lookup_table"),
                                        ([[1, -2], [3, 4]], "lookup_table")])
def test_unchecked_quantized_calls_skip_bad_pages_and_raise(table, what):
    """With ``check_indices=False`` the quantizing append and the quantized attention skip an
    out-of-range page (nothing outside the views is touched) and raise afterwards."""
    from kvtvm.errors import KernelIndexError

    rng = np.random.default_rng(2)
    H, D, ps, pages, guard = 2, 64, 4, 6, 2
    whole = torch.from_numpy(rng.integers(-128, 128, (pages + 2 * guard, 2, ps, H,
                                                      quant_row_bytes(D)), dtype=np.int8))
    before = whole.clone()
    cache = whole[guard:guard + pages]
    kc, vc = cache[:, 0], cache[:, 1].view(torch.float8_e4m3fn)
    indptr = torch.tensor([0, 6, 8], dtype=torch.int32)
    lengths = torch.tensor([0, 1], dtype=torch.int32)
    tab = torch.tensor(table, dtype=torch.int32)
    k, v = torch.randn(8, H, D), torch.randn(8, H, D)
    want_k, _ = reference_append(kc.numpy(), _np(vc), k.numpy(), v.numpy(), indptr.numpy(),
                                 lengths.numpy(), tab.numpy())
    with pytest.raises(KernelIndexError, match=what):
        ops.append_kv(kc, vc, k, v, indptr, lengths, tab, check_indices=False)
    assert torch.equal(whole[:guard], before[:guard]) and torch.equal(whole[-guard:],
                                                                      before[-guard:])
    np.testing.assert_array_equal(kc.numpy(), want_k)
    with pytest.raises(KernelIndexError, match=what):
        ops.decode_attention(torch.randn(2, 2 * H, D), kc, vc, torch.tensor(
            [6, 1], dtype=torch.int32), tab, check_indices=False)
    with pytest.raises(KernelIndexError, match=what):
        ops.prefill_attention(torch.randn(8, 2 * H, D), kc, vc, indptr, lengths, tab,
                              check_indices=False)


def test_relax_integration_refuses_quantized_caches_by_name():
    from tvm import relax

    from kvtvm.integrations import relax as kr

    p = KVCacheParams("float16", 2, 64, "paged", page_size=16, k_cache_dtype="int8")
    with pytest.raises(DTypeMismatchError, match="params.k_cache_dtype.*int8"):
        kr.kv_input_vars_for(PagedKVCacheManager(p, 2, 64, 2))
    bb = relax.BlockBuilder()
    kc = relax.Var("kc", relax.TensorType((4, 16, 2, quant_row_bytes(64)), "int8"))
    vc = relax.Var("vc", relax.TensorType((4, 16, 2, 64), "float16"))
    k = relax.Var("k", relax.TensorType((3, 2, 64), "float16"))
    tab = [relax.Var(n, relax.TensorType(s, "int32"))
           for n, s in (("i", (2,)), ("c", (1,)), ("t", (1, 4)))]
    with pytest.raises(DTypeMismatchError, match="k_cache dtype.*int8"):
        kr.emit_append_kv(bb, kc, vc, k, k, *tab)


def test_build_command_specs_for_quantized_caches():
    from kvtvm.cli import default_specs

    specs = default_specs("cuda", "sm_80", ["append", "decode", "prefill", "copy"], ["float16"],
                          [128], [8], [4], ["nhd"], cache_dtypes=["none", "float8_e4m3fn"])
    quant = {(s.op, s.k_storage, s.v_storage) for s in specs if s.quantized}
    assert quant == {(op, "float8_e4m3fn", "float8_e4m3fn")
                     for op in ("append", "decode", "prefill")}
    # full precision: 4, and the copy kernel that moves a quantized cache's pages as float32
    # words (a runtime-only machine whose kernels came from this build failed at the first
    # page copy of an 8-bit cache)
    assert sum(not s.quantized for s in specs) == 5
    assert [s.uri for s in specs if s.op == "copy" and s.dtype == "float32"] == \
        ["copy_float32_h1_g1_d4_nhd"]
    cpu = default_specs("llvm", None, ["prefill"], ["float32"], [64], [2], [1], ["hnd"],
                        cache_dtypes=["int8"])
    assert [(s.op, s.k_storage) for s in cpu] == [("prefill", "int8")]


@pytest.mark.parametrize("fmt", [dict(cache_dtype="float8_e4m3fn"),
                                 dict(k_cache_dtype="int8", skip_layers=(1,))])
def test_step_plans_run_quantized_caches_like_the_plain_ops(fmt):
    from helpers import run_step

    L, H, D = 2, 2, 64
    outs = []
    for planned in (False, True):
        p = KVCacheParams("float32", H, D, "paged", page_size=4, **fmt)
        m = PagedKVCacheManager(p, 2, 32, L)
        a, b = m.claim(2)
        rng = np.random.default_rng(9)
        steps = []
        for batch in ([BatchItem(a, list(range(5))), BatchItem(b, list(range(3)))],
                      [BatchItem(a, [5]), BatchItem(b, [3])]):
            n = sum(len(x.tokens) for x in batch)
            qkv = [tuple(torch.from_numpy(rng.standard_normal((n, h, D)).astype(np.float32))
                         for h in (2 * H, H, H)) for _ in range(L)]
            steps.append(run_step(m, batch, qkv, planned))
        outs.append(steps)
    for plain, planned in zip(*outs):
        for (o1, l1), (o2, l2) in zip(plain, planned):
            assert torch.equal(o1, o2) and torch.equal(l1, l2)
