"""CUDA kernels are compiled ahead of time by nvcc: sm_80 and sm_90a SASS, no spills, and the
exported module embeds the binary instead of source."""

import shutil

import pytest

from kvtvm import compiler

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")


@pytest.mark.parametrize("dtype,head_dim,heads,layout", [
    ("float16", 128, 8, "nhd"), ("bfloat16", 64, 4, "hnd"), ("float32", 256, 2, "nhd"),
    ("float32", 32, 1, "hnd")])  # a single KV head (multi-query attention): no head loop
def test_append_cuda_binary(tmp_path, dtype, head_dim, heads, layout):
    spec = compiler.KernelSpec(op="append", dtype=dtype, head_dim=head_dim, n_kv_heads=heads,
                               layout=layout, target="cuda", arch="sm_90a")
    path = compiler.build_spec(spec, tmp_path)
    data = path.read_bytes()
    fatbin = compiler.embedded_fatbin(path)
    assert compiler.fatbin_architectures(fatbin) == ["sm_80", "sm_90a"]
    assert b"__global__" not in data, "CUDA source should not be shipped in the module"
    report = compiler.spill_report(path.with_suffix(".ptxas.txt").read_text())
    assert set(report) == {"sm_80:kvtvm_append_kernel", "sm_90a:kvtvm_append_kernel"}
    for kernel, usage in report.items():
        assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, (kernel, usage)
        assert 0 < usage["registers"] <= 64, (kernel, usage)


def test_import_blob_rewrite_roundtrip():
    import struct

    def s(b):
        return struct.pack("<Q", len(b)) + b
    source = "extern \"C\" __global__ void k() {}"
    fmap = b"\x01" + b"\x00" * 7 + s(b"k") + s(b"k") + b"\x00" * 8 * 3
    payload = s(b"cuda") + fmap + s(source.encode())
    body = struct.pack("<QQQQ", 3, 0, 1, 1) + struct.pack("<QQ", 1, 1) + s(b"_lib") + s(b"cuda") \
        + s(payload)
    blob = struct.pack("<Q", len(body)) + body
    new = compiler.replace_cuda_source_with_fatbin(blob, source, b"FATBIN\x00BYTES")
    assert struct.unpack_from("<Q", new)[0] == len(new) - 8
    assert s(b"fatbin") + fmap + s(b"FATBIN\x00BYTES") in new
    assert source.encode() not in new
    with pytest.raises(ValueError):
        compiler.replace_cuda_source_with_fatbin(new, source, b"x")


def test_spill_report_attributes_warnings_by_name():
    report = "\n".join([
        "ptxas info    : Compiling entry function 'a_kernel' for 'sm_80'",
        "ptxas info    : Function properties for a_kernel",
        "    8 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads",
        "ptxas info    : Used 255 registers, used 1 barriers",
        "ptxas info    : Compiling entry function 'b_kernel' for 'sm_80'",
        "ptxas warning : Registers are spilled to local memory in function 'a_kernel', "
        "8 bytes spill stores, 4 bytes spill loads",
        "ptxas info    : Function properties for b_kernel",
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
        "ptxas info    : Used 40 registers, used 0 barriers",
    ])
    usage = compiler.spill_report(report)
    assert usage["sm_80:a_kernel"] == {"registers": 255, "spill_stores": 8, "spill_loads": 4}
    assert usage["sm_80:b_kernel"] == {"registers": 40, "spill_stores": 0, "spill_loads": 0}
