"""Kernel files changed after kvtvm built them are never loaded as the spec asked for: a
module (with its manifest) renamed or copied to another spec's file name, a manifest edited to
another CPU target, a group-writable ``<target>/`` folder inside a kernel directory."""

import json
import os
import shutil

import pytest
from helpers import run_python, runtime_only_get_kernel

from kvtvm import compiler
from kvtvm.compiler import build
from kvtvm.compiler.manifest import spec_mismatch
from kvtvm.errors import UntrustedKernelError

SPEC = compiler.KernelSpec(op="append", dtype="float32", head_dim=16, n_kv_heads=2)
#: another kernel that takes the very same arguments: the serial variant of SPEC
SERIAL = compiler.KernelSpec(**{**SPEC.__dict__, "variant": "serial"})


def _swap(kernels, tamper):
    """SPEC's file in ``kernels`` replaced by another kernel, by ``tamper``; returns its path."""
    path = compiler.build_spec(SPEC, kernels)
    if tamper == "renamed":  # the serial build, module and manifest, under SPEC's name
        other = compiler.build_spec(SERIAL, kernels)
        shutil.copy(other, path)
        shutil.copy(compiler.manifest_path(other), compiler.manifest_path(path))
    else:  # a manifest saying the module was built for another CPU
        data = json.loads(compiler.manifest_path(path).read_text())
        data["target_key"] = "cpu-some_other_cpu"
        compiler.manifest_path(path).write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("tamper", ["renamed", "other_cpu"])
def test_a_module_of_another_spec_is_not_fresh_and_is_rebuilt(tmp_path, monkeypatch, tamper):
    kernels = tmp_path / "kernels"
    path = _swap(kernels, tamper)
    assert not compiler.is_fresh(path, SPEC)
    why = spec_mismatch(path, SPEC)
    assert why and ("variant" in why if tamper == "renamed" else "some_other_cpu" in why)
    monkeypatch.setenv("KVTVM_KERNEL_PATH", str(kernels))
    monkeypatch.setenv("KVTVM_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real = build.build_spec
    monkeypatch.setattr(build, "build_spec", lambda s, d: calls.append(s) or real(s, d))
    compiler.get_kernel(SPEC)
    assert calls == [SPEC]  # rebuilt into the cache, not loaded from the prebuilt dir
    assert compiler.is_fresh(compiler.cache_dir() / SPEC.file_name(), SPEC)


@pytest.mark.parametrize("tamper", ["renamed", "other_cpu"])
def test_runtime_only_refuses_a_module_of_another_spec(tmp_path, tamper):
    kernels = tmp_path / "kernels"
    path = _swap(kernels, tamper)
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1", KVTVM_KERNEL_PATH=str(kernels),
               KVTVM_CACHE_DIR=str(tmp_path / "empty-cache"))
    said = run_python(runtime_only_get_kernel(), env=env, timeout=120)
    assert "ERROR:" in said and str(path) in said and "renamed or copied" in said, said


def test_a_writable_target_folder_inside_a_kernel_directory_is_refused(tmp_path, monkeypatch):
    kernels = tmp_path / "kernels"
    path = compiler.build_spec(SPEC, kernels)
    os.chmod(path.parent, 0o777)  # kernels/llvm: anyone could rename files in it
    monkeypatch.setenv("KVTVM_KERNEL_PATH", str(kernels))
    monkeypatch.setenv("KVTVM_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(UntrustedKernelError, match="writable by group or others") as info:
        compiler.get_kernel(SPEC)
    assert str(path.parent) in str(info.value)


def test_add_kernel_dir_refuses_what_is_not_a_directory_path():
    """"" searched the current directory (Path("") is "."); None was a bare TypeError."""
    from kvtvm.errors import InvalidArgumentError

    before = compiler.kernel_dirs()
    for bad in ("", "  ", None, 3):
        with pytest.raises(InvalidArgumentError, match="path"):
            compiler.add_kernel_dir(bad)
    assert compiler.kernel_dirs() == before


def test_a_symlinked_module_into_a_writable_directory_is_refused(tmp_path, monkeypatch):
    """The link's target was checked (this user's, 0644) but not the directories above it:
    anyone could swap the file the link leads to."""
    kernels = tmp_path / "kernels"
    path = compiler.build_spec(SPEC, kernels)
    elsewhere = tmp_path / "open"
    elsewhere.mkdir()
    os.chmod(elsewhere, 0o777)
    moved = elsewhere / path.name
    shutil.move(path, moved)
    path.symlink_to(moved)
    monkeypatch.setenv("KVTVM_KERNEL_PATH", str(kernels))
    monkeypatch.setenv("KVTVM_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(UntrustedKernelError, match="parent directory") as info:
        compiler.get_kernel(SPEC)
    assert str(elsewhere) in str(info.value)
    os.chmod(elsewhere, 0o755)  # a link into a safe directory loads
    compiler.get_kernel(SPEC)


def test_paths_from_the_environment_expand_the_home_directory(tmp_path, monkeypatch):
    """A "~/..." that no shell expanded (Docker's ENV, systemd) was a folder named "~" in the
    current directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KVTVM_CACHE_DIR", "~/cache")
    monkeypatch.setenv("KVTVM_KERNEL_PATH", "~/kernels" + os.pathsep + " ")
    monkeypatch.setenv("KVTVM_TUNING_LOGS", "~/logs")
    dirs = compiler.kernel_dirs()
    assert dirs[0] == tmp_path / "kernels" and dirs[-1].parent == tmp_path / "cache"
    assert len(dirs) == 2 and compiler.tuning_logs_dir() == tmp_path / "logs"


@pytest.mark.parametrize("where", ["module", "manifest"])
def test_a_fifo_in_the_cache_is_rebuilt_over_not_waited_on(tmp_path, monkeypatch, where):
    """A FIFO at a module's or its manifest's path passed the owner and mode checks, then its
    digest (or the manifest) was read: open() waited for a writer forever, and with it every op
    needing that kernel. It is now not a regular file: not fresh, rebuilt (in a subprocess
    with a deadline, so a regression fails instead of hanging the suite)."""
    cache = tmp_path / "cache"
    env = dict(os.environ, KVTVM_CACHE_DIR=str(cache), KVTVM_KERNEL_PATH="")
    script = f"""
import os
from kvtvm import compiler
spec = compiler.KernelSpec(op="append", dtype="float32", head_dim=16, n_kv_heads=2)
compiler.get_kernel(spec)
path = compiler.cache_dir() / spec.file_name()
target = compiler.manifest_path(path) if {where == "manifest"} else path
target.unlink()
os.mkfifo(target)
assert not compiler.is_fresh(path, spec)
from kvtvm.compiler import cache
cache._loaded.clear()
compiler.get_kernel(spec)
assert compiler.is_fresh(path, spec) and os.path.isfile(target)
print("REBUILT")
"""
    said = run_python(script, env=env, timeout=240)
    assert "REBUILT" in said, said


@pytest.mark.parametrize("digest", [12345, True, {}, ["ab"]])
def test_a_manifest_sha256_of_another_type_is_not_fresh(tmp_path, digest):
    """An edited manifest whose sha256 was not a string raised an untyped TypeError while
    wording the mismatch."""
    path = compiler.build_spec(SPEC, tmp_path / "kernels")
    data = json.loads(compiler.manifest_path(path).read_text())
    data["sha256"] = digest
    compiler.manifest_path(path).write_text(json.dumps(data))
    assert not compiler.is_fresh(path, SPEC)
