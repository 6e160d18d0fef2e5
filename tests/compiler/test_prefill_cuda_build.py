"""Prefill CUDA kernels: built ahead of time with nvcc for sm_90a (+ sm_80 SASS unless the
kernel issues Hopper-only wgmma), no register spills, tensor cores in the fp16/bf16 kernels
(wgmma on sm_90a up to head_dim 128, mma.sync otherwise); numerics against the numpy reference
when a GPU is present."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import TOL, make_prefill_batch as make_batch
from kvtvm import compiler, ops

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")

# the ops' policy: below this many new tokens per sequence, the short_query variant
from kvtvm.ops.prefill import CUDA_SHORT_QUERY_TOKENS as SHORT_QUERY_TOKENS  # noqa: E402

SPECS = [
    dict(dtype="float16", head_dim=128, n_kv_heads=8, group_size=4, layout="nhd"),
    dict(dtype="bfloat16", head_dim=64, n_kv_heads=2, group_size=1, layout="hnd",
         features=("sliding_window",)),
    dict(dtype="float16", head_dim=256, n_kv_heads=1, group_size=8, layout="nhd"),
    dict(dtype="float32", head_dim=128, n_kv_heads=8, group_size=4, layout="nhd"),
]


@needs_nvcc
@pytest.mark.parametrize("kw", SPECS, ids=lambda kw: f"{kw['dtype']}-d{kw['head_dim']}"
                                                      f"-g{kw['group_size']}-{kw['layout']}")
def test_builds_without_spills(kw, tmp_path):
    spec = compiler.KernelSpec(op="prefill", target="cuda", arch="sm_90a", **kw)
    path = compiler.build_spec(spec, tmp_path)
    report = compiler.spill_report(Path(str(path)[:-3] + ".ptxas.txt").read_text())
    wgmma = kw["dtype"] != "float32" and kw["head_dim"] <= 128
    built = {"sm_90a"} if wgmma else {"sm_80", "sm_90a"}  # wgmma has no sm_80 form
    assert {key.split(":")[0] for key in report} == built
    for key, usage in report.items():
        assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, (key, usage)
        assert 0 < usage["registers"] <= 255
    assert "serialized" not in Path(str(path)[:-3] + ".ptxas.txt").read_text()  # C7515
    archs = compiler.fatbin_architectures(compiler.embedded_fatbin(path))
    assert "sm_90a" in archs and ("sm_80" in archs) == (not wgmma)
    script = compiler.lower(spec).script()
    if kw["dtype"] == "float32":
        assert "ptx_legacy.mma" not in script and "wgmma" not in script
    elif wgmma:  # both products by wgmma (Q, K, V from shared memory, P from registers)
        assert script.count('"mma_async"') >= 2 and "ptx_legacy.mma" not in script
        assert "T.ptx.cp" in script
    else:  # both products on tensor cores, operands through ldmatrix, K/V by cp.async
        assert script.count("ptx_legacy.mma") >= 2
        assert "ldmatrix" in script and "T.ptx.cp" in script


@needs_nvcc
def test_short_query_variant_builds_without_spills(tmp_path):
    """The small-tile variant the op launches for calls with few tokens per sequence is part
    of every ahead-of-time build; the family declares its knobs once, by name."""
    from kvtvm.kernels.prefill import VARIANTS

    short_query = {"warps": 4, "m_tiles": 1, "tile_kv": 32, "wgmma": 0}
    assert VARIANTS["cuda"]["short_query"] == short_query
    spec = compiler.KernelSpec(op="prefill", target="cuda", arch="sm_90a", **SPECS[0])
    default, variant = compiler.with_runtime_variants(spec)
    assert variant.variant == "short_query" and variant.variant_knobs == short_query
    resolved = compiler.resolve_knobs(variant)
    assert {k: resolved[k] for k in short_query} == short_query
    assert compiler.resolve_knobs(default)["wgmma"] == 1  # tuned: the wgmma kernel
    report = compiler.spill_report(
        Path(str(compiler.build_spec(variant, tmp_path))[:-3] + ".ptxas.txt").read_text())
    for key, usage in report.items():
        assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, (key, usage)


@needs_nvcc
def test_sm80_spec_builds():
    spec = compiler.KernelSpec(op="prefill", dtype="bfloat16", head_dim=128, n_kv_heads=8,
                               group_size=4, target="cuda", arch="sm_80")
    script = compiler.lower(spec).script()
    assert "ptx_legacy.mma" in script and "wgmma" not in script


def test_wgmma_knobs_are_checked():
    """A wgmma kernel needs whole warp groups and one barrier a tile: other knobs are refused
    with a message instead of building a wrong kernel."""
    from kvtvm.schedules.prefill.cuda_tensor_core import tensor_core_prefill

    spec = compiler.KernelSpec(op="prefill", target="cuda", arch="sm_90a", **SPECS[0])
    for bad in [dict(NW=6, ONE_BARRIER=True), dict(NW=8, ONE_BARRIER=False)]:
        with pytest.raises(ValueError, match="warp groups"):
            tensor_core_prefill(spec, bad["NW"], 64, 2, False, 1, bad["ONE_BARRIER"], True)


def test_fatbin_leaves_out_archs_a_kernel_cannot_run_on():
    assert compiler.fatbin_archs("sm_90a", "... wgmma.mma_async.sync ...") == ("sm_90a",)
    assert compiler.fatbin_archs("sm_90a", "mma.sync.aligned") == ("sm_80", "sm_90a")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("layout,page_size", [("nhd", 16), ("nhd", 1), ("hnd", 256)])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("counts", [[5, 0, 1, 130, 70, 3], [300, 0, 1, 130, 70, 3]],
                         ids=["short-queries", "long-queries"])
def test_gpu_matches_reference(dtype, layout, page_size, window, counts):
    """Both tile variants of the op (few tokens per sequence on average, or many), with tiles
    spanning several sequences."""
    from kvtvm.kernels.reference import reference_prefill

    short = sum(counts) < SHORT_QUERY_TOKENS * len(counts)
    assert short == (counts[0] == 5)
    rng = np.random.default_rng(0)
    starts = [3, 9, 40, 17, 0, 61]
    args = make_batch(rng, H=2, G=4, D=128, page_size=page_size, counts=counts, starts=starts,
                      layout=layout, dtype=dtype)
    ref_out, ref_lse = reference_prefill(*(t.float().numpy() for t in args[:3]),
                                         *(t.numpy() for t in args[3:]), layout, True, None,
                                         window)
    dev = [t.cuda() for t in args]
    out = torch.full_like(dev[0], float("nan"))
    lse = torch.full(dev[0].shape[:2], float("nan"), device="cuda")
    ops.prefill_attention(*dev, layout=layout, sliding_window=window, out=out, lse=lse)
    got_out, got_lse = out.float().cpu().numpy(), lse.cpu().numpy()
    assert np.isfinite(got_out).all() and np.isfinite(got_lse).all()
    np.testing.assert_allclose(got_out, ref_out, rtol=TOL[dtype], atol=TOL[dtype])
    np.testing.assert_allclose(got_lse, ref_lse, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("H,G,D", [(2, 1, 64), (1, 3, 128), (1, 8, 128), (2, 4, 32), (1, 5, 96),
                                   (1, 2, 256)])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_head_shapes(H, G, D, causal):
    """Head shapes beside the main test's (2 KV heads x GQA 4 x 128): the wgmma kernel at
    head_dim 64, 32 and 96, odd groups (a CTA's rows are not a whole number of tokens), a group
    of 8, and the mma.sync kernel at head_dim 256; causal and not."""
    from kvtvm.kernels.reference import reference_prefill

    rng = np.random.default_rng(1)
    counts, starts = [300, 1, 0, 130, 77], [5, 70, 9, 0, 33]
    args = make_batch(rng, H=H, G=G, D=D, page_size=16, counts=counts, starts=starts,
                      dtype="float16")
    ref_out, ref_lse = reference_prefill(*(t.float().numpy() for t in args[:3]),
                                         *(t.numpy() for t in args[3:]), "nhd", causal, None,
                                         None)
    dev = [t.cuda() for t in args]
    out = torch.full_like(dev[0], float("nan"))
    lse = torch.full(dev[0].shape[:2], float("nan"), device="cuda")
    ops.prefill_attention(*dev, causal=causal, out=out, lse=lse)
    got_out, got_lse = out.float().cpu().numpy(), lse.cpu().numpy()
    assert np.isfinite(got_out).all() and np.isfinite(got_lse).all()
    np.testing.assert_allclose(got_out, ref_out, rtol=TOL["float16"], atol=TOL["float16"])
    np.testing.assert_allclose(got_lse, ref_lse, rtol=TOL["float16"], atol=TOL["float16"])
