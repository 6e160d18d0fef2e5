"""More of what the kernel cache trusts: symlinks resolved once and every link met checked
(the resolved path is the one hashed and loaded), a module built into the cache checked as a
found one before it is loaded, a runtime-only reader racing a rebuild, tuned knobs inside one
grid of a union, ``~user`` in the path variables, ``build --out`` refusing what the loader
would, work folders of killed builds, a tuning log that is no JSON object.

One CPU kernel is built per module and copied for each test (a build takes seconds)."""

import json
import os
import shutil
import threading
import time

import pytest
from filelock import FileLock

from kvtvm import compiler, runtime
from kvtvm.compiler import build, cache, knobs, trust
from kvtvm.errors import CorruptKernelError, InvalidArgumentError, UntrustedKernelError

SPEC = compiler.KernelSpec(op="copy", dtype="float32", head_dim=8, n_kv_heads=1)
OTHER_UID = 12345
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A kernel directory holding SPEC, built once for the module."""
    out = tmp_path_factory.mktemp("built") / "kernels"
    compiler.build_spec(SPEC, out)
    return out


@pytest.fixture
def kernels(tmp_path, built, monkeypatch):
    """A copy of :func:`built` of this test's own (modes kept), an empty cache, no kernel
    path; returns the copy."""
    monkeypatch.setenv("KVTVM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KVTVM_KERNEL_PATH", raising=False)
    (tmp_path / "mine").mkdir(mode=0o755)
    return shutil.copytree(built, tmp_path / "mine" / "kernels")


def _open_dir(tmp_path, name="open", mode=0o777):
    """A directory others may write (``mode`` whatever the umask)."""
    d = tmp_path / name
    d.mkdir()
    os.chmod(d, mode)
    return d


# -- 1. symlinks: resolved once, each link checked, the resolved path loaded -----------------

@pytest.mark.parametrize("variable", ["KVTVM_KERNEL_PATH", "KVTVM_CACHE_DIR",
                                      "KVTVM_TUNING_LOGS", "prebuilt"])
def test_a_link_in_a_directory_others_may_write_is_refused(tmp_path, kernels, monkeypatch,
                                                           variable):
    """Only the link's target and the directories above the target were checked: anyone
    could re-point a link sitting in a writable directory between the checks and the load."""
    opened = _open_dir(tmp_path)
    link = opened / "link"
    if variable == "KVTVM_KERNEL_PATH":
        link.symlink_to(kernels)
        monkeypatch.setenv(variable, str(link))
        call = lambda: compiler.get_kernel(SPEC)  # noqa: E731
    elif variable == "KVTVM_CACHE_DIR":
        (tmp_path / "mine" / "cache").mkdir(mode=0o700)
        link.symlink_to(tmp_path / "mine" / "cache")
        monkeypatch.setenv(variable, str(link))
        call = lambda: compiler.get_kernel(SPEC)  # noqa: E731
    elif variable == "KVTVM_TUNING_LOGS":
        logs = tmp_path / "mine" / "logs"
        trust.write_file(compiler.tuning_log_path(SPEC, logs), '{"knobs": {}}')
        link.symlink_to(logs)
        monkeypatch.setenv(variable, str(link))
        call = lambda: compiler.resolve_knobs(SPEC)  # noqa: E731
    else:  # `python -m kvtvm tune --prebuilt DIR` checks DIR so
        link.symlink_to(kernels)
        call = lambda: trust.check_trusted_tree(link, "prebuilt candidates directory")  # noqa
    with pytest.raises(UntrustedKernelError, match="writable by group or others") as info:
        call()
    assert str(opened) in str(info.value) and "parent directory" in str(info.value)
    os.chmod(opened, 0o755)  # the same link in a safe directory passes
    call()


@needs_root
def test_a_link_of_another_user_in_a_sticky_directory_is_refused(tmp_path, kernels,
                                                                 monkeypatch):
    """A root-owned sticky directory (/tmp) passes as a parent, but the owner of a link in it
    may replace the link: KVTVM_KERNEL_PATH=/tmp/their-link loaded whatever it led to."""
    sticky = _open_dir(tmp_path, "sticky", 0o1777)
    link = sticky / "kernels"
    link.symlink_to(kernels)
    os.lchown(link, OTHER_UID, OTHER_UID)
    monkeypatch.setenv("KVTVM_KERNEL_PATH", str(link))
    with pytest.raises(UntrustedKernelError, match=f"owned by uid {OTHER_UID}") as info:
        compiler.get_kernel(SPEC)
    assert f"symbolic link {link}" in str(info.value)
    os.lchown(link, 0, 0)  # root's (or ours): it cannot be re-pointed by another user
    compiler.get_kernel(SPEC)


def test_the_resolved_path_is_the_one_loaded(tmp_path, kernels, monkeypatch):
    """The checks followed the link; the load opened the link's path again, wherever it led
    by then."""
    link = tmp_path / "mine" / "link"
    link.symlink_to(kernels)
    evil = shutil.copytree(kernels, tmp_path / "mine" / "evil")
    monkeypatch.setenv("KVTVM_KERNEL_PATH", str(link))
    want = os.path.realpath(kernels / SPEC.file_name())
    loaded, real_load = [], runtime.load_module

    def racing_load(path, needs_cuda):
        link.unlink()  # re-pointed between the checks and dlopen
        link.symlink_to(evil)
        loaded.append(path)
        return real_load(path, needs_cuda)
    monkeypatch.setattr(runtime, "load_module", racing_load)
    compiler.get_kernel(SPEC)
    assert loaded == [want]


def test_a_symlink_loop_is_refused_not_followed_forever(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.symlink_to(b)
    b.symlink_to(a)
    with pytest.raises(UntrustedKernelError, match="too many levels of symbolic links"):
        trust.check_trusted(a / "x.so")


# -- 2. a module built into the cache is checked as one found there --------------------------

def test_a_writable_target_folder_in_the_cache_is_refused_before_building(kernels):
    folder = (compiler.cache_dir() / SPEC.file_name()).parent
    folder.mkdir(parents=True)
    os.chmod(compiler.cache_dir(), 0o700)
    os.chmod(folder, 0o777)  # others may swap files in it
    with pytest.raises(UntrustedKernelError, match="writable by group or others") as info:
        compiler.get_kernel(SPEC)
    assert str(folder) in str(info.value)
    assert list(folder.iterdir()) == []  # nothing built into it


def test_a_module_just_built_is_checked_before_it_is_loaded(kernels, monkeypatch):
    def build_then_open(spec, out_dir):  # the build stands in: a copy of the built module
        out = os.path.join(out_dir, spec.file_name())
        os.makedirs(os.path.dirname(out), exist_ok=True)
        for src in (kernels / spec.file_name(), compiler.manifest_path(kernels /
                                                                        spec.file_name())):
            shutil.copy(src, os.path.join(os.path.dirname(out), src.name))
        os.chmod(out, 0o666)  # a file others can write, as the loader would find it
        return compiler.cache_dir() / spec.file_name()
    monkeypatch.setattr(build, "build_spec", build_then_open)
    with pytest.raises(UntrustedKernelError, match="writable by group or others") as info:
        compiler.get_kernel(SPEC)
    assert SPEC.file_name().split("/")[-1] in str(info.value)


# -- 3. a runtime-only reader racing a rebuild -----------------------------------------------

def test_a_runtime_only_reader_waits_for_a_rebuild_in_progress(kernels, monkeypatch):
    """A rebuild renames the module into place, then writes its manifest: a runtime-only
    reader in between saw new bytes with the old manifest, a CorruptKernelError."""
    path = kernels / SPEC.file_name()
    manifest = compiler.manifest_path(path)
    good = manifest.read_text()
    monkeypatch.setattr(runtime, "compiler_available", lambda: False)
    monkeypatch.setenv("KVTVM_KERNEL_PATH", str(kernels))
    held, seen, real_check = threading.Event(), threading.Event(), cache.check_digest

    def check_digest(*args):  # the reader compared the module with the old manifest
        why = real_check(*args)
        seen.set()
        return why
    monkeypatch.setattr(cache, "check_digest", check_digest)

    def rebuild():  # build_spec's lock file: .<name>.lock beside the module
        with FileLock(str(path.parent / f".{path.name}.lock")):
            manifest.write_text(json.dumps({**json.loads(good), "sha256": "0" * 64}))
            held.set()
            seen.wait(30)
            time.sleep(0.2)
            manifest.write_text(good)  # the new manifest, then the lock released
    builder = threading.Thread(target=rebuild)
    builder.start()
    try:
        assert held.wait(10)
        assert compiler.get_kernel(SPEC) is not None
    finally:
        builder.join()


def test_a_runtime_only_reader_still_names_a_corrupt_module(kernels, monkeypatch):
    path = kernels / SPEC.file_name()
    path.write_bytes(path.read_bytes()[:4096])
    monkeypatch.setattr(runtime, "compiler_available", lambda: False)
    monkeypatch.setenv("KVTVM_KERNEL_PATH", str(kernels))
    with pytest.raises(CorruptKernelError, match="sha256") as info:
        compiler.get_kernel(SPEC)
    assert str(path) in str(info.value)


# -- 4. tuned knobs lie inside one grid of a union -------------------------------------------

def _log(tmp_path, monkeypatch, spec, data):
    logs = tmp_path / "logs"
    path = trust.write_file(compiler.tuning_log_path(spec, logs), json.dumps(data))
    monkeypatch.setenv("KVTVM_TUNING_LOGS", str(logs))
    return path


def test_tuned_knobs_must_lie_in_one_grid_of_a_union(tmp_path, kernels, monkeypatch):
    defaults, space = compiler.default_knobs(SPEC), knobs.knob_space(SPEC)
    names = sorted(set(space) & set(defaults))
    assert len(names) >= 2
    other = {k: next(v for v in space[k] if v != defaults[k]) for k in names}
    monkeypatch.setattr(knobs, "knob_space", lambda spec: [
        {k: [defaults[k]] for k in names}, {k: [v] for k, v in other.items()}])
    path = _log(tmp_path, monkeypatch, SPEC, {"knobs": {names[0]: other[names[0]]}})
    with pytest.raises(CorruptKernelError, match="no combination") as info:
        compiler.resolve_knobs(SPEC)  # each value in a grid, the combination in none
    assert str(path) in str(info.value)
    _log(tmp_path, monkeypatch, SPEC, {"knobs": other})
    assert compiler.resolve_knobs(SPEC) == {**defaults, **other}
    _log(tmp_path, monkeypatch, SPEC, {"knobs": defaults})  # the default candidate won
    assert compiler.resolve_knobs(SPEC) == defaults


def test_a_prefill_sm90a_combination_of_two_grids_is_refused(tmp_path, kernels, monkeypatch):
    """The reported case: the mma.sync prefill with a value of the wgmma grids (16 warps),
    which spills and overflows shared memory, was accepted value by value."""
    spec = compiler.KernelSpec("prefill", "float16", 128, 8, 4, target="cuda", arch="sm_90a")
    grids = knobs.knob_grids(spec)
    mixed = next(({**{k: v[0] for k, v in gi.items()}, k: value}
                  for gi in grids for gj in grids for k in gi.keys() & gj.keys()
                  for value in gj[k] if not knobs.in_a_grid(
                      {**{n: v[0] for n, v in gi.items()}, k: value}, grids)), None)
    if mixed is None:
        pytest.skip("the sm_90a prefill grids mix into no combination outside them")
    _log(tmp_path, monkeypatch, spec, {"knobs": mixed})
    with pytest.raises(CorruptKernelError, match="no combination"):
        compiler.resolve_knobs(spec)
    _log(tmp_path, monkeypatch, spec, {"knobs": {k: v[0] for k, v in grids[0].items()}})
    compiler.resolve_knobs(spec)


# -- 5. ~user of an unknown user in the path variables ---------------------------------------

@pytest.mark.parametrize("variable", ["KVTVM_CACHE_DIR", "KVTVM_KERNEL_PATH",
                                      "KVTVM_TUNING_LOGS"])
def test_an_unknown_user_in_a_path_variable_is_named(kernels, monkeypatch, variable):
    monkeypatch.setenv(variable, "~no_such_kvtvm_user/k")
    with pytest.raises(InvalidArgumentError, match=variable):
        if variable == "KVTVM_TUNING_LOGS":
            compiler.tuning_logs_dir()
        else:
            compiler.kernel_dirs()
    with pytest.raises(InvalidArgumentError, match="path"):
        compiler.add_kernel_dir("~no_such_kvtvm_user/k")


# -- 6. `python -m kvtvm build --out` refuses a tree the loader would refuse -----------------

BUILD = ["build", "--target", "llvm", "--ops", "copy", "--dtypes", "float32", "--head-dims",
         "8", "--kv-heads", "1", "--layouts", "nhd", "--no-progress"]


def test_build_out_under_a_writable_parent_is_refused_and_nothing_made(tmp_path, capsys):
    from kvtvm import cli

    opened = _open_dir(tmp_path)
    out = opened / "new" / "kernels"
    assert cli.main(BUILD + ["--out", str(out)]) == 2
    said = capsys.readouterr().err
    assert f"its parent directory {opened} is writable by group or others" in said, said
    assert list(opened.iterdir()) == []


def test_build_out_with_a_writable_target_folder_is_refused(kernels, capsys):
    from kvtvm import cli

    folder = (kernels / SPEC.file_name()).parent
    os.chmod(folder, 0o777)
    assert cli.main(BUILD + ["--out", str(kernels)]) == 2
    said = capsys.readouterr().err
    assert f"kernel directory {folder}: writable by group or others" in said, said


# -- 7. work folders of killed builds --------------------------------------------------------

def test_work_folders_of_killed_builds_are_removed_under_the_lock(kernels):
    path = kernels / SPEC.file_name()
    stale = path.parent / f".{path.stem}.build-killed"
    (stale / "sub").mkdir(parents=True)
    theirs = path.parent / ".another_kernel-host-0.build-live"
    theirs.mkdir()
    assert compiler.build_spec(SPEC, kernels) == path  # fresh: kept, not rebuilt
    assert not stale.exists() and theirs.exists()


# -- 8. a tuning log that is no JSON object --------------------------------------------------

@pytest.mark.parametrize("text, kind", [("[1, 2]", "list"), ('"knobs"', "str")])
def test_a_tuning_log_that_is_no_object_is_named_so(tmp_path, kernels, monkeypatch, text,
                                                    kind):
    path = _log(tmp_path, monkeypatch, SPEC, {})
    path.write_text(text)
    with pytest.raises(CorruptKernelError, match=f"holds a JSON {kind}, not an object") as info:
        compiler.resolve_knobs(SPEC)
    assert str(path) in str(info.value)
