"""CUDA prefill over quantized (8-bit) caches: K and V each int8, float8_e4m3fn or full
precision (schedules/prefill/cuda_quant_tiles.py inside the tensor-core kernel; the simt
kernel for float32 queries). The kernels compile with nvcc for sm_90a and sm_80 without
register spills; on a GPU they equal ``reference_prefill`` over the quantized views (random
page tables, pages crossing, page sizes 1/16/256, GQA 1-8, ragged batches over a cached prefix,
outlier and all-zero rows, sliding window, both tile variants).

GPU kernels come from tools/gpu-kit.sh (the "CUDA prefill over 8-bit caches" lines)."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import TOL
from kvtvm import compiler, ops

I8, F8 = "int8", "float8_e4m3fn"
W = ("sliding_window",)
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _spec(dtype, ks, vs, D, layout, features, arch, G=4, variant=""):
    return compiler.KernelSpec(op="prefill", dtype=dtype, head_dim=D, n_kv_heads=8,
                               group_size=G, layout=layout, target="cuda", arch=arch,
                               features=features, k_storage=ks, v_storage=vs, variant=variant)


def _check_build(spec, tmp_path):
    path = compiler.build_spec(spec, tmp_path)
    text = Path(str(path)[:-3] + ".ptxas.txt").read_text()
    report = compiler.spill_report(text)
    assert report
    for key, usage in report.items():
        assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, (key, usage)
        assert 0 < usage["registers"] <= 255
    assert "serialized" not in text  # C7515: a wgmma accumulator written outside a wgmma
    return {key.split(":")[0] for key in report}


@needs_nvcc
def test_int8_wgmma_kernel_builds_without_spills(tmp_path):
    """float16 queries over int8 K and V on sm_90a: wgmma for both products, the 8-bit rows
    staged by cp.async and converted by the int8 helper, no spills (the schedule's default
    knobs: this spec's tuning log picks the mma.sync kernel)."""
    spec = _spec("float16", I8, I8, 128, "nhd", (), "sm_90a")
    spec = compiler.KernelSpec(**{**spec.__dict__, "knobs": compiler.default_knobs(spec)})
    assert _check_build(spec, tmp_path) == {"sm_90a"}
    script = compiler.lower(spec).script()
    assert script.count('"mma_async"') >= 2 and "kvtvm_i8x16_to_f16" in script and "kvtvm_convert" in script
    assert "T.ptx.cp" in script


@pytest.mark.slow
@needs_nvcc
@pytest.mark.parametrize("dtype,ks,vs,D,layout,features,arch", [
    ("float16", I8, I8, 128, "nhd", (), "sm_80"),
    ("bfloat16", F8, F8, 64, "hnd", W, "sm_90a"),
    ("bfloat16", F8, F8, 128, "nhd", W, "sm_80"),
    ("float16", I8, "", 128, "hnd", W, "sm_90a"),
    ("bfloat16", I8, "", 64, "nhd", (), "sm_80"),
    ("bfloat16", "", F8, 128, "nhd", W, "sm_90a"),
    ("float16", "", F8, 64, "hnd", (), "sm_80"),
    ("bfloat16", I8, I8, 128, "hnd", W, "sm_90a"),
    ("float16", F8, F8, 64, "nhd", W, "sm_90a"),
], ids=lambda v: str(v) if not isinstance(v, tuple) else ("window" if v else "causal"))
def test_quantized_kernels_build_without_spills(tmp_path, dtype, ks, vs, D, layout, features,
                                                arch):
    """int8/int8, e4m3/e4m3, K-only, V-only; float16 and bfloat16; nhd and hnd; head_dim 64
    and 128; causal with and without a sliding window; wgmma (sm_90a) and mma.sync (sm_80)."""
    spec = _spec(dtype, ks, vs, D, layout, features, arch)
    assert _check_build(spec, tmp_path) == {arch}
    script = compiler.lower(spec).script()
    assert ("mma_async" in script) == (arch == "sm_90a")


@pytest.mark.slow
@needs_nvcc
@pytest.mark.parametrize("dtype,ks,vs,D,variant", [
    ("float16", I8, I8, 128, "short_query"),   # the small-tile variant (mma.sync)
    ("float16", F8, I8, 256, ""),              # head_dim 256: mma.sync on sm_90a too
    ("float32", I8, F8, 128, ""),              # float32 queries: the simt kernel
])
def test_other_quantized_kernels_build_for_both_archs(tmp_path, dtype, ks, vs, D, variant):
    spec = _spec(dtype, ks, vs, D, "nhd", (), "sm_90a", variant=variant)
    assert _check_build(spec, tmp_path) == {"sm_80", "sm_90a"}


def test_quantized_specs_stay_within_shared_memory():
    """The tiles, raw 8-bit stages and Q of every default / variant knob set fit the opt-in
    shared memory of sm_80 (163 KiB) and sm_90a (227 KiB)."""
    from kvtvm.schedules.prefill.cuda_quant_tiles import tile_shared_bytes

    limits = {"sm_80": 163 * 1024, "sm_90a": 227 * 1024}
    for arch, limit in limits.items():
        for dtype in ("float16", "bfloat16"):
            for D in (64, 128, 256):
                for ks, vs in ((I8, I8), (F8, ""), ("", I8)):
                    for variant in ("", "short_query"):
                        spec = _spec(dtype, ks, vs, D, "nhd", (), arch, variant=variant)
                        knobs = compiler.resolve_knobs(spec)
                        assert tile_shared_bytes(spec, knobs) <= limit, (spec.uri, knobs)
    full = _spec("float16", "", "", 128, "nhd", (), "sm_90a")
    quant = _spec("float16", I8, "", 128, "nhd", (), "sm_90a")
    knobs = compiler.resolve_knobs(full)
    # one side's raw stages: STAGES x tile_kv rows of quant_row_bytes(128) = 144 bytes
    assert tile_shared_bytes(quant, knobs) - tile_shared_bytes(full, knobs) == \
        knobs["stages"] * knobs["tile_kv"] * 144


@needs_nvcc
def test_shared_memory_arithmetic_is_what_the_kernel_asks_for():
    """tile_shared_bytes is the dynamic shared memory the built kernel is launched with (the
    launch argument in the host code)."""
    import tvm

    from kvtvm.schedules.prefill.cuda_quant_tiles import tile_shared_bytes

    spec = _spec("bfloat16", I8, I8, 128, "nhd", (), "sm_90a")
    with spec.tvm_target():
        host = tvm.compile(compiler.lower(spec), target=spec.tvm_target()).mod
    want = tile_shared_bytes(spec, compiler.resolve_knobs(spec))
    assert want == 2 * (128 * 128 + 2 * 2 * 64 * 128) + 2 * 2 * 64 * 144
    assert str(want) in host.inspect_source("ll")


def test_v_prescale_keeps_float16_in_range():
    """P * scale_v * prescale (P <= 1) stays below float16's largest value for any row of
    float16 values, and the prescale is an exact power of two (1 for bfloat16)."""
    from kvtvm.quant import QMAX
    from kvtvm.schedules.prefill.cuda_quant_tiles import v_prescale

    for vs in (I8, F8):
        pre = v_prescale(_spec("float16", "", vs, 128, "nhd", (), "sm_90a"))
        assert pre >= 16 and np.log2(pre) == int(np.log2(pre))
        assert 65504.0 / QMAX[vs] * pre < 65504.0
        assert v_prescale(_spec("bfloat16", "", vs, 128, "nhd", (), "sm_90a")) == 1.0
    assert v_prescale(_spec("float16", I8, "", 128, "nhd", (), "sm_90a")) == 1.0


# ---- GPU numerics ------------------------------------------------------------------------

def _rows(rng, shape):
    """float32 K/V rows of mixed magnitudes (0.03 .. 3), with outliers and all-zero rows."""
    x = rng.standard_normal(shape).astype(np.float32)
    x *= (10.0 ** rng.uniform(-1.5, 0.5, shape[:-1] + (1,))).astype(np.float32)
    flat = x.reshape(-1, shape[-1])
    n = flat.shape[0]
    out = rng.choice(n, max(1, n // 50), replace=False)
    flat[out, rng.integers(0, shape[-1], out.size)] *= 30.0      # one outlier in the row
    flat[rng.choice(n, max(1, n // 50), replace=False)] = 0.0   # all-zero rows
    return x


def _side(rng, shape, storage, dtype, device):
    """One side of a layer, as a strided view of a manager-shaped tensor (another layer
    beside it): ``(device view, host array for the reference)``."""
    from kvtvm.quant import quantize_rows

    x = _rows(rng, shape)
    if storage:
        rows = quantize_rows(x, storage)
        t = torch.from_numpy(rows.view(np.int8).copy())
        host = rows
    else:
        t = torch.from_numpy(x).to(getattr(torch, dtype))
        host = t.float().numpy()
    big = torch.zeros((shape[0], 2) + tuple(t.shape[1:]), dtype=t.dtype)
    big[:, 1] = t
    view = big.to(device)[:, 1]
    if storage:
        view = view.view(getattr(torch, storage))
    return view, host


GPU_CASES = [  # dtype, k_storage, v_storage, H, G, D, layout, window, page_size
    ("float16", I8, I8, 2, 4, 128, "nhd", None, 16),
    ("float16", F8, F8, 2, 4, 128, "nhd", 20, 1),
    ("bfloat16", I8, I8, 2, 4, 128, "hnd", 20, 256),
    ("bfloat16", F8, F8, 2, 4, 128, "hnd", None, 16),
    ("float16", I8, "", 2, 1, 128, "nhd", None, 16),     # K-only, GQA 1
    ("bfloat16", "", F8, 1, 8, 128, "nhd", 20, 16),      # V-only, GQA 8
    ("float16", F8, I8, 2, 4, 128, "hnd", None, 1),      # mixed 8-bit formats
    ("bfloat16", I8, I8, 2, 2, 64, "nhd", None, 16),     # head_dim 64
    ("float32", I8, F8, 2, 4, 128, "nhd", None, 16),     # float32 queries: simt kernel
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"{c[0]}-k{c[1] or 'full'}-"
                         f"v{c[2] or 'full'}-g{c[4]}-d{c[5]}-{c[6]}-w{c[7]}-p{c[8]}")
@pytest.mark.parametrize("counts", [[5, 0, 1, 30, 3], [300, 0, 1, 130, 70]],
                         ids=["short-queries", "long-queries"])
def test_gpu_matches_reference_over_quantized_views(case, counts):
    """Both tile variants of the op (few new tokens per sequence, or many), tiles spanning
    several sequences, every sequence over a prefix already in the cache."""
    _check_case(case, counts, "cuda")


@pytest.mark.slow
def test_cpu_kernel_meets_the_same_bound():
    """The GPU test's harness (views, reference, error bound) on the CPU kernel, so the one GPU
    run tests the CUDA kernel, not the harness."""
    _check_case(("float16", I8, F8, 2, 4, 64, "nhd", 20, 16), [5, 0, 1, 30, 3], "cpu")


def _check_case(case, counts, device):
    from kvtvm.kernels.reference import reference_prefill
    from kvtvm.quant import quant_row_bytes

    dtype, ks, vs, H, G, D, layout, window, page_size = case
    rng = np.random.default_rng(len(counts) + counts[0])
    starts = [3, 9, 40, 17, 0]
    final = [s + n for s, n in zip(starts, counts)]
    need = [-(-f // page_size) for f in final]
    num_pages = sum(need) + 3
    perm = rng.permutation(num_pages).astype(np.int32)
    table = np.full((len(final), max(need)), -1, np.int32)
    cursor = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[cursor:cursor + n]
        cursor += n
    shape = (num_pages, page_size, H, D) if layout == "nhd" else (num_pages, H, page_size, D)
    kc, k_host = _side(rng, shape, ks, dtype, device)
    vc, v_host = _side(rng, shape, vs, dtype, device)
    assert kc.shape[-1] == (quant_row_bytes(D) if ks else D)
    q = torch.from_numpy(rng.standard_normal((sum(counts), H * G, D)).astype(np.float32)).to(
        getattr(torch, dtype))
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    lengths = np.asarray(starts, np.int32)
    want, want_lse = reference_prefill(q.float().numpy(), k_host, v_host, indptr, lengths,
                                       table, layout, True, None, window)
    before = (kc.view(torch.uint8).clone() if ks else kc.clone())
    out = torch.full_like(q.to(device), float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=device)
    ops.prefill_attention(q.to(device), kc, vc, *(torch.from_numpy(a).to(device)
                                                   for a in (indptr, lengths, table)),
                          layout=layout, sliding_window=window, out=out, lse=lse)
    ops.check()  # no index error flagged
    got, got_lse = out.float().cpu().numpy(), lse.cpu().numpy()
    assert np.isfinite(got).all() and np.isfinite(got_lse).all()
    # the error a rounded P makes in out[i] is at most its relative rounding times
    # sum_j p_ij |v_j| (attention over |V|): the bound scales with each row's own values, so
    # rows of small values (float16's prescale) are held to their own size
    mag, _ = reference_prefill(q.float().numpy(), k_host, np.abs(reference_values(v_host, D)),
                               indptr, lengths, table, layout, True, None, window)
    tol = TOL[dtype]
    excess = np.abs(got - want) - tol * (np.abs(want) + mag + 1e-3)
    assert (excess <= 0).all(), (f"{(excess > 0).sum()} values off; worst at "
                                 f"{np.unravel_index(excess.argmax(), excess.shape)}: got "
                                 f"{got.flat[excess.argmax()]}, want {want.flat[excess.argmax()]}")
    np.testing.assert_allclose(got_lse, want_lse, rtol=tol, atol=tol)
    assert torch.equal(kc.view(torch.uint8) if ks else kc, before)  # the cache is read only


def reference_values(host, D):
    """float32 values of a host side (dequantized when 8-bit)."""
    from kvtvm.quant import dequantize_rows

    host = np.asarray(host)
    return dequantize_rows(host, D) if host.shape[-1] != D else host


def _byte_perm(x, y, s):
    """CUDA's ``__byte_perm``: byte i of the result is byte ``(s >> 4i) & 7`` of ``{y, x}``."""
    pool = int(x) | int(y) << 32
    return sum(((pool >> 8 * ((s >> 4 * i) & 7)) & 0xFF) << 8 * i for i in range(4))


def test_conversion_helpers_are_exact_for_every_code():
    """The bit tricks of the CUDA conversion helpers, emulated on every 8-bit code: int8 ->
    float16 (``0x6400 | (code + 128)`` minus 1152), int8 -> float32 (``2**23 + code + 128``),
    and the sm_80 e4m3 -> float16 bit placement (times 256) give the exact values."""
    import ml_dtypes

    from kvtvm.schedules.prefill.cuda_quant_tiles import _CONV4, E4M3X2_TO_F16X2

    i8f16, i8bf16 = _CONV4[(I8, "float16")], _CONV4[(I8, "bfloat16")]
    assert "0x64646464u, 0x4140" in i8f16 and "0x64806480u" in i8f16
    assert "0x4B000000u, 0x7540" in i8bf16 and "8388736.0f" in i8bf16
    assert "0x1404" in E4M3X2_TO_F16X2 and "0x3F803F80u" in E4M3X2_TO_F16X2 and "0x5C005C00u" in E4M3X2_TO_F16X2
    codes = np.arange(-127, 128, dtype=np.int8)
    word = lambda c: int(np.uint8(c)) * 0x01010101  # noqa: E731  (the code in every byte)
    for c in codes:
        u = word(c) ^ 0x80808080
        lo = _byte_perm(u, 0x64646464, 0x4140) & 0xFFFF
        half = np.array([lo], np.uint16).view(np.float16)[0]
        assert np.float16(half - np.float16(1152)) == c
        f = np.array([_byte_perm(u, 0x4B000000, 0x7540)], np.uint32).view(np.float32)[0]
        assert f - np.float32(8388736.0) == c
    e4m3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    for byte, value in zip(range(256), e4m3.astype(np.float32)):
        if not np.isfinite(value):  # 0x7F / 0xFF: NaN, never in a cache kvtvm wrote
            continue
        p = _byte_perm(byte, 0, 0x1404)
        h = (p & 0x80008000) | ((p >> 1) & 0x3F803F80)
        half = np.array([h & 0xFFFF], np.uint16).view(np.float16)[0]
        assert np.float32(np.float16(half * np.float16(256))) == value, hex(byte)
