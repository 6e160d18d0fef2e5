"""``python -m kvtvm.tune`` in two steps (``--build-only`` here, ``--prebuilt`` on the machine
that times them), exercised on the CPU target."""

import json

import pytest

from kvtvm import compiler, tune


def _copy_spec():
    return compiler.KernelSpec(op="copy", dtype="float32", head_dim=64, n_kv_heads=1)


def test_build_only_then_prebuilt_records_the_fastest_listed_candidate(tmp_path):
    spec = _copy_spec()
    built = tmp_path / "built"
    manifest = tune.build_candidates(spec, 3, built)
    listed = json.loads(manifest.read_text())
    assert listed["spec"]["op"] == "copy" and len(listed["candidates"]) == 3
    assert listed["candidates"][0]["knobs"] == compiler.resolve_knobs(spec)  # default first
    for cand in listed["candidates"]:
        assert (built / cand["file"]).is_file()
    assert tune.manifest_specs(built) == [spec]
    assert tune.manifest_specs(built, "decode") == []

    entry = tune.tune(spec, "cpu", repeat=3, warmup=1, log_root=tmp_path / "logs",
                      prebuilt=built)
    assert [t["knobs"] for t in entry["trials"]] == [c["knobs"] for c in listed["candidates"]]
    timed = [t for t in entry["trials"] if "median_ms" in t]
    assert len(timed) == 3
    assert entry["median_ms"] == min(t["median_ms"] for t in timed)
    assert entry["default_ms"] == entry["trials"][0]["median_ms"]
    logged = json.loads((tmp_path / "logs" / "llvm" / f"{spec.uri}.json").read_text())
    assert logged["knobs"] == entry["knobs"]


def test_prebuilt_reports_a_candidate_that_did_not_build(tmp_path):
    spec = _copy_spec()
    manifest = tune.build_candidates(spec, 2, tmp_path)
    listed = json.loads(manifest.read_text())
    listed["candidates"][1] = {"knobs": listed["candidates"][1]["knobs"], "error": "nvcc: boom"}
    manifest.write_text(json.dumps(listed))
    entry = tune.tune(spec, "cpu", repeat=2, warmup=1, write=False, prebuilt=tmp_path)
    assert entry["trials"][1] == {"knobs": listed["candidates"][1]["knobs"],
                                  "error": "nvcc: boom"}


def test_prebuilt_without_candidates_says_how_to_build_them(tmp_path):
    with pytest.raises(SystemExit, match="--build-only"):
        tune.tune(_copy_spec(), "cpu", write=False, prebuilt=tmp_path)
    with pytest.raises(SystemExit, match="--build-only"):
        tune.main(["--prebuilt", str(tmp_path)])


def test_a_knob_space_may_be_a_union_of_grids():
    """sm_90a prefill searches two kernels: the mma.sync grid and the wgmma grid, whose
    settings are only the ones that kernel accepts (whole warp groups, one barrier a tile)."""
    spec = compiler.KernelSpec(op="prefill", dtype="float16", head_dim=128, n_kv_heads=8,
                               group_size=4, target="cuda", arch="sm_90a")
    cands = tune.candidates(spec, 10_000)
    default = compiler.resolve_knobs(spec)
    assert cands[0] == default and default["wgmma"] == 1
    wgmma = [c for c in cands if c["wgmma"]]
    mma = [c for c in cands if not c["wgmma"]]
    assert wgmma and mma and len(cands) == len({tuple(sorted(c.items())) for c in cands})
    assert all(c["warps"] % 4 == 0 and c["one_barrier"] == 1 for c in wgmma)
    assert any(c["warps"] == 2 for c in mma) and any(c["m_tiles"] == 2 for c in mma)
    # without wgmma (sm_80) a single grid, as before
    sm80 = compiler.KernelSpec(**{**spec.__dict__, "arch": "sm_80"})
    assert not any(c.get("wgmma") for c in tune.candidates(sm80, 10_000))


def test_a_quantized_spec_tunes_over_its_storage(tmp_path):
    """A K-only (int8 K, float32 V) decode spec: the manifest keeps the storage, the workload
    hands the kernel 8-bit K rows (kvtvm's quantizing append), and every candidate runs on it
    and agrees with the default."""
    spec = compiler.KernelSpec(op="decode", dtype="float32", head_dim=32, n_kv_heads=1,
                               k_storage="int8")
    built = tmp_path / "built"
    tune.build_candidates(spec, 2, built)
    assert tune.manifest_specs(built) == [spec]
    entry = tune.tune(spec, "cpu", repeat=2, warmup=1, write=False, prebuilt=built)
    assert [("median_ms" in t) for t in entry["trials"]] == [True, True], entry["trials"]
    args, _ = tune.workload(spec, "cpu")
    assert str(args[1].dtype) == "torch.int8" and str(args[2].dtype) == "torch.float32"
    from kvtvm import cliargs

    assert cliargs.storage_pair("int8/none") == ("int8", "")
    assert cliargs.storage_pair("float8_e4m3fn") == ("float8_e4m3fn", "float8_e4m3fn")
    with pytest.raises(Exception, match="K/V pair"):
        cliargs.storage_pair("int4")


@pytest.mark.parametrize("tamper", ["truncated", "renamed", "writable_manifest"])
def test_prebuilt_refuses_a_tampered_candidate_before_loading_any(tmp_path, tamper):
    """A truncated candidate module crashed the tuner with SIGBUS at dlopen; a module of
    another candidate copied to a listed name was timed as that one."""
    import shutil

    from kvtvm.errors import CorruptKernelError

    spec = _copy_spec()
    listed = json.loads(tune.build_candidates(spec, 2, tmp_path).read_text())["candidates"]
    first, second = (tmp_path / c["file"] for c in listed)
    if tamper == "truncated":
        second.write_bytes(second.read_bytes()[:4096])
    elif tamper == "writable_manifest":
        import os

        os.chmod(compiler.manifest_path(second), 0o666)
    else:
        shutil.copy(first, second)
        shutil.copy(compiler.manifest_path(first), compiler.manifest_path(second))
    from kvtvm.errors import UntrustedKernelError

    error, match = {"truncated": (CorruptKernelError, "sha256"),
                    "renamed": (CorruptKernelError, "another kernel"),
                    "writable_manifest": (UntrustedKernelError, "writable")}[tamper]
    loaded = []
    real = tune.runtime.load_module
    tune.runtime.load_module = lambda *a, **k: loaded.append(a) or real(*a, **k)
    try:
        with pytest.raises(error, match=match) as info:
            tune.tune(spec, "cpu", repeat=1, warmup=0, write=False, prebuilt=tmp_path)
    finally:
        tune.runtime.load_module = real
    assert str(second.with_suffix("")) in str(info.value) and loaded == []


def test_tune_command_line_errors_are_one_line_not_a_traceback(tmp_path, capsys):
    spec = _copy_spec()
    manifest = tune.build_candidates(spec, 1, tmp_path)
    manifest.write_text(manifest.read_text()[:40])  # truncated
    assert tune.main(["--prebuilt", str(tmp_path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert str(manifest) in err and "corrupt" in err and "Traceback" not in err
    # a list of another kvtvm version: a spec field this one does not have
    tune.build_candidates(spec, 1, tmp_path)
    listed = json.loads(manifest.read_text())
    listed["spec"]["page_size"] = 16
    manifest.write_text(json.dumps(listed))
    assert tune.main(["--prebuilt", str(tmp_path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert str(manifest) in err and "page_size" in err and "Traceback" not in err
    # a size the CUDA kernel cannot take, named before anything is built
    out = tmp_path / "cuda"
    assert tune.main(["--op", "decode", "--head-dim", "112", "--group-size", "4", "--arch",
                      "sm_90a", "--build-only", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error: head_dim" in err and "Traceback" not in err
    assert not list(out.glob("*/*"))


@pytest.mark.parametrize("target, arch", [("llvm", None), ("cuda", "sm_90a"), ("cuda", "sm_80")])
def test_every_knob_space_searches_knobs_its_schedule_has(target, arch):
    """What tune writes must be a log the build accepts (knob names and types of the
    schedule's defaults); the CUDA quantizing append searched ``vector_bytes``, a knob its
    schedule does not read (every candidate the same kernel)."""
    from kvtvm.compiler.knobs import _check_tuned

    for op in compiler.KERNEL_FAMILIES:
        for ks in ("", "int8") if op != "copy" else ("",):
            spec = compiler.KernelSpec(op=op, dtype="float16", head_dim=128,
                                       n_kv_heads=1 if op == "copy" else 8,
                                       group_size=4 if op in ("decode", "prefill") else 1,
                                       target=target, arch=arch, k_storage=ks, v_storage=ks)
            defaults = compiler.default_knobs(spec)
            for cand in tune.candidates(spec, 10_000):
                _check_tuned(spec, cand, defaults)  # raises CorruptKernelError


def test_prebuilt_candidates_of_another_target_name_the_device(tmp_path, capsys):
    """CUDA candidates timed with --device cpu failed one trial at a time and ended in a
    SystemExit listing every trial's error."""
    spec = _copy_spec()
    tune.build_candidates(spec, 1, tmp_path)
    with pytest.raises(SystemExit) as info:
        tune.main(["--prebuilt", str(tmp_path), "--device", "cuda:0", "--dry-run"])
    assert info.value.code == 2  # argparse: no GPU here, or the candidates are for llvm
    assert "--device" in capsys.readouterr().err
    listed = tmp_path / "llvm" / f"{spec.uri}.candidates.json"
    data = json.loads(listed.read_text())
    data["spec"].update(target="cuda", arch="sm_90a")
    (tmp_path / "sm_90a").mkdir()
    (tmp_path / "sm_90a" / listed.name).write_text(json.dumps(data))
    listed.unlink()
    with pytest.raises(SystemExit) as info:
        tune.main(["--prebuilt", str(tmp_path), "--dry-run"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--device cpu" in err and "sm_90a" in err, err


@pytest.mark.parametrize("storage", [("int8", "int8"), ("float8_e4m3fn", "")])
def test_a_quantized_append_tunes_over_its_storage(storage):
    """The append workload handed the quantizing append full-precision caches: every trial
    failed ('expected int8') and `tune --op append --cache-dtype int8` found no candidate."""
    from kvtvm.quant import quant_row_bytes

    ks, vs = storage
    spec = compiler.KernelSpec(op="append", dtype="float32", head_dim=16, n_kv_heads=1,
                               layout="hnd", k_storage=ks, v_storage=vs)
    args, (kc, vc) = tune.workload(spec, "cpu")
    assert str(kc.dtype) == "torch.int8" and kc.shape[-1] == quant_row_bytes(16)
    assert str(vc.dtype) == ("torch.int8" if vs else "torch.float32")
    entry = tune.tune(spec, "cpu", max_trials=2, repeat=1, warmup=0, write=False)
    assert [("median_ms" in t) for t in entry["trials"]] == [True, True], entry["trials"]


def test_prebuilt_candidates_of_another_cuda_arch_name_the_device(tmp_path, capsys,
                                                                   monkeypatch):
    """sm_90a candidates timed on an sm_80 GPU ran its sm_80 code and wrote the times into
    tuning_logs/sm_90a/ (a GPU is faked: the check runs before anything is loaded)."""
    from kvtvm import cliargs

    spec = compiler.KernelSpec(op="copy", dtype="float16", head_dim=64, n_kv_heads=1,
                               target="cuda", arch="sm_90a")
    (tmp_path / "sm_90a").mkdir()
    tune.manifest_path(spec, tmp_path).write_text(json.dumps(
        {"spec": {f: getattr(spec, f) for f in tune.SPEC_FIELDS}, "candidates": []}))
    monkeypatch.setattr(cliargs, "device", lambda text: text)
    monkeypatch.setattr(compiler, "target_for_device",
                        lambda device: compiler.Target("cuda", "sm_80"))
    with pytest.raises(SystemExit) as info:
        tune.main(["--prebuilt", str(tmp_path), "--device", "cuda", "--dry-run"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--device cuda" in err and "sm_80" in err, err


def test_tune_copy_of_an_8bit_cache_tunes_the_kernel_its_pages_use(monkeypatch, capsys):
    """An 8-bit cache's pages are bytes the copy op moves as float32 words, four to a row:
    ``--op copy --cache-dtype int8`` tunes that kernel (it ignored the cache dtype, tuning
    the float16 rows no 8-bit page uses); a K-only pair is refused, naming both ways."""
    seen = []

    def fake_tune(spec, device, *args, **kwargs):
        seen.append(spec)
        return {"device": device, "knobs": {}, "median_ms": 1.0, "default_ms": 1.0}

    monkeypatch.setattr(tune, "tune", fake_tune)
    for cache_dtype in ("int8", "float8_e4m3fn", "int8/float8_e4m3fn"):
        assert tune.main(["--op", "copy", "--cache-dtype", cache_dtype, "--dry-run"]) == 0
    assert [(s.op, s.dtype, s.head_dim, s.k_storage) for s in seen] == \
        [("copy", "float32", 4, "")] * 3
    assert tune.main(["--op", "copy", "--dtype", "float16", "--head-dim", "96", "--dry-run"]) == 0
    assert (seen[-1].dtype, seen[-1].head_dim) == ("float16", 96)
    capsys.readouterr()
    assert tune.main(["--op", "copy", "--cache-dtype", "int8/none", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "--cache-dtype" in err and "none" in err and "Traceback" not in err
    assert len(seen) == 4
