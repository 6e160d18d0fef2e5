"""What the CUDA kernels support (kvtvm.cuda_limits) and the decode layouts off the common grid:
a head_dim the CUDA kernels cannot take is a typed error naming head_dim -- from a CUDA
KernelSpec and from a manager given a CUDA device, before anything is allocated -- instead of an
IndexError or an assertion inside a schedule; the CUDA decode reduces a score over a power of two
of lanes (head_dim 112, or 8-bit 48, used to reduce across row groups on an H100: wrong output;
an 8-bit head of 48, 80, 96 or 112 now takes 3, 5 or 7 int32 words of codes a lane) and fits its row groups into a CTA's threads and 48 KiB of static shared memory (8-bit d256
GQA 4 used to fail in ptxas) or says why not (d80 GQA 9)."""

import shutil
from pathlib import Path

import pytest
import torch

from kvtvm import KVCacheParams, compiler, runtime

if not runtime.compiler_available():  # the schedules below need TVM's compiler
    pytest.skip("needs the TVM compiler", allow_module_level=True)

from kvtvm.cuda_limits import check_params_on_cuda, decode_vectors
from kvtvm.errors import DeviceUnavailableError, InvalidArgumentError
from kvtvm.kernels.decode import vec_choices
from kvtvm.kernels.quant_access import quant_vec_choices
from kvtvm.manager import LinearKVCache, PagedKVCacheManager
from schedules.decode import cuda as decode_cuda
from schedules.decode import cuda_quant as decode_cuda_quant

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


def _spec(op="decode", dtype="float16", head_dim=64, group_size=1, **kw):
    return compiler.KernelSpec(op=op, dtype=dtype, head_dim=head_dim, n_kv_heads=2,
                               group_size=group_size, target="cuda", arch="sm_90a", **kw)


def test_rules_are_the_schedules_own_choices():
    for dtype in ("float16", "bfloat16", "float32"):
        for d in range(1, 1100):
            cpu = compiler.KernelSpec(op="decode", dtype=dtype, head_dim=d, n_kv_heads=1)
            assert decode_vectors(dtype, d) == vec_choices(cpu), (dtype, d)
            assert decode_vectors(dtype, d, quantized=True) == quant_vec_choices(cpu), (dtype, d)


def test_one_8bit_side_rule_is_the_schedules_own():
    """K-only / V-only CUDA decode: the 8-bit slices (quant_vec_choices) and 16-byte copies of
    the full-precision rows; every head_dim the spec takes gets a layout from the schedule."""
    for dtype in ("float16", "bfloat16", "float32"):
        chunk = 16 // {"float32": 4}.get(dtype, 2)
        for d in range(1, 600):
            cpu = compiler.KernelSpec(op="decode", dtype=dtype, head_dim=d, n_kv_heads=1)
            ok = bool(quant_vec_choices(cpu)) and d % chunk == 0
            for ks, vs in (("int8", ""), ("", "float8_e4m3fn")):
                if not ok:
                    with pytest.raises(InvalidArgumentError, match="one side 8-bit"):
                        _spec("decode", dtype, d, k_storage=ks, v_storage=vs)
                    continue
                spec = _spec("decode", dtype, d, k_storage=ks, v_storage=vs)
                knobs = decode_cuda_quant.default_knobs(spec)
                if 32 % (d // knobs["vec"]):  # an odd factor of lanes: whole warps may not fit
                    continue                  # (a typed error naming head_dim / group_size)
                g = decode_cuda_quant.geometry(spec, knobs)
                assert _smem(decode_cuda_quant, spec, g) <= 48 * 1024, (dtype, d)


@pytest.mark.parametrize("op,dtype,head_dim,storage", [
    ("decode", "float16", 17, ""), ("decode", "float16", 264, ""),  # used to: IndexError
    ("decode", "float32", 516, ""), ("decode", "float16", 18, "int8"),
    ("decode", "float16", 112, ""), ("decode", "float16", 144, "int8"),  # 112: was wrong output
    ("decode", "float32", 36, "int8"),                               # 9 words: no power of two
    ("prefill", "float16", 24, ""),                                  # used to: AssertionError
    ("append", "bfloat16", 18, "int8"),                              # used to: ValueError
])
def test_unsupported_cuda_head_dim_is_a_typed_error(op, dtype, head_dim, storage):
    quant = dict(k_storage=storage, v_storage=storage) if storage else {}
    with pytest.raises(InvalidArgumentError, match=rf"head_dim: expected .*got {head_dim}"):
        _spec(op, dtype, head_dim, **quant)
    # the CPU kernels take it
    compiler.KernelSpec(op=op, dtype=dtype, head_dim=head_dim, n_kv_heads=2, **quant)


def test_supported_cuda_head_dims_pass():
    for d in (32, 48, 64, 80, 96, 112, 128, 160, 256):
        for op in ("append", "decode", "prefill"):
            if (op, d) != ("decode", 112):
                _spec(op, "bfloat16", d)
    for d in (64, 128, 256, 12, 20, 24, 28, 48, 80, 96, 112, 896):  # 3, 5, 7 words a lane too
        _spec("decode", "float16", d, k_storage="int8", v_storage="float8_e4m3fn")
    for d in (48, 80, 96, 112):  # one side 8-bit: a multiple of 8 float16 values too
        _spec("decode", "float16", d, k_storage="int8")
    _spec("prefill", "float32", 17)
    _spec("append", "float16", 17)


def test_manager_on_cuda_refuses_the_head_dim_first():
    bad = KVCacheParams("float16", 2, 17, "paged", page_size=16)
    for make in (lambda p: PagedKVCacheManager(p, 2, 64, 1, devices=("cuda",)),
                 lambda p: LinearKVCache(KVCacheParams("float16", 2, 17, "linear"), 2, 64, 1,
                                         devices=("cuda:0",))):
        with pytest.raises(InvalidArgumentError, match="head_dim"):
            make(bad)
    with pytest.raises(InvalidArgumentError, match="quantizing append"):
        KVCacheParams("float16", 2, 18, "paged", page_size=16, k_cache_dtype="int8").check_cuda()
    check_params_on_cuda(KVCacheParams("bfloat16", 2, 80, "linear"))
    PagedKVCacheManager(bad, 2, 64, 1)  # the CPU takes it
    if not torch.cuda.is_available():  # a supported head_dim gets as far as the device check
        with pytest.raises(DeviceUnavailableError):
            PagedKVCacheManager(KVCacheParams("float16", 2, 48, "paged", page_size=16), 2, 64,
                                1, devices=("cuda",))


def _smem(mod, spec, g):
    if spec.quantized:  # K and V rows staged as stored (8-bit or full precision)
        return decode_cuda.attend_smem_bytes(g["bdz"], spec.group_size, spec.head_dim,
                                             g["stages"] * g["tile"] * g["k_row"],
                                             g["stages"] * g["tile"] * g["v_row"])
    return decode_cuda.attend_smem_bytes(g["bdz"], spec.group_size, spec.head_dim,
                                         g["stages"] * g["tile"] * spec.head_dim * g["esize"])


@pytest.mark.parametrize("dtype,head_dim,group,quant", [
    ("float16", 64, 16, True), ("float16", 256, 4, True), ("bfloat16", 96, 3, False),
    ("float16", 160, 6, False), ("float16", 256, 8, True),
    # one side 8-bit, the other full precision (larger rows: a float32 V row is 4x K's bytes)
    ("float32", 256, 8, "int8/"), ("float16", 256, 16, "/float8_e4m3fn"),
    ("bfloat16", 64, 16, "int8/"), ("float32", 128, 8, "/int8")])
def test_decode_layout_fits_a_cta(dtype, head_dim, group, quant):
    """Shapes whose attend kernel used to declare more than 48 KiB of shared memory."""
    kw = dict(k_storage="int8", v_storage="int8") if quant is True else {}
    if isinstance(quant, str):
        kw = dict(zip(("k_storage", "v_storage"), quant.split("/")))
    spec = _spec("decode", dtype, head_dim, group, **kw)
    mod = decode_cuda_quant if quant else decode_cuda
    g = mod.geometry(spec, mod.default_knobs(spec))
    assert g["threads"] % 32 == 0 and g["threads"] <= 1024
    assert g["tile"] % g["bdz"] == 0 and g["tile"] >= g["bdz"]
    assert _smem(mod, spec, g) <= 48 * 1024


def test_decode_layout_of_shapes_that_built_is_unchanged():
    """fp16 d128 GQA 4 (the benchmarks' kernels, checked on an H100) keeps its layout; d160
    GQA 2 reduces over 4 lanes of 40 elements (it was 10 lanes of 16: not a power of two)."""
    spec = _spec("decode", "float16", 128, 4)
    g = decode_cuda.geometry(spec, decode_cuda.default_knobs(spec))
    assert (g["vec"], g["bdx"], g["bdz"], g["tile"], g["threads"]) == (16, 8, 4, 32, 128)
    spec = _spec("decode", "float16", 160, 2)
    g = decode_cuda.geometry(spec, decode_cuda.default_knobs(spec))
    assert (g["vec"], g["bdx"], g["bdz"], g["tile"], g["threads"]) == (40, 4, 8, 32, 64)
    # int8 K and V: the CUDA-core kernel (now the tensor-core kernel's fallback, ``mma`` 0)
    # keeps its layout at its former defaults; by default the spec runs on the tensor cores
    spec = _spec("decode", "float16", 128, 4, k_storage="int8", v_storage="int8")
    knobs = decode_cuda_quant.default_knobs(spec)
    assert knobs["mma"] == 1
    g = decode_cuda_quant.geometry(spec, dict(knobs, threads=128, tile_tokens=32, stages=2,
                                              vec=8, mma=0))
    assert (g["bdz"], g["tile"]) == (8, 32)


@pytest.mark.parametrize("head_dim,group", [(80, 9), (96, 15)])
def test_decode_without_a_layout_names_head_dim_and_group(head_dim, group):
    spec = _spec("decode", "float16", head_dim, group)
    with pytest.raises(InvalidArgumentError, match=rf"head_dim / group_size.*"
                                                   rf"head_dim {head_dim}, group_size {group}"):
        decode_cuda.geometry(spec, decode_cuda.default_knobs(spec))


@needs_nvcc
def test_refitted_decode_builds_without_spills(tmp_path):
    spec = _spec("decode", "float16", 256, 4, k_storage="int8", v_storage="float8_e4m3fn")
    path = compiler.build_spec(spec, tmp_path)
    text = Path(str(path)[:-3] + ".ptxas.txt").read_text()
    for key, usage in compiler.spill_report(text).items():
        assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, (key, usage)
