"""Decode CUDA kernels (attend + merge) compile ahead of time with nvcc for sm_90a and sm_80:
both SASS in the embedded fatbin, no register spills, cp.async double buffering and warp
shuffles present; numerics against the numpy reference run where a GPU is present."""

import re
import shutil

import numpy as np
import pytest
from helpers import random_page_table

from kvtvm import compiler

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")

SPECS = [  # dtype, head_dim, n_kv_heads, group_size, layout, features
    ("float16", 128, 8, 4, "nhd", ()),              # Llama-3-8B
    ("bfloat16", 64, 4, 8, "hnd", ("sliding_window",)),
    ("float32", 256, 2, 1, "nhd", ()),
    ("float16", 64, 8, 1, "nhd", ("sliding_window",)),
]


def _spec(dtype, head_dim, heads, group, layout, features, **knobs):
    return compiler.KernelSpec(op="decode", dtype=dtype, head_dim=head_dim, n_kv_heads=heads,
                               group_size=group, layout=layout, features=features,
                               target="cuda", arch="sm_90a", knobs=knobs)


def _assert_no_spills(report_text):
    # every "Function properties" line, whatever entry the parser attributes it to
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report_text)
    assert spills, "no ptxas resource report"
    assert all(int(a) == 0 and int(b) == 0 for a, b in spills), spills
    assert "Registers are spilled" not in report_text


@pytest.mark.parametrize("args", SPECS, ids=lambda a: f"{a[0]}-d{a[1]}-g{a[3]}-{a[4]}")
def test_decode_cuda_binary(tmp_path, args):
    spec = _spec(*args)
    path = compiler.build_spec(spec, tmp_path)
    fatbin = compiler.embedded_fatbin(path)
    assert compiler.fatbin_architectures(fatbin) == ["sm_80", "sm_90a"]
    assert b"__global__" not in path.read_bytes(), "CUDA source should not ship in the module"
    text = path.with_suffix(".ptxas.txt").read_text()
    _assert_no_spills(text)
    report = compiler.spill_report(text)
    # two kernels per arch: attend and the split merge
    assert {k.split(":")[0] for k in report} == {"sm_80", "sm_90a"}
    assert len(report) == 4, sorted(report)
    for kernel, usage in report.items():
        assert 0 < usage["registers"] <= 168, (kernel, usage)


def test_decode_cuda_source_uses_async_copies_and_shuffles():
    import tvm

    spec = _spec(*SPECS[0])
    mod = compiler.lower(spec)
    with spec.tvm_target():
        source = [m for m in tvm.compile(mod, target=spec.tvm_target()).mod.imports
                  if m.kind == "cuda"][0].inspect_source()
    assert "cp.async.cg.shared.global" in source and "cp.async.wait_group 1" in source
    assert "__shfl_xor_sync" in source
    assert "uint4" in source  # 16-byte shared-memory vector loads


@pytest.mark.parametrize("knobs", [{"stages": 1}, {"stages": 3, "tile_tokens": 16},
                                   {"threads": 256, "tile_tokens": 64}, {"vec": 16},
                                   {"vec": 32, "threads": 256, "tile_tokens": 16}])
def test_decode_cuda_knob_variants_build_without_spills(tmp_path, knobs):
    """Points of the autotuner's knob space compile cleanly too."""
    spec = _spec(*SPECS[0], **knobs)
    path = compiler.build_spec(spec, tmp_path)
    _assert_no_spills(path.with_suffix(".ptxas.txt").read_text())


def _gpu():
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("layout,page_size", [("nhd", 16), ("nhd", 1), ("hnd", 256)])
def test_decode_cuda_numerics(layout, page_size, num_splits):
    import torch

    from kvtvm import ops
    from kvtvm.kernels.reference import reference_decode

    rng = np.random.default_rng(0)
    H, G, D, lengths = 8, 4, 128, [0, 1, 2 * page_size - 1, 200]
    table, num_pages = random_page_table(rng, lengths, page_size, spare=2)
    shape = (num_pages, page_size, H, D) if layout == "nhd" else (num_pages, H, page_size, D)
    k = torch.randn(shape, dtype=torch.float16, device="cuda")
    v = torch.randn(shape, dtype=torch.float16, device="cuda")
    q = torch.randn(len(lengths), H * G, D, dtype=torch.float16, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device="cuda")
    ops.decode_attention(q, k, v, lens.cuda(), torch.from_numpy(table).cuda(), layout=layout,
                         num_splits=num_splits, out=out, lse=lse, check_indices=True)
    ref_o, ref_l = reference_decode(q.float().cpu().numpy(), k.float().cpu().numpy(),
                                    v.float().cpu().numpy(), lengths, table, layout=layout)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    np.testing.assert_allclose(out.float().cpu().numpy(), ref_o, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(lse.cpu().numpy(), ref_l, rtol=1e-2, atol=1e-2)
