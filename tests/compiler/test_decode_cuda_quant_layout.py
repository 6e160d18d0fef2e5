"""The CUDA-core 8-bit decode's thread layout, off the grid (no GPU needed):

- ``threadIdx.z`` (row groups x head parts) stays within CUDA's 64: 8-bit heads of 16 (and
  d32 under float32 queries) laid out 128 row groups along z, a launch CUDA refuses;
- a GQA group whose q and output would not fit a thread's registers is split into head parts
  (``head_split``): d80 and d112 at GQA 8 spilled 1-2 KiB a thread, now none;
- staged 8-bit rows are padded by one 16-byte chunk where a warp's rows met the same banks
  (d112: 8-way conflicts, d48: 4-way), by the module's own bank model, checked here first.
Every CUDA kernel's lowered launch (all families) is checked against CUDA's limits."""

import itertools
import re
import shutil

import pytest

from kvtvm import compiler, runtime
from kvtvm.errors import InvalidArgumentError

if not runtime.compiler_available():  # the schedules below need TVM's compiler
    pytest.skip("needs the TVM compiler", allow_module_level=True)

from kvtvm.compiler.knobs import resolve_knobs
from kvtvm.quant import quant_row_bytes
from schedules.decode import cuda_quant as cq

COMBOS = [("int8", "int8"), ("float8_e4m3fn", "float8_e4m3fn"), ("int8", ""), ("", "int8"),
          ("int8", "float8_e4m3fn")]


def _spec(dtype, head_dim, group, ks, vs, op="decode", **kw):
    return compiler.KernelSpec(op, dtype, head_dim, 2, group, layout="nhd", target="cuda",
                               arch="sm_90a", k_storage=ks, v_storage=vs, **kw)


def _core_specs():
    """Every CUDA-core 8-bit decode spec of a wide grid (the tensor-core kernel's are left)."""
    for D, G, (ks, vs), dtype in itertools.product(
            (16, 32, 48, 64, 80, 96, 112, 128, 160, 256), (1, 2, 3, 4, 6, 7, 8, 16), COMBOS,
            ("float16", "bfloat16", "float32")):
        try:
            spec = _spec(dtype, D, G, ks, vs)
        except InvalidArgumentError:     # a head_dim the CUDA kernels do not take
            continue
        knobs = cq.default_knobs(spec)
        if not knobs.get("mma"):
            yield spec, knobs


def test_default_layouts_fit_cuda_launch_limits_and_registers():
    n = 0
    for spec, knobs in _core_specs():
        try:
            g = cq.geometry(spec, knobs)
        except InvalidArgumentError as err:  # no whole-warp layout (d80 GQA 7, say): named
            assert "group_size" in str(err), err
            continue
        n += 1
        hs, G = g["head_split"], spec.group_size
        assert g["bdz"] * hs <= cq.MAX_BLOCK_Z, (spec.uri(), g)
        assert g["threads"] % 32 == 0 and g["threads"] <= 1024, (spec.uri(), g)
        assert G % hs == 0 and g["tile"] % g["bdz"] == 0
        assert G // hs * g["vec"] <= max(cq.HEAD_VALUES_PER_THREAD, g["vec"]), (spec.uri(), g)
        if G * g["vec"] <= 32:           # where the group fits, one part (as before)
            assert hs == 1, (spec.uri(), g)
    assert n > 500


@pytest.mark.parametrize("D,G,ks,vs,dtype,hs", [
    (112, 8, "int8", "int8", "float32", 8), (80, 8, "", "int8", "float16", 4),
    (48, 8, "float8_e4m3fn", "float8_e4m3fn", "float32", 2), (112, 2, "int8", "", "float16", 2),
    (96, 8, "int8", "", "float16", 2), (80, 4, "int8", "float8_e4m3fn", "float32", 2),
    (64, 8, "int8", "", "float16", 1), (128, 8, "", "float8_e4m3fn", "float16", 1)])
def test_head_parts_where_the_group_outgrows_a_thread(D, G, ks, vs, dtype, hs):
    spec = _spec(dtype, D, G, ks, vs)
    assert resolve_knobs(spec)["head_split"] == 0            # from the final vec
    assert cq.geometry(spec, resolve_knobs(spec))["head_split"] == hs


def test_head_split_follows_an_explicit_vec():
    """A spec (or tuning log) choosing a wider slice gets the parts that slice needs, not
    those of the default slice (d64 GQA 8 with 32 values a lane held 256 values of q)."""
    spec = _spec("float16", 64, 8, "int8", "int8", knobs={"vec": 32, "mma": 0})
    assert cq.geometry(spec, resolve_knobs(spec))["head_split"] == 8


def test_head_split_knob_is_checked_and_searched():
    spec = _spec("float16", 112, 8, "int8", "")
    knobs = resolve_knobs(spec)
    for hs in (3, -2, 16):
        with pytest.raises(InvalidArgumentError, match="head_split"):
            cq.geometry(spec, dict(knobs, head_split=hs))
    from kvtvm.kernels.decode import knob_space

    assert knob_space(spec)["head_split"] == [1, 2, 4, 8]
    for hs in (1, 2, 4, 8):   # every choice lays out within the limits
        g = cq.geometry(spec, dict(knobs, head_split=hs))
        assert g["bdz"] * hs <= cq.MAX_BLOCK_Z and g["threads"] % 32 == 0


@pytest.mark.parametrize("threads", [64, 128, 256])
def test_every_searched_layout_fits_along_z(threads):
    """Knob choices a tuner tries (threads x vec x head_split) lay out within CUDA's z limit
    or are a typed error -- d16 with a 16-value slice at 256 threads used to ask for 256."""
    for D, G in ((16, 1), (32, 2), (48, 3), (112, 8), (64, 4)):
        spec = _spec("float32", D, G, "int8", "int8")
        base = resolve_knobs(spec)
        from kvtvm.kernels.decode import knob_space

        space = knob_space(spec)
        space = space[-1] if isinstance(space, list) else space
        for vec, hs in itertools.product(space["vec"], space["head_split"]):
            try:
                g = cq.geometry(spec, dict(base, threads=threads, vec=vec, head_split=hs))
            except InvalidArgumentError:
                continue
            assert g["bdz"] * hs <= cq.MAX_BLOCK_Z, (D, G, vec, hs, g)


def test_bank_model():
    w = cq._wavefronts
    assert w(list(range(32)), 1) == 1                 # consecutive words
    assert w([0] * 32, 1) == 1                        # one word: broadcast
    assert w([32 * i for i in range(32)], 1) == 32    # one bank, 32 words
    assert w([4 * i for i in range(32)], 4) == 4      # 16-byte vectors: 4 phases of 8 lanes
    assert w([8 * i for i in range(32)], 4) == 8      # each phase's 8 lanes 2-way
    assert w([2 * i for i in range(32)], 2) == 2


@pytest.mark.parametrize("D,G,vec,unpadded,padded", [
    (112, 1, 28, 64, 8),    # 8 rows of 32 words a warp: 8-way on every load
    (48, 1, 12, 16, 4),     # rows of 16 words: 4-way
    (80, 1, 20, 12, 6)])
def test_staged_rows_are_padded_off_each_others_banks(D, G, vec, unpadded, padded):
    spec = _spec("float16", D, G, "int8", "")
    g = cq.geometry(spec, dict(resolve_knobs(spec), vec=vec))
    words = quant_row_bytes(D) // 4
    assert g["k_stage"] == 4 * (words + 4) and g["v_stage"] == 2 * D   # V full: not padded

    def model(stride):
        return cq.row_wavefronts(D, vec, g["bdx"], g["head_split"], g["rows_per_z"], stride)

    assert (model(words), model(words + 4)) == (unpadded, padded)


def _launch_dims(mod):
    """Per kernel (a segment from one blockIdx binding to the next) of every PrimFunc: the
    largest extent bound to each threadIdx axis."""
    for gv, func in mod.functions.items():
        for seg in func.script().split('thread="blockIdx')[1:]:
            dims = {}
            for ext, axis in re.findall(r'T\.thread_binding\((\d+), thread="(threadIdx\.[xyz])"\)',
                                        seg):
                dims[axis] = max(dims.get(axis, 1), int(ext))
            yield gv.name_hint, dims


@pytest.mark.parametrize("op", ["decode", "prefill", "append", "copy"])
def test_lowered_kernels_launch_within_cuda_limits(op):
    limits = {"threadIdx.x": 1024, "threadIdx.y": 1024, "threadIdx.z": 64}
    cases = [(16, 1, "int8", "int8", "float32"), (16, 2, "", "float8_e4m3fn", "float16"),
             (32, 1, "int8", "int8", "float32"), (112, 8, "int8", "int8", "float32"),
             (48, 8, "float8_e4m3fn", "float8_e4m3fn", "float16"), (128, 4, "", "", "float16"),
             (64, 8, "int8", "", "bfloat16"), (256, 8, "", "", "float32")]
    n = 0
    for D, G, ks, vs, dtype in cases:
        if op in ("append", "copy") and ks != vs:
            continue
        try:
            spec = _spec(dtype, D, G, ks, vs, op=op)
        except InvalidArgumentError:
            continue
        for name, dims in _launch_dims(compiler.lower(spec)):
            n += 1
            total = 1
            for axis, ext in dims.items():
                assert ext <= limits[axis], (spec.uri(), name, dims)
                total *= ext
            assert total <= 1024, (spec.uri(), name, dims)
    assert n


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("case", [("float32", 112, 8, "int8", "int8"),
                                  ("float16", 80, 8, "", "int8"),
                                  ("float32", 112, 4, "int8", ""),
                                  ("float32", 112, 4, "", "int8")], ids=str)
def test_head_parts_build_without_spills(tmp_path, case):
    """d112 over float32 queries and d80 V-only at GQA 8 spilled 1-2 KiB a thread (sm_80 and
    sm_90a) when one thread held all eight heads; K-only / V-only d112 at GQA 4 spilled 24-36
    bytes at 32-row tiles, with or without a register cap (now 16-row tiles)."""
    path = compiler.build_spec(_spec(*case), tmp_path)
    report = compiler.spill_report(path.with_suffix(".ptxas.txt").read_text())
    assert len(report) == 4, sorted(report)
    for kernel, usage in report.items():
        assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, (kernel, usage)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("case", [("float32", 112, 6, "int8", "int8"),
                                  ("float32", 80, 3, "", "int8"),
                                  ("float32", 112, 8, "", "int8")], ids=str)
def test_a_spilling_build_is_retried_with_every_register(tmp_path, case):
    """ptxas left to itself stopped these at 96 or 128 registers and spilled 12-48 bytes on
    sm_80 (255 are allowed); the build retries a spilling kernel with ``-maxrregcount=255``
    and keeps the build that spills less (here: none), saying so in the report."""
    from kvtvm.compiler.nvcc import RETRY_FLAG

    path = compiler.build_spec(_spec(*case), tmp_path)
    text = path.with_suffix(".ptxas.txt").read_text()
    assert text.startswith(f"kvtvm: built with {RETRY_FLAG}")
    report = compiler.spill_report(text)
    assert len(report) == 4, sorted(report)
    for kernel, usage in report.items():
        assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, (kernel, usage)
