"""Quantized-cache CUDA kernels: the quantizing append and the quantized decode compile with
nvcc for sm_90a and sm_80 (both SASS in the fatbin) without register spills; on a GPU, append
writes the reference bytes (mixed storage, K-only, every row dtype) and decode equals attention
over the reference-dequantized cache (mixed K/V decode: tests/quant/test_quant_decode_mixed_cuda.py;
CUDA prefill over quantized caches: tests/quant/test_quant_prefill_cuda.py)."""

import re
import shutil

import numpy as np
import pytest

from helpers import cuda_available, random_page_table

from kvtvm import compiler

STORAGES = ("int8", "float8_e4m3fn")


def _no_spills(text):
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    assert spills, "no ptxas resource report"
    assert all(int(a) == 0 and int(b) == 0 for a, b in spills), spills
    assert "Registers are spilled" not in text


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("op,ks,vs,D,G,layout", [
    ("decode", "int8", "int8", 128, 4, "nhd"),
    ("decode", "float8_e4m3fn", "int8", 64, 1, "hnd"),
    ("append", "int8", "float8_e4m3fn", 128, 1, "nhd"),
])
def test_quantized_cuda_kernels_build_for_sm90a_and_sm80_without_spills(tmp_path, op, ks, vs,
                                                                        D, G, layout):
    spec = compiler.KernelSpec(op, "float16", D, 8, G, layout=layout, target="cuda",
                               arch="sm_90a", k_storage=ks, v_storage=vs)
    path = compiler.build_spec(spec, tmp_path)
    report = path.with_suffix(".ptxas.txt").read_text()
    _no_spills(report)
    assert "sm_80" in report and "sm_90a" in report


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("storage", STORAGES)
def test_short_splits_variant_is_the_untuned_8bit_decode(tmp_path, storage):
    """The variant the op launches over an 8-bit cache when its KV splits are short: part of
    every ahead-of-time build of an 8-bit CUDA decode (of no other), the schedule's defaults
    whatever the tuning log says, and free of spills."""
    from kvtvm.compiler.knobs import default_knobs, resolve_knobs, tuned_knobs
    from kvtvm.errors import InvalidArgumentError

    spec = compiler.KernelSpec("decode", "float16", 128, 8, 4, target="cuda", arch="sm_90a",
                               k_storage=storage, v_storage=storage)
    tuned, short = compiler.with_runtime_variants(spec)
    assert (tuned.variant, short.variant) == ("", "short_splits")
    assert short.file_name() != tuned.file_name()
    assert tuned_knobs(spec), "the committed sm_90a tuning log of this spec"
    assert resolve_knobs(tuned) == {**default_knobs(spec), **tuned_knobs(spec)}
    assert resolve_knobs(short) == {**default_knobs(spec), "mma_short": 1} \
        != resolve_knobs(tuned)
    full = compiler.KernelSpec("decode", "float16", 128, 8, 4, target="cuda", arch="sm_90a")
    assert [v.variant for v in compiler.with_runtime_variants(full)] == [""]
    with pytest.raises(InvalidArgumentError, match="variant"):
        compiler.KernelSpec("decode", "float16", 128, 8, 4, target="cuda", arch="sm_90a",
                            variant="short_splits")
    path = compiler.build_spec(short, tmp_path)
    _no_spills(path.with_suffix(".ptxas.txt").read_text())


@pytest.mark.parametrize("batch,ctx,want", [(1, 4096, "short_splits"), (2, 2048, "short_splits"),
                                            (1, 32768, ""), (16, 4096, ""), (64, 4096, ""),
                                            (256, 1024, "")])
def test_decode_picks_short_splits_where_the_tuned_8bit_kernel_lost(monkeypatch, batch, ctx,
                                                                    want):
    """At the split counts the op chooses on an H100/H200 (132 SMs): the untuned variant where
    the tuned 8-bit kernel measured slower than float16 (1 x 4K: 128-position splits), the
    tuned kernel where it measured faster; never for full precision or on the CPU."""
    import torch

    from kvtvm.ops import decode

    monkeypatch.setattr(decode, "_multiprocessors", lambda device: 132)
    splits = decode.choose_num_splits(batch, 8, ctx, torch.device("cuda"))
    assert decode.decode_variant("cuda", True, ctx, splits) == want
    assert decode.decode_variant("cuda", False, ctx, splits) == ""
    assert decode.decode_variant("cpu", True, ctx, splits) == ""


def _case(torch, rng, storage, layout, page_size, H, D, lengths):
    from kvtvm.quant import quantize_rows

    table, num_pages = random_page_table(rng, lengths, page_size, spare=2)
    shape = (num_pages, page_size, H, D) if layout == "nhd" else (num_pages, H, page_size, D)
    caches = []
    for _ in range(2):
        x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.1, 4, (num_pages,)
                                                                         + (1,) * 3)
        rows = torch.from_numpy(quantize_rows(x, storage).view(np.int8))
        caches.append(rows.cuda().view(getattr(torch, storage)))
    return caches, torch.from_numpy(table)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("layout,page_size,num_splits", [("nhd", 16, 1), ("nhd", 1, 4),
                                                         ("hnd", 256, 2)])
@pytest.mark.parametrize("longest", [300, 2600])
def test_quantized_decode_cuda_numerics(storage, layout, page_size, num_splits, longest):
    """Both kernels the op picks between: the tuned one, and ``short_splits`` when a split
    holds under ``CUDA_SHORT_SPLIT_TOKENS`` positions."""
    import torch

    from kvtvm import ops
    from kvtvm.kernels.reference import reference_decode
    from kvtvm.ops.decode import decode_variant

    rng = np.random.default_rng(longest)
    H, G, D, lengths = 8, 4, 128, [0, 1, 2 * page_size - 1, longest]
    (kc, vc), table = _case(torch, rng, storage, layout, page_size, H, D, lengths)
    picked = decode_variant("cuda", True, table.shape[1] * page_size, num_splits)
    assert picked == ("short_splits" if longest == 300 else "")
    q = torch.randn(len(lengths), H * G, D, dtype=torch.float16, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32)
    out, lse = ops.decode_attention(q, kc, vc, lens.cuda(), table.cuda(), layout=layout,
                                    num_splits=num_splits)
    host = [t.view(torch.uint8).cpu().numpy().view(np.int8 if storage == "int8" else
                                                  __import__("ml_dtypes").float8_e4m3fn)
            for t in (kc, vc)]
    want, want_lse = reference_decode(q.float().cpu().numpy(), *host, lens.numpy(),
                                      table.numpy(), layout=layout)
    np.testing.assert_allclose(out.float().cpu().numpy(), want, atol=4e-3, rtol=0)
    np.testing.assert_allclose(lse.cpu().numpy(), want_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ks,vs,dtype,layout,H,D", [
    ("int8", "int8", "float16", "nhd", 4, 128),
    ("float8_e4m3fn", "float8_e4m3fn", "float16", "nhd", 4, 128),
    ("int8", "float8_e4m3fn", "bfloat16", "hnd", 4, 64),
    ("float8_e4m3fn", "int8", "float32", "nhd", 4, 128),
    ("int8", "", "float16", "nhd", 4, 128),
])
def test_quantizing_append_cuda_writes_the_reference_bytes(ks, vs, dtype, layout, H, D):
    """Normal rows, zero rows, outliers, NaN/inf rows, tiny rows (amax near 2**-121 and
    2**-114: a subnormal scale is stored as an all-zero row, a normal one kept; no float32
    subnormal values: CUDA flushes them to zero under nvcc's fast math), rows of a bad page
    skipped and flagged; a
    full-precision side (K-only cache) is copied. The bytes equal the reference's, page
    padding and the untouched pages included."""
    import torch

    from kvtvm import ops
    from kvtvm.errors import KernelIndexError
    from kvtvm.kernels.reference import reference_append
    from kvtvm.quant import quant_row_bytes

    rng = np.random.default_rng(1)
    ps, pages = 16, 12

    def cache(storage):
        width = quant_row_bytes(D) if storage else D
        shape = (pages, ps, H, width) if layout == "nhd" else (pages, H, ps, width)
        if storage:
            t = torch.from_numpy(rng.integers(-128, 128, shape, dtype=np.int8)).cuda()
            return t.view(getattr(torch, storage))
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(
            getattr(torch, dtype)).cuda()

    kc, vc = cache(ks), cache(vs)
    n = 40
    x = (rng.standard_normal((2, n, H, D)) * rng.uniform(1e-3, 50, (2, n, H, 1))).astype(
        np.float32)
    x[0, 0, 0] = 0
    x[0, 1, 1, 3] *= 100
    x[1, 2, 0, 5] = np.nan
    x[0, 3, 2, 1] = -np.inf
    x[1, 4, 3, :] = -x[1, 4, 3, :]
    if dtype != "float16":  # tiny rows, all values normal: a subnormal scale, a normal one
        x[:, 5, 1] = rng.choice([-1, 1], (2, D)) * rng.uniform(0.5, 1, (2, D)) * 2.0 ** -121
        x[:, 6, 2] = rng.choice([-1, 1], (2, D)) * rng.uniform(0.5, 1, (2, D)) * 2.0 ** -114
    k, v = (torch.from_numpy(t).to(getattr(torch, dtype)).cuda() for t in x)
    indptr = torch.tensor([0, 25, 40], dtype=torch.int32)
    lengths = torch.tensor([3, 30], dtype=torch.int32)
    table = torch.from_numpy(rng.permutation(pages)[:8].reshape(2, 4).astype(np.int32))

    def host(t):
        import ml_dtypes

        if t.element_size() != 1:
            return t.float().cpu().numpy()
        raw = t.view(torch.uint8).cpu().numpy()
        return raw.view(np.int8 if t.dtype == torch.int8 else ml_dtypes.float8_e4m3fn)

    def raw(t):
        return t.view(torch.uint8).cpu().numpy() if t.element_size() == 1 else host(t)

    want_k, want_v = reference_append(host(kc), host(vc), k.float().cpu().numpy(),
                                      v.float().cpu().numpy(), indptr.numpy(), lengths.numpy(),
                                      table.numpy(), layout=layout)
    ops.append_kv(kc, vc, k, v, indptr.cuda(), lengths.cuda(), table.cuda(), layout=layout)
    for got, want in ((kc, want_k), (vc, want_v)):
        if got.element_size() == 1:
            np.testing.assert_array_equal(raw(got), want.view(np.uint8))
        else:  # the full-precision side: a copy of the rows in the cache's dtype
            np.testing.assert_array_equal(raw(got), want.astype(np.float32))
    # a row on a page outside the pool: skipped, nothing else written, flagged (unchecked mode)
    before = (raw(kc).copy(), raw(vc).copy())
    bad = table.clone()
    bad[1, 3] = pages + 5
    ops.append_kv(kc, vc, k, v, indptr.cuda(), torch.tensor([3, 40], dtype=torch.int32).cuda(),
                  bad.cuda(), layout=layout, check_indices=False)
    with pytest.raises(KernelIndexError):
        ops.check()
    got_k = raw(kc)
    untouched = np.setdiff1d(np.arange(pages), bad.numpy()[:, :3])
    np.testing.assert_array_equal(got_k[untouched], before[0][untouched])
