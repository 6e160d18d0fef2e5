"""The kernel cache trusts nothing it did not write: owner and permission checks (like ssh),
explicit modes whatever the umask, sha256 checked before dlopen, corrupt entries rebuilt (or a
typed error naming the file without the compiler), corrupt tuning logs named."""

import json
import os
import stat

import pytest

from helpers import run_python, runtime_only_get_kernel
from kvtvm import compiler
from kvtvm.errors import CorruptKernelError, UntrustedKernelError

SPEC = compiler.KernelSpec(op="append", dtype="float32", head_dim=16, n_kv_heads=2)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTVM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KVTVM_KERNEL_PATH", raising=False)
    return tmp_path / "cache"


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_cache_is_0700_and_files_0644_whatever_the_umask(cache):
    old = os.umask(0)
    try:
        compiler.get_kernel(SPEC)
    finally:
        os.umask(old)
    d = compiler.cache_dir()
    assert _mode(cache) == 0o700 and _mode(d) == 0o700
    path = d / SPEC.file_name()
    assert _mode(path) == 0o644 and _mode(compiler.manifest_path(path)) == 0o644
    data = json.loads(compiler.manifest_path(path).read_text())
    assert len(data["sha256"]) == 64
    leftovers = [p.name for p in d.iterdir() if p.name.startswith(".") and "build" in p.name]
    assert not leftovers  # temp work files lived in the destination and were removed


def test_a_group_writable_cache_of_this_user_is_tightened(cache):
    d = compiler.cache_dir()
    d.mkdir(parents=True)
    os.chmod(d, 0o777)
    compiler.build_spec(SPEC, d)  # a planted or old entry ...
    compiler.get_kernel(compiler.KernelSpec(op="append", dtype="float32", head_dim=32,
                                            n_kv_heads=2))
    assert _mode(d) == 0o700


@pytest.mark.parametrize("planted", ["dir_writable", "file_writable", "other_owner"])
def test_planted_kernels_are_refused_with_the_path_and_reason(tmp_path, cache, monkeypatch,
                                                               planted):
    kernels = tmp_path / "kernels"
    path = compiler.build_spec(SPEC, kernels)
    if planted == "dir_writable":
        os.chmod(kernels, 0o777)
        target, reason = kernels, "writable by group or others"
    elif planted == "file_writable":
        os.chmod(path, 0o666)
        target, reason = path, "writable by group or others"
    else:
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(path, 12345, 12345)
        target, reason = path, "owned by uid 12345"
    monkeypatch.setenv("KVTVM_KERNEL_PATH", str(kernels))
    with pytest.raises(UntrustedKernelError, match=reason) as info:
        compiler.get_kernel(SPEC)
    assert str(target) in str(info.value)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_corrupt_cached_module_is_rebuilt(cache, damage):
    path = compiler.build_spec(SPEC, compiler.cache_dir())
    good = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(good[:len(good) // 3])
    else:
        path.write_bytes(good[:100] + bytes([good[100] ^ 0xFF]) + good[101:])
    assert not compiler.is_fresh(path, SPEC)
    fn = compiler.get_kernel(SPEC)
    assert fn is not None and compiler.is_fresh(path, SPEC)
    assert len(path.read_bytes()) == len(good)


def test_runtime_only_names_a_truncated_module_instead_of_crashing(tmp_path):
    out = tmp_path / "kernels"
    path = compiler.build_spec(SPEC, out)
    path.write_bytes(path.read_bytes()[:4096])
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1", KVTVM_KERNEL_PATH=str(out),
               KVTVM_CACHE_DIR=str(tmp_path / "empty-cache"))
    said = run_python(runtime_only_get_kernel(), env=env, timeout=120)
    assert "ERROR:" in said and str(path) in said and "sha256" in said, said


def test_a_corrupt_tuning_log_is_named(tmp_path, cache, monkeypatch):
    logs = tmp_path / "logs"
    log_path = compiler.tuning_log_path(SPEC, logs)
    log_path.parent.mkdir(parents=True)
    log_path.write_text('{"knobs": {"vector_bytes": 8')  # truncated JSON
    monkeypatch.setenv("KVTVM_TUNING_LOGS", str(logs))
    with pytest.raises(CorruptKernelError, match=str(log_path)):
        compiler.resolve_knobs(SPEC)
    log_path.write_text('{"knobs": [1, 2]}')
    with pytest.raises(CorruptKernelError, match="not an object"):
        compiler.resolve_knobs(SPEC)


@pytest.mark.parametrize("log, why", [
    ({"knobs": {"threads": 128}}, "knob 'threads' is not one of"),  # a CUDA log
    ({"knobs": {"vector_bytes": "32"}}, "knob 'vector_bytes' is '32', expected int"),
    ({"knobs": {"parallel": "no"}}, "knob 'parallel' is 'no', expected bool"),
    ({"knobs": {"vector_bytes": 16}, "target": "sm_90a"}, "tuned for target 'sm_90a'"),
    ({"knobs": {"vector_bytes": 16}, "uri": "append_float32_h2_g1_d32_nhd"}, "tuned for uri"),
])
def test_a_tuning_log_of_another_version_or_target_is_named(tmp_path, cache, monkeypatch, log,
                                                            why):
    """Such knobs were silently ignored (unknown names), built with a truthy string, or
    failed deep in the schedule with a bare TypeError."""
    logs = tmp_path / "logs"
    path = compiler.tuning_log_path(SPEC, logs)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(log))
    monkeypatch.setenv("KVTVM_TUNING_LOGS", str(logs))
    with pytest.raises(CorruptKernelError, match=why) as info:
        compiler.get_kernel(SPEC)
    assert str(path) in str(info.value)
    assert not (compiler.cache_dir() / SPEC.file_name()).exists()
    path.write_text(json.dumps({"knobs": {"vector_bytes": 16}, "uri": SPEC.uri,
                                "target": "llvm"}))
    assert compiler.resolve_knobs(SPEC)["vector_bytes"] == 16


# -- tuning logs and parent directories (as ssh: every directory up to home) -----------------

def _tuning_log(root):
    path = compiler.tuning_log_path(SPEC, root)
    path.parent.mkdir(parents=True)
    path.write_text('{"knobs": {}}')
    os.chmod(path, 0o644)
    return path


def _fake_owner(monkeypatch, target, uid):
    """Make ``trust._stat`` report ``target`` as owned by ``uid`` (no chown needed)."""
    from kvtvm.compiler import trust

    real = trust._stat

    def fake(path):
        st = real(path)
        if os.path.realpath(path) == os.path.realpath(target):
            fields = list(st)
            fields[stat.ST_UID] = uid
            return os.stat_result(fields)
        return st
    monkeypatch.setattr(trust, "_stat", fake)


@pytest.mark.parametrize("weak", ["log", "log_dir", "parent", "grandparent"])
@pytest.mark.parametrize("how", ["group_writable", "other_writable", "other_owner"])
def test_tuning_logs_and_every_parent_are_checked(tmp_path, cache, monkeypatch, weak, how):
    root = tmp_path / "a" / "b" / "logs"
    path = _tuning_log(root)
    target = {"log": path, "log_dir": path.parent, "parent": root,
              "grandparent": tmp_path / "a"}[weak]
    if how == "other_owner":
        _fake_owner(monkeypatch, target, 12345)
        reason = "owned by uid 12345"
    else:
        os.chmod(target, _mode(target) | (0o020 if how == "group_writable" else 0o002))
        reason = "writable by group or others"
    monkeypatch.setenv("KVTVM_TUNING_LOGS", str(root))
    with pytest.raises(UntrustedKernelError, match=reason) as info:
        compiler.resolve_knobs(SPEC)
    assert str(target) in str(info.value)
    if weak in ("parent", "grandparent"):
        assert "parent directory" in str(info.value)
    if how != "other_owner":  # fixed, it loads again
        os.chmod(target, _mode(target) & ~0o022)
        compiler.resolve_knobs(SPEC)


def test_a_trusted_tuning_log_is_read(tmp_path, cache, monkeypatch):
    root = tmp_path / "logs"
    path = _tuning_log(root)
    path.write_text('{"knobs": {"vector_bytes": 8}}')
    monkeypatch.setenv("KVTVM_TUNING_LOGS", str(root))
    assert compiler.tuned_knobs(SPEC) == {"vector_bytes": 8}


def test_the_parent_walk_stops_at_home_and_passes_root_owned_sticky_dirs(tmp_path, cache,
                                                                        monkeypatch):
    shared = tmp_path / "shared"
    root = shared / "home" / "logs"
    _tuning_log(root)
    os.chmod(shared, 0o777)
    monkeypatch.setenv("KVTVM_TUNING_LOGS", str(root))
    with pytest.raises(UntrustedKernelError, match=str(shared)):
        compiler.resolve_knobs(SPEC)
    monkeypatch.setenv("HOME", str(shared / "home"))   # above home: not walked
    compiler.resolve_knobs(SPEC)
    monkeypatch.setenv("HOME", str(tmp_path / "elsewhere"))
    os.chmod(shared, 0o1777)                              # sticky, but ours: still refused
    if os.geteuid() != 0:
        with pytest.raises(UntrustedKernelError, match=str(shared)):
            compiler.resolve_knobs(SPEC)
    _fake_owner(monkeypatch, shared, 0)                   # sticky and root's, like /tmp
    compiler.resolve_knobs(SPEC)


def test_a_kernel_directory_under_a_writable_parent_is_refused(tmp_path, cache, monkeypatch):
    kernels = tmp_path / "open" / "kernels"
    compiler.build_spec(SPEC, kernels)
    os.chmod(tmp_path / "open", 0o777)
    monkeypatch.setenv("KVTVM_KERNEL_PATH", str(kernels))
    with pytest.raises(UntrustedKernelError, match="parent directory") as info:
        compiler.get_kernel(SPEC)
    assert str(tmp_path / "open") in str(info.value)


def test_a_cache_under_a_parent_of_another_user_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTVM_CACHE_DIR", str(tmp_path / "theirs" / "cache"))
    monkeypatch.delenv("KVTVM_KERNEL_PATH", raising=False)
    (tmp_path / "theirs").mkdir(mode=0o755)
    _fake_owner(monkeypatch, tmp_path / "theirs", 12345)
    with pytest.raises(UntrustedKernelError, match="owned by uid 12345"):
        compiler.get_kernel(SPEC)


def test_what_build_and_tune_write_under_a_umask_of_002_loads(tmp_path, cache, monkeypatch):
    """A umask of 002 (user-private groups) once made `python -m kvtvm build --out`'s folders
    and `python -m kvtvm tune`'s log group-writable, which the loader then refused."""
    from kvtvm import cli, tune

    out, logs = tmp_path / "new" / "kernels", tmp_path / "new" / "logs"
    old = os.umask(0o002)
    try:
        assert cli.main(["build", "--target", "llvm", "--out", str(out), "--ops", "append",
                         "--dtypes", "float32", "--head-dims", "16", "--kv-heads", "2",
                         "--layouts", "nhd", "--no-progress"]) == 0
        assert tune.main(["--op", "copy", "--dtype", "float32", "--head-dim", "16",
                          "--max-trials", "1", "--repeat", "1", "--log-root", str(logs),
                          "--no-progress"]) == 0
    finally:
        os.umask(old)
    built = out / SPEC.file_name()
    for d in (tmp_path / "new", out, built.parent, logs, logs / "llvm"):
        assert _mode(d) == 0o755, d
    copy = compiler.KernelSpec(op="copy", dtype="float32", head_dim=16, n_kv_heads=1)
    log_path = compiler.tuning_log_path(copy, logs)
    assert _mode(log_path) == 0o644
    assert [p.name for p in log_path.parent.iterdir()] == [log_path.name]  # no temp left
    monkeypatch.setenv("KVTVM_KERNEL_PATH", str(out))
    monkeypatch.setenv("KVTVM_TUNING_LOGS", str(logs))
    compiler.get_kernel(SPEC)
    assert compiler.tuned_knobs(copy) == json.loads(log_path.read_text())["knobs"]


def test_a_cache_that_cannot_be_made_is_a_typed_error_naming_it(tmp_path, monkeypatch):
    """It was a bare NotADirectoryError / PermissionError / FileNotFoundError from mkdir."""
    from kvtvm.errors import KernelCacheError

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVTVM_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.delenv("KVTVM_KERNEL_PATH", raising=False)
    with pytest.raises(KernelCacheError, match="KVTVM_CACHE_DIR") as info:
        compiler.get_kernel(SPEC)
    assert str(blocker / "cache") in str(info.value) and isinstance(info.value, OSError)


def test_a_cache_refused_for_its_parent_creates_nothing(tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    monkeypatch.setenv("KVTVM_CACHE_DIR", str(theirs / "cache"))
    monkeypatch.delenv("KVTVM_KERNEL_PATH", raising=False)
    _fake_owner(monkeypatch, theirs, 12345)
    with pytest.raises(UntrustedKernelError, match="owned by uid 12345"):
        compiler.get_kernel(SPEC)
    assert list(theirs.iterdir()) == []  # nothing made inside another user's directory


def test_without_a_home_directory_the_walk_goes_to_the_root(tmp_path, cache, monkeypatch):
    """A container under an arbitrary uid (no HOME, no passwd entry): Path.home() raised and
    every kernel directory was refused as 'cannot be checked'."""
    from pathlib import Path

    kernels = tmp_path / "kernels"
    compiler.build_spec(SPEC, kernels)
    monkeypatch.setenv("KVTVM_KERNEL_PATH", str(kernels))

    def no_home():
        raise RuntimeError("Could not determine home directory.")
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    compiler.get_kernel(SPEC)
    os.chmod(tmp_path, 0o777)  # still walked: a writable parent is refused
    try:
        with pytest.raises(UntrustedKernelError, match="parent directory"):
            compiler.get_kernel(compiler.KernelSpec(op="append", dtype="float32", head_dim=16,
                                                    n_kv_heads=2, variant="serial"))
    finally:
        os.chmod(tmp_path, 0o700)


@pytest.mark.parametrize("mode", [0o1777, 0o755])
def test_kvtvm_cache_dir_itself_keeps_its_mode(tmp_path, monkeypatch, mode):
    """KVTVM_CACHE_DIR=/tmp (as root: a container) was chmod-ed to 0700, sticky bit dropped,
    and KVTVM_CACHE_DIR=$HOME likewise: only kvtvm's own folders are tightened."""
    base = tmp_path / "shared"
    base.mkdir()
    os.chmod(base, mode)
    monkeypatch.setenv("KVTVM_CACHE_DIR", str(base))
    monkeypatch.delenv("KVTVM_KERNEL_PATH", raising=False)
    if mode & 0o002 and os.geteuid() != 0:  # a sticky dir of ours, not root's: refused
        with pytest.raises(UntrustedKernelError, match="writable by group or others"):
            compiler.get_kernel(SPEC)
    else:
        compiler.get_kernel(SPEC)
        assert _mode(compiler.cache_dir()) == 0o700
    assert stat.S_IMODE(os.stat(base).st_mode) == mode
