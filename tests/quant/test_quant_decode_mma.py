"""The tensor-core CUDA decode over an 8-bit cache (``schedules/decode/cuda_quant_mma.py``):
which specs run it (the rule of :func:`kvtvm.cuda_limits.tensor_core_decode`, the schedule's
default knob, the tuner's space), that its shapes fit a CTA's static shared memory, and that it
compiles with nvcc for sm_90a and sm_80 without spills, its products on ``mma.sync`` (numerics:
the GPU tests of tests/quant/test_quant_cuda.py and test_quant_decode_mixed_cuda.py run it,
``tools/gpu_decode_mma_probe.py`` times it)."""

import re
import shutil

import pytest

from kvtvm import compiler
from kvtvm.cuda_limits import tensor_core_decode


def _spec(ks="int8", vs="int8", dtype="float16", D=128, G=4, layout="nhd", **extra):
    return compiler.KernelSpec("decode", dtype, D, 8, G, layout=layout, target="cuda",
                               arch="sm_90a", k_storage=ks, v_storage=vs, **extra)


@pytest.mark.parametrize("dtype,D,G,ks,vs,want", [
    ("float16", 128, 4, "int8", "int8", True),
    ("float16", 64, 8, "float8_e4m3fn", "float8_e4m3fn", True),
    ("float16", 96, 1, "int8", "float8_e4m3fn", True),
    ("float16", 32, 3, "float8_e4m3fn", "int8", True),
    ("float16", 128, 9, "int8", "int8", True),       # two head parts of 5 and 4 query heads
    ("float16", 64, 16, "float8_e4m3fn", "int8", True),  # two head parts of 8
    ("float16", 64, 17, "int8", "int8", True),       # three head parts (6, 6, 5)
    ("bfloat16", 128, 32, "float8_e4m3fn", "float8_e4m3fn", True),  # four parts of 8
    ("float16", 256, 4, "int8", "int8", False),      # the O fragments would not fit
    ("float16", 48, 4, "int8", "int8", True),        # V's last 32-column group zero-padded
    ("bfloat16", 112, 8, "float8_e4m3fn", "int8", True),
    ("float16", 40, 4, "int8", "int8", False),       # not whole 16-column k-steps
    ("float16", 16, 1, "int8", "int8", False),       # kept on the CUDA cores (a spill)
    ("bfloat16", 128, 4, "int8", "int8", True),
    ("bfloat16", 64, 8, "float8_e4m3fn", "int8", True),
    ("float32", 128, 4, "int8", "int8", False),
    ("float16", 128, 4, "int8", "", True),           # K-only at the checked shapes
    ("bfloat16", 128, 1, "", "float8_e4m3fn", True),  # V-only
    ("float16", 128, 8, "int8", "", True),           # one side, GQA 8 and 16 (head parts)
    ("bfloat16", 128, 16, "", "int8", True),
    ("float16", 128, 17, "int8", "", True),          # one side, three parts
    ("float16", 64, 4, "", "int8", False),
    ("float32", 128, 4, "int8", "", False),
])
def test_tensor_core_decode_rule(dtype, D, G, ks, vs, want):
    assert tensor_core_decode(dtype, D, G, ks, vs) is want


def test_default_knobs_run_the_tensor_cores_where_they_can():
    """The tuned build and the ``short_splits`` variant of a supported spec both run it (the
    tuning log's threads / tile / stages become its warps / tile rows / stages); other 8-bit
    specs keep the CUDA-core kernel."""
    from kvtvm.compiler.knobs import resolve_knobs

    for storage in ("int8", "float8_e4m3fn"):
        assert resolve_knobs(_spec(storage, storage))["mma"] == 1
        assert resolve_knobs(_spec(storage, storage, variant="short_splits"))["mma"] == 1
    assert resolve_knobs(_spec(dtype="bfloat16"))["mma"] == 1
    # no tuning log (bfloat16 queries): the geometries measured fastest on an H100 / H200
    from kvtvm.schedules.decode.cuda_quant_mma import geometry

    bf16 = _spec(dtype="bfloat16")
    g = geometry(bf16, resolve_knobs(bf16))
    assert (g["warps"], g["tile"], g["stages"]) == (2, 32, 3)
    g = geometry(bf16, resolve_knobs(_spec(dtype="bfloat16", variant="short_splits")))
    assert (g["warps"], g["tile"], g["stages"]) == (4, 64, 2)
    assert resolve_knobs(_spec(G=16, D=64))["mma"] == 1  # in two head parts
    assert resolve_knobs(_spec(G=32, D=64))["mma"] == 1  # in four
    for spec in (_spec(D=256), _spec(dtype="float32"), _spec(vs="", D=64),
                 _spec(ks="", D=64)):
        assert resolve_knobs(spec)["mma"] == 0, spec.uri


def test_knob_space_offers_both_kernels_only_where_both_run():
    from kvtvm.kernels import decode

    tensor, cores = decode.knob_space(_spec())
    assert tensor["mma"] == [1] and cores["mma"] == [0]
    assert "vec" not in tensor and "vec" in cores  # the tensor-core kernel reads no vec
    assert "mma" not in decode.knob_space(_spec(vs="", D=64))
    assert "mma" not in decode.knob_space(_spec(D=256))
    from kvtvm import tune

    grid = tune.candidates(_spec(), 10_000)
    mma = [tuple(sorted(k.items())) for k in grid if k["mma"] == 1]
    assert len(mma) == len(set(mma)) > 1 and any(k["mma"] == 0 for k in grid)


@pytest.mark.parametrize("D,G", [(32, 1), (64, 8), (64, 3), (128, 4), (128, 8), (128, 16)])
@pytest.mark.parametrize("threads", [32, 64, 128, 256])
@pytest.mark.parametrize("tile", [16, 32, 64])
@pytest.mark.parametrize("stages", [2, 3])
def test_geometry_fits_a_cta(D, G, threads, tile, stages):
    """Whatever the knobs: whole 16-row warp chunks, K and V stages plus the warps' output
    reduction within the 48 KiB a kernel may declare statically."""
    from kvtvm.quant import quant_row_bytes
    from kvtvm.schedules.decode.cuda import SMEM_STATIC_BYTES
    from kvtvm.schedules.decode.cuda_quant_mma import geometry

    from kvtvm.schedules.decode.cuda_quant_mma import head_parts

    spec = _spec(D=D, G=G)
    g = geometry(spec, {"threads": threads, "tile_tokens": tile, "stages": stages})
    assert g["tile"] == 16 * g["warps"] * g["chunks"] and g["threads"] == 32 * g["warps"]
    assert g["stages"] >= 2 and 1 <= g["warps"] <= max(1, threads // 32)
    heads = head_parts(G)[1]   # a CTA's query heads (at most 8)
    smem = g["stages"] * g["tile"] * 2 * quant_row_bytes(D) + g["warps"] * heads * (D + 2) * 4
    assert smem <= SMEM_STATIC_BYTES


@pytest.mark.parametrize("ks,vs", [("int8", None), (None, "float8_e4m3fn")])
def test_one_sided_specs_take_the_tensor_cores_at_the_checked_shapes(ks, vs):
    """K-only and V-only specs run the tensor cores by default at head_dim 128, GQA up to 16
    (``one_sided_knobs``, also in its short_splits variant), and the tuner searches both
    kernels there; elsewhere the CUDA-core kernel, unless ``one_sided_knobs`` asks."""
    from kvtvm.compiler.knobs import resolve_knobs
    from kvtvm.kernels import decode
    from kvtvm.schedules.decode import cuda_quant_mma

    spec = _spec(ks, vs)
    assert cuda_quant_mma.supported(spec) and cuda_quant_mma.runs_by_default(spec)
    knobs = resolve_knobs(spec)
    assert {k: knobs[k] for k in cuda_quant_mma.one_sided_knobs(spec)} == \
        cuda_quant_mma.one_sided_knobs(spec)
    assert cuda_quant_mma.geometry(spec, dict(knobs, mma_short=1)) == \
        cuda_quant_mma.geometry(spec, knobs)
    assert {1, 0} == {grid["mma"][0] for grid in decode.knob_space(spec)}
    off = _spec(ks, vs, D=64)
    assert cuda_quant_mma.supported(off) and not cuda_quant_mma.runs_by_default(off)
    assert resolve_knobs(off)["mma"] == 0 and "mma" not in decode.knob_space(off)
    assert cuda_quant_mma.one_sided_knobs(off)["mma"] == 1
    assert cuda_quant_mma.runs_by_default(_spec(ks, vs, G=24))   # three head parts
    for bad in (_spec(ks, vs, dtype="float32"), _spec(ks, vs, D=256)):
        assert not cuda_quant_mma.supported(bad), bad.uri
    assert not cuda_quant_mma.supported(_spec(None, None))


@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("ks,vs", [("int8", None), (None, "int8"), ("int8", "float8_e4m3fn")])
@pytest.mark.parametrize("threads,tile,stages", [(64, 32, 3), (128, 64, 2), (256, 64, 3)])
def test_staged_rows_and_geometry_of_either_side(D, ks, vs, threads, tile, stages):
    """A staged 16-bit row is 16-byte aligned (cp.async) and padded so that K's 8-byte and
    V's 4-byte fragment loads meet no bank conflict (rows 8 / 4 banks apart mod 32); an 8-bit
    row is its stored bytes; K and V stages and the output reduction fit 48 KiB."""
    from kvtvm.quant import quant_row_bytes
    from kvtvm.schedules.decode.cuda import SMEM_STATIC_BYTES
    from kvtvm.schedules.decode.cuda_quant_mma import geometry, staged_words

    spec = _spec(ks, vs, D=D, G=4)
    for st, side, want in ((ks, "k", 8), (vs, "v", 4)):
        words = staged_words(spec, st, side)
        assert words % 4 == 0
        if st:
            assert words * 4 == quant_row_bytes(D)
        else:
            assert words >= D // 2 and words % 32 == want
    g = geometry(spec, {"threads": threads, "tile_tokens": tile, "stages": stages})
    smem = g["stages"] * g["tile"] * 4 * (g["k_words"] + g["v_words"]) \
        + g["warps"] * 4 * (D + 2) * 4
    assert smem <= SMEM_STATIC_BYTES and g["tile"] == 16 * g["warps"] * g["chunks"]


def _spills(text):
    found = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    assert found, "no ptxas resource report"
    return [(int(a), int(b)) for a, b in found if int(a) or int(b)]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("ks,vs,D,G,layout,knobs", [
    ("int8", "int8", 128, 4, "nhd", {}),
    ("float8_e4m3fn", "int8", 64, 8, "hnd", {"p_split": 0, "threads": 64, "stages": 3}),
    ("int8", "float8_e4m3fn", 128, 4, "nhd", {"dtype": "bfloat16"}),
    ("float8_e4m3fn", "int8", 128, 8, "nhd", {}),   # GQA 8, the default knobs
    ("int8", "int8", 64, 16, "nhd", {}),             # GQA 16: two head parts of 8
    ("int8", "int8", 48, 8, "nhd", {}),              # V's last group zero-padded
    ("float8_e4m3fn", "int8", 80, 4, "hnd", {"dtype": "bfloat16"}),
    ("int8", "float8_e4m3fn", 112, 2, "nhd", {}),
    ("float8_e4m3fn", "float8_e4m3fn", 128, 9, "nhd", {"dtype": "bfloat16"}),  # 5 + 4
    ("int8", "int8", 128, 32, "nhd", {}),            # four head parts of 8
    ("float8_e4m3fn", "int8", 64, 20, "hnd", {"dtype": "bfloat16"}),  # 7 + 7 + 6
    ("int8", "int8", 96, 4, "nhd", {}),              # 6 k-steps, 3 groups of V columns
    ("float8_e4m3fn", "float8_e4m3fn", 64, 8, "hnd", {"dtype": "bfloat16"}),
    # one side 16-bit, with the knobs that take it to the tensor cores (not the default)
    ("int8", None, 128, 4, "nhd", {"one_sided": True}),
    (None, "float8_e4m3fn", 128, 1, "hnd", {"one_sided": True}),
    ("float8_e4m3fn", None, 64, 8, "nhd", {"one_sided": True}),
    (None, "int8", 32, 1, "nhd", {"one_sided": True, "dtype": "bfloat16"}),
    ("int8", None, 128, 24, "nhd", {}),              # K-only by default, three parts
])
def test_builds_on_mma_sync_without_spills(tmp_path, ks, vs, D, G, layout, knobs):
    import tvm

    from kvtvm.schedules.decode.cuda_quant_mma import one_sided_knobs

    knobs = dict(knobs)
    dtype = knobs.pop("dtype", "float16")
    if knobs.pop("one_sided", False):
        knobs = one_sided_knobs(_spec(ks, vs, dtype=dtype, D=D, G=G, layout=layout))
    spec = _spec(ks, vs, dtype=dtype, D=D, G=G, layout=layout, knobs=knobs)
    with spec.tvm_target():
        source = [m for m in tvm.compile(compiler.lower(spec), target=spec.tvm_target())
                  .mod.imports if m.kind == "cuda"][0].inspect_source()
    # S = Q K^T: two n8 tiles per 16-column k-step; O += P V: 4 n8 tiles per 32 columns, twice
    # with P split into float16 hi + lo
    per_pv = 1 if knobs.get("p_split") == 0 else 2
    ab = "f16" if dtype == "float16" else "bf16"
    assert source.count(f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32") == \
        2 * (D // 16) + per_pv * 4 * -(-D // 32)   # 48, 80, 112: a zero-padded last V group
    assert ("cvt.rn.f16x2.e4m3x2" in source) is ("float8_e4m3fn" in (ks, vs))
    assert ("sub.f16x2" in source) is ("int8" in (ks, vs) and dtype == "float16")
    assert ("cvt.rn.bf16x2.f32" in source) is (dtype == "bfloat16")
    # a 16-bit side: K's two words copied as they are, V's halves paired by byte permutes
    assert ("*(uint2*)dst = *(const uint2*)src" in source) is (ks is None)
    assert ("__byte_perm((unsigned)w0, (unsigned)w1, 0x5410u)" in source) is (vs is None)
    path = compiler.build_spec(spec, tmp_path)
    report = path.with_suffix(".ptxas.txt").read_text()
    assert not _spills(report)
    assert "sm_80" in report and "sm_90a" in report


@pytest.mark.parametrize("G,want", [(1, (1, 1)), (8, (1, 8)), (9, (2, 5)), (12, (2, 6)),
                                    (16, (2, 8)), (17, (3, 6)), (20, (3, 7)), (24, (3, 8)),
                                    (32, (4, 8)), (33, (5, 7)), (128, (16, 8))])
def test_head_parts_cover_the_group_with_at_most_8_rows_each(G, want):
    """A group past 8 query heads runs as CTAs of at most 8 (the first half of an m16 tile's
    rows), every query head in exactly one part (the last one may be short)."""
    from kvtvm.schedules.decode.cuda_quant_mma import MMA_ROWS, head_parts

    parts, heads = head_parts(G)
    assert (parts, heads) == want and heads <= MMA_ROWS
    covered = [p * heads + i for p in range(parts) for i in range(heads) if p * heads + i < G]
    assert covered == list(range(G))
