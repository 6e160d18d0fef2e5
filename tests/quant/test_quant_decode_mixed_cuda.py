"""CUDA decode over a mixed K/V cache (``schedules/decode/cuda_quant.py``): K 8-bit with V at
full precision (K-only), V 8-bit with K full (V-only), K int8 with V float8_e4m3fn.

Here (nvcc, no GPU): the kernels compile for sm_90a and sm_80 without register spills -- a
covering subset by default, every kernel the GPU tests load with ``KVTVM_CUDA_BUILD_GRID=1``
(minutes on 2 cores). On a GPU: decode equals the numpy reference over the same views
(dequantized 8-bit side, the full side as stored) on random page tables, page sizes 1/16/256,
lengths 0 / 1 / crossing pages / 300, one and several KV splits, both layouts, GQA 1/4/8,
head_dim 64/128 (and 48/80/96/112: 3, 5 or 7 words a lane), a sliding window, bfloat16 and
float32 rows, and a page outside the pool is
skipped and flagged. The GPU machine has no compiler: tools/gpu-kit.sh builds exactly
:data:`KIT` (keep them in step).
"""

import itertools
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers import gpu, random_page_table

from kvtvm import compiler

#: (k_storage, v_storage) of the mixed caches; "" is full precision.
COMBOS = [("int8", ""), ("", "int8"), ("float8_e4m3fn", ""), ("int8", "float8_e4m3fn")]
H = 2  # KV heads
#: The kernels the GPU tests load: (k, v, dtype, head_dim, group, layout, features).
GRID = [(ks, vs, "float16", D, G, lay, ())
        for (ks, vs), D, G, lay in itertools.product(COMBOS, (64, 128), (1, 4, 8), ("nhd", "hnd"))]
EXTRA = [("int8", "", "float16", 128, 4, "nhd", ("sliding_window",)),
         ("", "int8", "float16", 128, 4, "nhd", ("sliding_window",)),
         ("int8", "", "bfloat16", 128, 4, "nhd", ()),
         ("", "float8_e4m3fn", "float32", 128, 4, "hnd", ()),
         # not mixed: float32 rows over float8 K and V did not compile (cuda_fp16.h missing)
         ("float8_e4m3fn", "float8_e4m3fn", "float32", 128, 4, "nhd", ()),
         # heads of 3, 5 or 7 int32 words of codes a lane (refused until 2026-11-28), on the
         # CUDA cores: the full side's slices in 8-byte loads (80), float32 and bfloat16 rows
         ("int8", "", "float16", 80, 4, "nhd", ()),
         ("", "float8_e4m3fn", "float16", 48, 1, "hnd", ()),
         ("int8", "float8_e4m3fn", "float32", 48, 2, "nhd", ()),
         ("int8", "int8", "float32", 96, 1, "nhd", ()),
         ("int8", "int8", "bfloat16", 112, 2, "nhd", ())]
KIT = GRID + EXTRA
#: Built by default here: every combo, head_dim, group, layout, row dtype and the window.
COVERING = [("int8", "", "float16", 64, 1, "nhd", ()), ("", "int8", "float16", 128, 4, "hnd", ()),
            ("float8_e4m3fn", "", "float16", 64, 8, "hnd", ()),
            ("int8", "float8_e4m3fn", "float16", 128, 1, "nhd", ()),
            *EXTRA[:5], EXTRA[5], EXTRA[9]]


def _spec(ks, vs, dtype, D, G, layout, features, arch="sm_90a"):
    return compiler.KernelSpec("decode", dtype, D, H, G, layout=layout, target="cuda",
                               arch=arch, features=features, k_storage=ks, v_storage=vs)


def _ids(case):
    ks, vs, dtype, D, G, layout, feats = case
    return (f"k{ks or 'full'}-v{vs or 'full'}-{dtype}-d{D}-g{G}-{layout}"
            + "".join(f"-{f}" for f in feats))


def test_kit_lists_every_kernel_the_gpu_tests_load():
    """tools/gpu-kit.sh's mixed-decode lines name exactly :data:`KIT` (the GPU machine has no
    compiler: a kernel missing there fails the GPU run)."""
    from kvtvm.cli import default_specs

    text = (Path(__file__).parents[2] / "tools" / "gpu-kit.sh").read_text()
    lines = [ln for ln in text.replace("\\\n", " ").splitlines()
             if ln.startswith("build ") and "test_quant_decode_mixed_cuda" in ln]
    built = set()
    for ln in lines:
        words = ln.split("#")[0].split()[1:]
        opt = {words[i][2:]: words[i + 1].split(",") for i in range(0, len(words), 2)}
        built |= {(s.k_storage, s.v_storage, s.dtype, s.head_dim, s.group_size, s.layout,
                   s.features) for s in default_specs(
            "cuda", "sm_90a", opt["ops"], opt["dtypes"], [int(x) for x in opt["head-dims"]],
            [int(x) for x in opt["kv-heads"]], [int(x) for x in opt["group-sizes"]],
            opt["layouts"], opt.get("features", ["none"]), opt["cache-dtypes"])}
    assert built == set(KIT)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("case", KIT, ids=_ids)
def test_mixed_decode_builds_for_sm90a_and_sm80_without_spills(tmp_path, case):
    if case not in COVERING and not os.environ.get("KVTVM_CUDA_BUILD_GRID"):
        pytest.skip("the whole grid with KVTVM_CUDA_BUILD_GRID=1")
    path = compiler.build_spec(_spec(*case), tmp_path)
    text = path.with_suffix(".ptxas.txt").read_text()
    report = compiler.spill_report(text)
    assert {k.split(":")[0] for k in report} == {"sm_80", "sm_90a"}
    assert len(report) == 4, sorted(report)          # attend and merge, per arch
    for kernel, usage in report.items():
        assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, (kernel, usage)
    assert "Registers are spilled" not in text


# -- on a GPU ------------------------------------------------------------------------------

def _side(torch, rng, storage, dtype, layout, num_pages, page_size, D, device="cuda"):
    """One side of a layer: a strided view (every other slot of a larger tensor, as the
    managers' views are) of random rows, quantized when ``storage`` is set; and its host copy
    for the reference (8-bit codes, or the stored values as float32)."""
    from kvtvm.quant import quant_row_bytes, quantize_rows

    inner = (page_size, H) if layout == "nhd" else (H, page_size)
    x = (rng.standard_normal((num_pages, 2, *inner, D))
         * rng.uniform(0.1, 4, (num_pages, 1, 1, 1, 1))).astype(np.float32)
    if storage:
        rows = torch.from_numpy(quantize_rows(x, storage).view(np.int8)).to(device)
        view = rows.view(getattr(torch, storage))[:, 1]
        assert view.shape[-1] == quant_row_bytes(D)
        import ml_dtypes

        host = view.view(torch.uint8).cpu().numpy().view(
            np.int8 if storage == "int8" else ml_dtypes.float8_e4m3fn)
        return view, host
    view = torch.from_numpy(x).to(getattr(torch, dtype)).to(device)[:, 0]
    return view, view.float().cpu().numpy()


def _check(torch, case, page_size, num_splits, window=None, seed=0, device="cuda"):
    from kvtvm import ops
    from kvtvm.kernels.reference import reference_decode

    ks, vs, dtype, D, G, layout, _ = case
    rng = np.random.default_rng(seed)
    lengths = [0, 1, 2 * page_size - 1, 300]
    table, num_pages = random_page_table(rng, lengths, page_size, spare=3)
    (kc, k_host), (vc, v_host) = (_side(torch, rng, s, dtype, layout, num_pages, page_size, D,
                                        device) for s in (ks, vs))
    q = torch.randn(len(lengths), H * G, D, device=device).to(getattr(torch, dtype))
    lens = torch.tensor(lengths, dtype=torch.int32)
    before = [t.clone() for t in (kc, vc)]
    out, lse = ops.decode_attention(q, kc, vc, lens.to(device),
                                    torch.from_numpy(table).to(device),
                                    layout=layout, num_splits=num_splits,
                                    sliding_window=window)
    want, want_lse = reference_decode(q.float().cpu().numpy(), k_host, v_host, lens.numpy(),
                                      table, layout=layout, sliding_window=window)
    rtol = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 1e-5}[dtype]
    np.testing.assert_allclose(out.float().cpu().numpy(), want, atol=2e-3, rtol=rtol)
    np.testing.assert_allclose(lse.cpu().numpy(), want_lse, atol=1e-3, rtol=1e-4)
    for t, b in zip((kc, vc), before):  # the cache is read, never written
        assert torch.equal(t.view(torch.uint8), b.view(torch.uint8))


@gpu
@pytest.mark.parametrize("case", GRID, ids=_ids)
@pytest.mark.parametrize("page_size,num_splits", [(1, 1), (16, 4), (256, 2), (16, None)])
def test_mixed_decode_cuda_numerics(case, page_size, num_splits):
    import torch

    _check(torch, case, page_size, num_splits, seed=page_size)


@gpu
@pytest.mark.parametrize("case", EXTRA, ids=_ids)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mixed_decode_cuda_window_and_row_dtypes(case, num_splits):
    import torch

    window = 37 if case[-1] else None
    _check(torch, case, 16, num_splits, window=window, seed=num_splits)


@gpu
@pytest.mark.parametrize("case", [GRID[0], GRID[13]], ids=_ids)
def test_mixed_decode_cuda_skips_and_flags_a_page_outside_the_pool(case):
    """Unchecked launch, one sequence's page index past the pool: that split is left out and
    the flag raised; the other sequences are exact."""
    import torch

    _check_bad_page(torch, case)


def _check_bad_page(torch, case, device="cuda"):
    from kvtvm import ops
    from kvtvm.errors import KernelIndexError
    from kvtvm.kernels.reference import reference_decode

    ks, vs, dtype, D, G, layout, _ = case
    rng = np.random.default_rng(5)
    lengths = [40, 70]
    table, num_pages = random_page_table(rng, lengths, 16, spare=3)
    (kc, k_host), (vc, v_host) = (_side(torch, rng, s, dtype, layout, num_pages, 16, D, device)
                                  for s in (ks, vs))
    bad = table.copy()
    bad[1, 2] = num_pages + 7
    q = torch.randn(2, H * G, D, device=device).to(getattr(torch, dtype))
    lens = torch.tensor(lengths, dtype=torch.int32)
    out, _ = ops.decode_attention(q, kc, vc, lens.to(device), torch.from_numpy(bad).to(device),
                                  layout=layout, num_splits=1, check_indices=False)
    with pytest.raises(KernelIndexError):
        ops.check()
    want, _ = reference_decode(q.float().cpu().numpy()[:1], k_host, v_host, lens.numpy()[:1],
                               table[:1], layout=layout)
    np.testing.assert_allclose(out[:1].float().cpu().numpy(), want, atol=2e-3, rtol=2.0 ** -10)
