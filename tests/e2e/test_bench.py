"""Every benchmark runs end to end on small cases and prints its side-by-side table."""

import json
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

CASES = {
    "decode": ["--cases", "2x256", "--skip", "tvm", "--repeat", "2", "--warmup", "1"],
    "prefill": ["--cases", "2:32:16", "--skip", "tvm", "--repeat", "2", "--warmup", "1"],
    "copy": ["--n-kv-heads", "1", "--head-dim", "16", "--repeat", "2", "--warmup", "1"],
    "manager": ["--batches", "1,4", "--context", "64", "--steps", "20", "--requests", "40",
                "--max-batch", "8", "--max-seq-len", "256"],
    "host": ["--layers", "2", "--context", "16", "--steps", "3"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_bench_runs(name, tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "kvtvm.bench", name, *CASES[name],
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    assert out.exists() and json.loads(out.read_text())
    if name in ("decode", "prefill", "copy"):
        assert "/ kvtvm" in proc.stdout  # ratio columns of the side-by-side table
        rows = json.loads(out.read_text())["rows"]
        impls = {r["impl"] for r in rows}
        assert "kvtvm" in impls and len(impls) >= 2
        assert all(r["ms"] > 0 for r in rows)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_tvm_peer_builds_ahead_of_time_for_a_runtime_only_gpu(tmp_path):
    """TVM's built-in decode kernel, built here for sm_90a like kvtvm's own: an nvcc fatbin
    embedded in the module (no CUDA source), where the benchmark looks for it."""
    from kvtvm import compiler
    from kvtvm.bench import tvm_peer

    path = tvm_peer.build("decode", "float16", 2, 8, 64, 16, "sm_90a", tmp_path)
    assert path == tmp_path / tvm_peer.file_name("decode", "float16", 2, 8, 64, 16, "sm_90a")
    assert compiler.fatbin_architectures(compiler.embedded_fatbin(path)) == ["sm_80", "sm_90a"]
    assert b"__global__" not in path.read_bytes()


@pytest.mark.slow
def test_prebuilt_tvm_peer_runs_with_the_runtime_only(tmp_path):
    """A machine without TVM's compiler still measures TVM's built-in decode side by side:
    both it and kvtvm's kernel are built ahead of time (llvm here) and loaded from the kernel
    path by a runtime-only process."""
    import os

    from kvtvm import compiler
    from kvtvm.bench import tvm_peer

    tvm_peer.build("decode", "float32", 2, 4, 32, 16, "llvm", tmp_path)
    spec = compiler.KernelSpec(op="decode", dtype="float32", head_dim=32, n_kv_heads=2,
                               group_size=2)
    for variant in compiler.with_runtime_variants(spec):
        compiler.build_spec(variant, tmp_path)
    out = tmp_path / "r.json"
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1", KVTVM_KERNEL_PATH=str(tmp_path),
               KVTVM_CACHE_DIR=str(tmp_path / "empty"))
    proc = subprocess.run([sys.executable, "-m", "kvtvm.bench", "decode", "--cases", "2x64",
                           "--n-kv-heads", "2", "--group-size", "2", "--head-dim", "32",
                           "--skip", "gather", "--repeat", "2", "--warmup", "1", "--json",
                           str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    impls = {r["impl"] for r in json.loads(out.read_text())["rows"]}
    assert {"kvtvm", "TVM builtin"} <= impls, proc.stdout
