"""Built kernels are found by spec, and their manifest decides what happens: comments and
docstrings do not orphan them, a real source change rebuilds them (compiler present), and a
runtime-only process refuses a module of another kvtvm version with a typed error."""

import json
import shutil
import textwrap

import pytest
from helpers import run_python, runtime_only_get_kernel

from kvtvm import compiler
from kvtvm.compiler import build, manifest
from kvtvm.errors import InvalidArgumentError

SPEC = compiler.KernelSpec(op="append", dtype="float32", head_dim=16, n_kv_heads=2)


@pytest.fixture
def prebuilt(tmp_path, monkeypatch):
    """SPEC built into a kernel directory on KVTVM_KERNEL_PATH, an empty cache, and a copy of
    the schedule sources the digest reads (returned: edit it to edit the schedules)."""
    kernels = tmp_path / "kernels"
    path = compiler.build_spec(SPEC, kernels)
    sources = tmp_path / "schedules"
    shutil.copytree(compiler.schedules_dir(), sources,
                    ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(manifest, "schedules_dir", lambda: sources)
    monkeypatch.setenv("KVTVM_KERNEL_PATH", str(kernels))
    monkeypatch.setenv("KVTVM_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real_build = build.build_spec

    def spy(spec, out_dir):
        calls.append((spec, out_dir))
        return real_build(spec, out_dir)

    monkeypatch.setattr(build, "build_spec", spy)
    return path, sources, calls


def test_the_file_name_is_the_spec_not_the_sources():
    name = SPEC.file_name()
    assert name.startswith("llvm/append_float32_h2_g1_d16_nhd-") and name.endswith(".so")
    assert "serial" in compiler.KernelSpec(**{**SPEC.__dict__, "variant": "serial"}).file_name()
    assert SPEC.with_knobs(vector_bytes=16).file_name() != name
    with pytest.raises(InvalidArgumentError, match="variant"):
        compiler.KernelSpec(op="prefill", dtype="float32", head_dim=16, n_kv_heads=2,
                            variant="fast")


def test_a_manifest_records_what_the_module_was_built_from(prebuilt):
    path, _, _ = prebuilt
    data = compiler.read_manifest(path)
    from kvtvm._version import __version__

    assert data["kvtvm"] == __version__ and data["tvm"] == compiler.tvm_version()
    assert data["knobs"] == compiler.resolve_knobs(SPEC)
    assert data["source_digest"] == compiler.source_digest(SPEC)
    assert data["spec"]["op"] == "append"


def test_an_edited_comment_or_docstring_keeps_prebuilt_kernels(prebuilt):
    path, sources, calls = prebuilt
    digest = compiler.source_digest(SPEC)
    cpu = sources / "append" / "cpu.py"
    text = cpu.read_text()
    text = text.replace('"""CPU (llvm) schedule of append', '"""An edited docstring. CPU schedule')
    text = text.replace("def default_knobs(spec) -> dict:\n",
                        "def default_knobs(spec) -> dict:\n    # an edited comment\n")
    text += "\n# a new comment at the end\n"
    cpu.write_text(text)
    (sources / "common.py").write_text((sources / "common.py").read_text() + "# comment\n")
    assert compiler.source_digest(SPEC) == digest
    fn = compiler.get_kernel(SPEC)
    assert calls == [], "a comment edit must not rebuild"
    assert fn is not None and compiler.find_built(SPEC) == path


def test_a_code_change_rebuilds_into_the_cache(prebuilt, tmp_path):
    path, sources, calls = prebuilt
    digest = compiler.source_digest(SPEC)
    cpu = sources / "append" / "cpu.py"
    cpu.write_text(cpu.read_text().replace('return {"vector_bytes": 32, "parallel": True}',
                                           'return {"vector_bytes": 16, "parallel": True}'))
    assert compiler.source_digest(SPEC) != digest
    compiler.get_kernel(SPEC)
    assert [c[0] for c in calls] == [SPEC]
    rebuilt = compiler.cache_dir() / SPEC.file_name()
    assert rebuilt.is_file() and compiler.is_fresh(rebuilt, SPEC)
    assert compiler.read_manifest(path)["source_digest"] == digest  # the prebuilt dir untouched


def test_a_missing_manifest_in_the_cache_rebuilds(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTVM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KVTVM_KERNEL_PATH", raising=False)
    path = compiler.build_spec(SPEC, compiler.cache_dir())
    compiler.manifest_path(path).unlink()
    assert not compiler.is_fresh(path, SPEC)
    compiler.get_kernel(SPEC)
    assert compiler.is_fresh(path, SPEC)


def test_runtime_only_refuses_another_kvtvm_version(tmp_path):
    import os

    out = tmp_path / "kernels"
    path = compiler.build_spec(SPEC, out)
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1", KVTVM_KERNEL_PATH=str(out),
               KVTVM_CACHE_DIR=str(tmp_path / "empty-cache"))
    script = runtime_only_get_kernel("KernelVersionError")
    assert "LOADED" in run_python(script, env=env, timeout=120)
    data = json.loads(compiler.manifest_path(path).read_text())
    data["kvtvm"] = "0.0.1-other"
    compiler.manifest_path(path).write_text(json.dumps(data))
    said = run_python(script, env=env, timeout=120)
    assert "ERROR:" in said and str(path) in said and "0.0.1-other" in said, said
    # what the error says to do works: a build of that directory rebuilds it (it was
    # reported "cached" and kept, so the runtime-only process kept refusing it)
    from kvtvm._version import __version__
    assert not compiler.is_fresh(path, SPEC)
    assert compiler.build_spec(SPEC, out) == path
    assert json.loads(compiler.manifest_path(path).read_text())["kvtvm"] == __version__
    assert "LOADED" in run_python(script, env=env, timeout=120)


BUILD_ONE = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    from kvtvm import compiler
    spec = compiler.KernelSpec(op="copy", dtype="float32", head_dim=16, n_kv_heads=1)
    print("PATH", compiler.build_spec(spec, sys.argv[1]))
""")


def test_two_processes_building_one_kernel_build_it_once(tmp_path):
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", BUILD_ONE, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum(out.count("building copy_float32") for out in outs) == 1, outs
    assert len({line for out in outs for line in out.splitlines() if line.startswith("PATH")}) == 1


def test_the_digested_schedules_are_the_ones_the_build_imports(tmp_path):
    """The sources a manifest digests are those the build runs: with a second checkout first
    on the path, ``kvtvm.schedules`` still imports from where the install maps it, and
    schedules_dir() must say the same folder (it once said the other checkout's)."""
    import importlib

    from kvtvm.compiler.knobs import schedules_dir

    imported = importlib.import_module("kvtvm.schedules")
    assert schedules_dir() == __import__("pathlib").Path(imported.__file__).resolve().parent
    other = tmp_path / "checkout"
    shutil.copytree(compiler.__file__.rsplit("/", 2)[0], other / "kvtvm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (other / "schedules").mkdir()  # a stale tree beside the copy: never the one digested
    out = run_python(textwrap.dedent("""
        import importlib, pathlib, sys
        sys.path.insert(0, sys.argv[1])  # the copy first, as `cd copy; python` would
        from kvtvm.compiler.knobs import schedules_dir
        import kvtvm
        m = importlib.import_module("kvtvm.schedules")
        print(kvtvm.__file__, pathlib.Path(m.__file__).resolve().parent, schedules_dir())
    """), str(other))
    kv, imported_dir, digested = out.split()
    assert kv.startswith(str(other)), out
    assert imported_dir == digested, out


def test_a_spec_refuses_what_its_file_name_would_misstate():
    """head_dim=True named files "_dTrue"; an unknown feature, or one of a family without it,
    was built as the plain kernel under a name saying it had it; a string was split into
    letters. numpy ints are sizes like any other."""
    import numpy as np

    base = dict(op="decode", dtype="float32", head_dim=16, n_kv_heads=2)
    for bad, name in ((dict(head_dim=True), "head_dim"), (dict(n_kv_heads=False), "n_kv_heads"),
                      (dict(features=("foo",)), "features"),
                      (dict(features="sliding_window"), "features"),
                      (dict(op="append", features=("sliding_window",)), "features")):
        with pytest.raises(InvalidArgumentError, match=name):
            compiler.KernelSpec(**{**base, **bad})
    spec = compiler.KernelSpec(**{**base, "head_dim": np.int64(16),
                                  "features": ["sliding_window", "sliding_window"]})
    assert type(spec.head_dim) is int and spec.features == ("sliding_window",)
    assert spec == compiler.KernelSpec(**base, features=("sliding_window",))
    assert compiler.KernelSpec(**base, features=None).features == ()
    with pytest.raises(InvalidArgumentError, match="knobs"):  # was a TypeError at load time
        compiler.KernelSpec(**base, knobs={"tile_tokens": [16, 32]})


def test_an_unknown_kvtvm_llvm_mcpu_is_named_before_building(tmp_path, monkeypatch):
    """LLVM printed 'Error: ... using default -mcpu=generic' and the generic build was filed
    under the name of the CPU asked for (`...-cpu-notacpu.so`)."""
    monkeypatch.setenv("KVTVM_LLVM_MCPU", "notacpu")
    with pytest.raises(InvalidArgumentError, match="KVTVM_LLVM_MCPU") as info:
        compiler.build_spec(SPEC, tmp_path)
    assert "'notacpu'" in str(info.value)
    assert not list(tmp_path.glob("*/*.so"))
    monkeypatch.setenv("KVTVM_LLVM_MCPU", "x86-64-v2")
    assert "x86-64-v2" in str(SPEC.tvm_target())
