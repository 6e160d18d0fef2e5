"""Ahead-of-time builds load and run with the TVM runtime alone."""

import os
import textwrap

from helpers import run_python

from kvtvm import compiler

SPEC = dict(op="append", dtype="float32", head_dim=16, n_kv_heads=2)

RUNTIME_SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    import kvtvm
    from kvtvm import compiler, ops, runtime
    from kvtvm.errors import CompilerUnavailableError, DeviceUnavailableError
    assert not runtime.compiler_available(), "compiler should be unavailable"
    rng = np.random.default_rng(0)
    k_cache = rng.standard_normal((4, 8, 2, 16)).astype(np.float32)
    v_cache = rng.standard_normal((4, 8, 2, 16)).astype(np.float32)
    k = rng.standard_normal((3, 2, 16)).astype(np.float32)
    v = rng.standard_normal((3, 2, 16)).astype(np.float32)
    ops.append_kv(k_cache, v_cache, k, v, np.array([0, 3], np.int32), np.array([7], np.int32),
                  np.array([[2, 0]], np.int32))
    assert np.array_equal(k_cache[2, 7], k[0]) and np.array_equal(k_cache[0, :2], k[1:])
    assert np.array_equal(v_cache[2, 7], v[0]) and np.array_equal(v_cache[0, :2], v[1:])
    maps = open("/proc/self/maps").read()
    assert "libtvm_compiler" not in maps, "the compiler library was loaded"
    # a spec that was never built: clear error, no attempt to compile
    try:
        compiler.get_kernel(compiler.KernelSpec(op="append", dtype="float32", head_dim=32,
                                                n_kv_heads=2))
    except CompilerUnavailableError as err:
        assert "python -m kvtvm build" in str(err)
    else:
        raise AssertionError("expected CompilerUnavailableError")
    # a CUDA module on a machine without a GPU fails only now, clearly
    cuda_spec = compiler.KernelSpec(op="append", dtype="float32", head_dim=16, n_kv_heads=2,
                                    target="cuda", arch="sm_90a")
    if compiler.find_built(cuda_spec) is not None and sys.argv[1] == "nogpu":
        try:
            compiler.get_kernel(cuda_spec)
        except DeviceUnavailableError as err:
            assert "CUDA" in str(err)
        else:
            raise AssertionError("expected DeviceUnavailableError")
    print("RUNTIME-ONLY-OK")
""")


def test_runtime_only_load_and_run(tmp_path):
    out = tmp_path / "kernels"
    compiler.build_specs(compiler.with_runtime_variants(compiler.KernelSpec(**SPEC)), out)
    has_gpu = False
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except ImportError:
        pass
    import shutil
    if shutil.which("nvcc"):
        compiler.build_spec(compiler.KernelSpec(**SPEC, target="cuda", arch="sm_90a"), out)
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1", KVTVM_KERNEL_PATH=str(out),
               KVTVM_CACHE_DIR=str(tmp_path / "empty-cache"))
    assert "RUNTIME-ONLY-OK" in run_python(RUNTIME_SCRIPT, "gpu" if has_gpu else "nogpu",
                                           env=env)


def test_import_kvtvm_runtime_only():
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")
    code = ("import kvtvm, kvtvm.ops, kvtvm.compiler; "
            "assert 'libtvm_compiler' not in open('/proc/self/maps').read(); print('ok')")
    assert "ok" in run_python(code, env=env, timeout=120)


def test_numpy_references_import_without_tvm():
    """The references check kernels on a runtime-only GPU machine too (tools/gpu-check.sh):
    importing them must not import TVM (whose TVMScript needs the compiler library)."""
    code = ("import sys, numpy as np; from kvtvm.kernels.reference import reference_decode; "
            "q = np.ones((1, 2, 4)); kv = np.ones((1, 1, 1, 4)); "
            "out, lse = reference_decode(q, kv, kv, [0], np.zeros((1, 1), np.int32)); "
            "assert out.shape == (1, 2, 4) and not [m for m in sys.modules if m == 'tvm' or "
            "m.startswith('tvm.')]; print('ok')")
    assert "ok" in run_python(code, timeout=120)


BUILD_WITHOUT_COMPILER = """
import contextlib, io, sys
from kvtvm import cli, compiler, runtime, tune
from kvtvm.errors import CompilerUnavailableError
assert not runtime.compiler_available()
spec = compiler.KernelSpec(op="copy", dtype="float32", head_dim=8, n_kv_heads=1)
try:
    compiler.resolve_knobs(spec)
except CompilerUnavailableError as err:
    print("KNOBS:", err)
err = io.StringIO()
with contextlib.redirect_stderr(err):
    rc_build = cli.main(["build", "--target", "llvm", "--out", sys.argv[1], "--ops", "copy",
                         "--head-dims", "8", "--no-progress"])
    rc_tune = tune.main(["--op", "copy", "--head-dim", "8", "--dry-run", "--no-progress"])
print("RC", rc_build, rc_tune)
print("ERR", err.getvalue().replace(chr(10), " | "))
"""


def test_building_or_tuning_without_the_compiler_is_one_typed_error(tmp_path):
    """Runtime only, `python -m kvtvm build` failed every kernel with an ImportError from deep
    inside TVM ('cannot import name TCol') and exited 1; `tune` and `resolve_knobs` raised
    that ImportError."""
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1", KVTVM_CACHE_DIR=str(tmp_path / "cache"))
    out = run_python(BUILD_WITHOUT_COMPILER, str(tmp_path / "out"), env=env, timeout=120)
    assert "KNOBS:" in out and "needs TVM's compiler" in out, out
    assert "RC 2 2" in out, out
    err = out.split("ERR", 1)[1]
    assert "ImportError" not in err and "Traceback" not in err and "compiler" in err, out
    assert not list((tmp_path / "out").glob("*/*.so"))
