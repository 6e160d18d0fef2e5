"""What kvtvm reads back from disk -- tuning logs, kernel manifests, tune's candidate lists,
kernel modules, fatbins -- damaged or hostile: each is a typed error or a rebuild, never a
hang, an untyped exception, or a kernel built with values the schedule was never checked with
(a copy with ``rows_per_task = -3`` skipped rows; a decode with 24-token tiles summed the wrong
scores; ``tile_tokens = 10**9`` hung the build)."""

import glob
import json
import os
import re
from pathlib import Path

import pytest

from kvtvm import compiler, tune
from kvtvm.compiler import knobs as knobs_mod
from kvtvm.compiler.trust import MAX_JSON_BYTES, read_json
from kvtvm.errors import CorruptKernelError, InvalidArgumentError

DECODE = compiler.KernelSpec("decode", "float32", 16, 1, 1)
COPY = compiler.KernelSpec("copy", "float32", 16, 1, 1)

STORAGE = {"i8": "int8", "e4m3": "float8_e4m3fn", "full": ""}


def _log(tmp_path, monkeypatch, spec, content):
    """Write ``content`` (a dict, or raw bytes) as ``spec``'s tuning log in a fresh root."""
    monkeypatch.setenv("KVTVM_TUNING_LOGS", str(tmp_path / "logs"))
    path = compiler.tuning_log_path(spec)
    path.parent.mkdir(parents=True, mode=0o755)
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    path.chmod(0o644)
    return path


@pytest.mark.parametrize("spec, knobs", [
    (DECODE, {"tile_tokens": 0}), (DECODE, {"tile_tokens": -8}),
    (DECODE, {"tile_tokens": 24}), (DECODE, {"tile_tokens": 10 ** 9}),
    (DECODE, {"head_block": 0}), (DECODE, {"prefetch_locality": 99}),
    (COPY, {"rows_per_task": -3}), (COPY, {"rows_per_task": 0}),
])
def test_a_tuning_log_value_the_tuner_never_searches_is_corrupt(tmp_path, monkeypatch, spec,
                                                                 knobs):
    _log(tmp_path, monkeypatch, spec, {"uri": spec.uri, "target": "llvm", "knobs": knobs})
    name = next(iter(knobs))
    with pytest.raises(CorruptKernelError, match=f"{name}.*not one of the values"):
        compiler.resolve_knobs(spec)


@pytest.mark.parametrize("content, why", [
    (b"[" * 100000, "nested too deeply"),
    (b"{" + b" " * (MAX_JSON_BYTES + 10) + b"}", "more than"),
    ("fifo", "not a regular file"),
    ("dangling", "symlink to nothing"),  # was: silently no log
    ("loop", "symlink to nothing"),
])
def test_a_tuning_log_that_is_deep_huge_or_a_fifo_is_corrupt_not_a_crash(
        tmp_path, monkeypatch, content, why):
    path = _log(tmp_path, monkeypatch, DECODE, b"{}")
    if content == "fifo":  # reading one would wait for a writer forever
        path.unlink()
        os.mkfifo(path, 0o644)
    elif content in ("dangling", "loop"):
        path.unlink()
        path.symlink_to(path if content == "loop" else tmp_path / "gone.json")
    else:
        path.write_bytes(content)
    with pytest.raises(CorruptKernelError, match=why):
        compiler.resolve_knobs(DECODE)


@pytest.mark.parametrize("spec, knobs, match", [
    (DECODE, {"tile_tokens": -8}, "tile_tokens"), (DECODE, {"tile_tokens": 10 ** 9}, "tile_tokens"),
    (COPY, {"rows_per_task": -3}, "rows_per_task"),
])
def test_an_explicit_knob_far_outside_the_searched_range_is_refused(spec, knobs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        compiler.resolve_knobs(compiler.KernelSpec(**{**spec.__dict__, "knobs": knobs}))


def test_an_explicit_zero_is_left_to_the_schedule():
    """0 can mean something (the CPU prefill's tile_q = 0 schedules the definition itself);
    a schedule that cannot build it refuses it by name."""
    prefill = compiler.KernelSpec("prefill", "float32", 16, 1, 1, knobs={"tile_q": 0})
    assert compiler.resolve_knobs(prefill)["tile_q"] == 0
    for spec, name in ((DECODE, "tile_tokens"), (COPY, "rows_per_task")):
        zero = compiler.KernelSpec(**{**spec.__dict__, "knobs": {name: 0}})
        with pytest.raises(ValueError, match=name):
            compiler.lower(zero)


@pytest.mark.parametrize("knobs, match", [
    ({"tile_tokens": 24}, "tile_tokens"), ({"vector_bytes": 48}, "vector_bytes"),
    ({"head_block": 3}, "head_block"),
])
def test_the_cpu_decode_refuses_knobs_it_cannot_build_right(knobs, match):
    spec = compiler.KernelSpec("decode", "float32", 16, 2, 1, knobs=knobs)
    with pytest.raises(ValueError, match=match):
        compiler.lower(spec)


def _shipped_spec(path: str):
    """The spec a shipped tuning log was written for (from its file name)."""
    uri, target = Path(path).stem, Path(path).parent.name
    m = re.fullmatch(r"(\w+?)_(float32|float16|bfloat16)_h(\d+)_g(\d+)_d(\d+)_(nhd|hnd)"
                     r"(?:_k(\w+)_v(\w+))?", uri)
    op, dtype, h, g, d, layout, ks, vs = m.groups()
    where = {"target": "llvm"} if target == "llvm" else {"target": "cuda", "arch": target}
    spec = compiler.KernelSpec(op, dtype, int(d), int(h), int(g), layout,
                               k_storage=STORAGE.get(ks, ""), v_storage=STORAGE.get(vs, ""),
                               **where)
    assert spec.uri == uri and spec.target_tag == target, path
    return spec


SHIPPED = sorted(glob.glob(str(knobs_mod.tuning_logs_dir() / "*" / "*.json")))


@pytest.mark.skipif(not SHIPPED, reason="no tuning logs shipped")
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: Path(p).stem)
def test_every_shipped_tuning_log_passes_the_value_check(path):
    spec = _shipped_spec(path)
    logged = json.loads(Path(path).read_text())["knobs"]
    resolved = compiler.resolve_knobs(spec)
    assert {k: resolved[k] for k in logged} == logged


def test_read_json_refuses_what_is_not_a_small_regular_json_file(tmp_path):
    (tmp_path / "ok.json").write_text('{"a": 1}')
    assert read_json(tmp_path / "ok.json") == {"a": 1}
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OSError, match="not a regular file"):
        read_json(tmp_path / "fifo")
    with pytest.raises(OSError, match="not a regular file"):
        read_json(tmp_path)  # a directory
    (tmp_path / "bad").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError):
        read_json(tmp_path / "bad")


def test_a_deeply_nested_manifest_is_not_fresh_and_is_rebuilt(tmp_path):
    path = compiler.build_spec(COPY, tmp_path / "kernels")
    compiler.manifest_path(path).write_bytes(b"[" * 100000)
    assert compiler.read_manifest(path) is None
    assert not compiler.is_fresh(path, COPY)


def test_a_candidate_file_outside_the_candidates_tree_is_refused_before_loading(tmp_path):
    """An absolute (or ``..``) candidate path loaded a module from anywhere, skipping the
    ownership checks of the directories above it."""
    built = tmp_path / "built"
    manifest = tune.build_candidates(COPY, 1, built)
    listed = json.loads(manifest.read_text())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    module = built / listed["candidates"][0]["file"]
    for name in (module.name, compiler.manifest_path(module).name):
        (elsewhere / name).write_bytes((module.parent / name).read_bytes())
    for file in (str(elsewhere / module.name), f"../elsewhere/{module.name}"):
        listed["candidates"][0]["file"] = file
        manifest.write_text(json.dumps(listed))
        with pytest.raises(CorruptKernelError, match="outside"):
            tune.tune(COPY, "cpu", repeat=1, warmup=0, write=False, prebuilt=built)


def test_a_module_without_the_kernel_function_is_corrupt(tmp_path, monkeypatch):
    """A module of another op under this spec's name (digest and manifest made to match)
    raised an untyped AttributeError."""
    from kvtvm.compiler import cache

    other = compiler.build_spec(DECODE, tmp_path / "other")
    target = tmp_path / "kernels" / COPY.file_name()
    target.parent.mkdir(parents=True)
    target.write_bytes(other.read_bytes())
    data = json.loads(compiler.manifest_path(other).read_text())
    data["spec"] = json.loads(json.dumps(compiler.manifest.spec_fields(COPY), default=str))
    data["source_digest"] = compiler.source_digest(COPY)
    data["knobs"] = compiler.resolve_knobs(COPY)
    compiler.manifest_path(target).write_text(json.dumps(data))
    assert compiler.is_fresh(target, COPY), compiler.manifest.spec_mismatch(target, COPY, data)
    monkeypatch.setattr(cache, "_loaded", {})
    monkeypatch.setenv("KVTVM_KERNEL_PATH", str(tmp_path / "kernels"))
    monkeypatch.setenv("KVTVM_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(CorruptKernelError, match="holds no function"):
        compiler.get_kernel(COPY)


def test_a_damaged_fatbin_is_a_value_error_not_a_loop():
    import struct

    from kvtvm.compiler.fatbin import fatbin_architectures

    header = struct.pack("<IHHQ", 0xBA55ED50, 1, 16, 64)
    with pytest.raises(ValueError, match="empty entry"):  # looped forever
        fatbin_architectures(header + bytes(64))
    with pytest.raises(ValueError, match="truncated"):  # was struct.error
        fatbin_architectures(header + bytes(8))
