"""Every benchmark runs end to end on small cases and prints its side-by-side table."""

import json
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

CASES = {
    "decode": ["--cases", "2x256", "--skip", "tvm", "--repeat", "2", "--warmup", "1",
               "--cache-dtype", "int8", "float8_e4m3fn", "int8/none"],
    "prefill": ["--cases", "2:32:16", "--skip", "tvm", "--repeat", "2", "--warmup", "1",
                "--cache-dtype", "int8"],
    "append": ["--repeat", "2", "--warmup", "1", "--n-kv-heads", "2", "--head-dim", "64",
               "--cache-dtype", "int8", "float8_e4m3fn"],
    "copy": ["--n-kv-heads", "1", "--head-dim", "16", "--repeat", "2", "--warmup", "1"],
    "manager": ["--batches", "1,4", "--context", "64", "--steps", "20", "--requests", "40",
                "--max-batch", "8", "--max-seq-len", "256"],
    "host": ["--layers", "2", "--context", "16", "--steps", "3"],
    "transfer": ["--tokens", "64", "--layers", "1", "--n-kv-heads", "2", "--head-dim", "16",
                 "--repeat", "2", "--warmup", "1"],
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
    if name in ("decode", "prefill", "append"):  # quantized caches side by side
        impls = {r["impl"] for r in json.loads(out.read_text())["rows"]}
        assert "kvtvm int8" in impls and "kvtvm int8 / kvtvm" in proc.stdout
        if name == "decode":  # a K-only cache too
            assert "kvtvm int8/none" in impls
    if name in ("decode", "prefill"):
        assert "kvtvm int8" in proc.stdout and "x the " in proc.stdout and "GB/s of stored" \
            in proc.stdout
    if name == "transfer":  # both sides of both comparisons measured
        res = json.loads(out.read_text())
        assert "kvtvm / plain" in proc.stdout
        assert res["transfer"]["kvtvm_s"] > 0 and res["transfer"]["plain_s"] > 0
        assert res["host"]["demote_s"] > 0 and res["host"]["promote_s"] > 0


def test_bench_decode_cache_dtype_choices():
    """``--cache-dtype``: a type for K and V, or a K/V pair of 8-bit types and ``none``; the
    stored bytes count each side as stored."""
    import argparse

    from kvtvm.bench.decode import cache_choice, kv_row_bytes

    for ok in ("int8", "float16", "int8/none", "none/float8_e4m3fn", "int8/float8_e4m3fn"):
        assert cache_choice(ok) == ok
    for bad in ("none/none", "int8/bogus", "float16/none", "int8/none/x", "none"):
        with pytest.raises(argparse.ArgumentTypeError, match="K/V"):
            cache_choice(bad)
    assert kv_row_bytes("int8/none", "float16", 128) == 144 + 256
    assert kv_row_bytes("int8", "float16", 128) == 2 * 144
    assert kv_row_bytes("float32", "float16", 64) == 2 * 256


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


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch, capsys):
    """--plot is refused before anything is measured, naming the extra that brings matplotlib."""
    import argparse

    from kvtvm.bench import common

    real = common.importlib.util.find_spec
    monkeypatch.setattr(common.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    parser = argparse.ArgumentParser()
    common.add_common_args(parser)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--plot", "out.png"])
    assert exc.value.code == 2
    assert "pip install 'kvtvm[bench]'" in capsys.readouterr().err
    assert parser.parse_args(["--json", "x.json"]).plot is None  # without --plot: no check


def test_plot_draws_values_on_the_bars(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from kvtvm.bench import common

    rows = [common.Row("b1", "kvtvm", 1.0, 2.14), common.Row("b1", "torch", 1.2, 1.78),
            common.Row("b4", "kvtvm", 2.0, 2.5)]
    drawn = {}
    real_savefig = plt.Figure.savefig

    def savefig(fig, path, *a, **kw):
        drawn["labels"] = sorted(t.get_text() for t in fig.axes[0].texts if t.get_text())
        return real_savefig(fig, path, *a, **kw)

    plt.Figure.savefig, saved = savefig, plt.Figure.savefig
    try:
        common.plot("decode", rows, "TB/s", str(tmp_path / "c.png"))
    finally:
        plt.Figure.savefig = saved
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn["labels"] == ["1.78", "2.14", "2.5"]  # the missing (b4, torch) bar: no label


def test_bench_e2e_toy_serves_every_way(tmp_path):
    """The e2e benchmark on the toy: every way generates every token, the figures and the
    kernel share are there, the ratios are printed."""
    out = tmp_path / "e2e.json"
    proc = subprocess.run([sys.executable, "-m", "kvtvm.bench", "e2e", "--model", "toy",
                           "--requests", "2", "--prompt-lens", "16", "--new-tokens", "3",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    rows = {r["way"]: r for r in json.loads(out.read_text())["rows"]}
    from kvtvm.bench.e2e import WAYS

    assert set(rows) == set(WAYS)
    assert all(r["tokens"] == 6 and r["tokens_per_s"] > 0 and r["tpot_ms"] > 0
               and r["ttft_ms"] > 0 for r in rows.values())
    assert 0 < rows["engine"]["kernel_share"] < 1
    assert "engine / best transformers path" in proc.stdout
    assert "generate_batch on kvtvm / on sdpa" in proc.stdout


def test_bench_manager_context_shorter_than_a_page():
    """``--context`` below ``--page-size`` drew prompts of zero or negative length (numpy
    ValueError: negative dimensions) instead of measuring."""
    from kvtvm.bench.manager import decode_step_us

    for context in (1, 5, 15):
        for kind in ("paged", "paged+prefix", "continuous"):
            res = decode_step_us(kind, 3, context, 16, 2)
            assert res["median_us"] > 0


def test_bench_e2e_one_new_token(capsys):
    """``--new-tokens 1``: generate_batch's time per output token divided by zero
    (ZeroDivisionError) -- one token has no time after the first: 0, as ``Request.tpot``."""
    from kvtvm.bench.e2e import main

    assert main(["--model", "toy", "--requests", "1", "--prompt-lens", "3", "--new-tokens",
                 "1", "--repeat", "1", "--ways", "engine,hf-batch-sdpa"]) == 0
    out = capsys.readouterr().out
    assert "hf-batch-sdpa" in out and "TPOT    0.0 ms" in out


@pytest.mark.parametrize("tokens, page", [(1, 16), (20, 16), (1, 1), (4, 1)])
def test_bench_transfer_host_tier_tokens_off_the_page_grid(tokens, page, capsys):
    """``--tokens`` not one less than a multiple of the page size left the last page partial,
    never cached: AssertionError 'the sequence's pages are not all cached'; so did pages of
    one token (the token past them made a whole page, cached too)."""
    from kvtvm.bench.transfer import main

    assert main(["--tokens", str(tokens), "--page-size", str(page), "--layers", "1",
                 "--n-kv-heads", "1", "--head-dim", "16", "--repeat", "1", "--warmup", "0",
                 "--skip", "transfer"]) == 0
    assert f"host tier: {tokens} tokens" in capsys.readouterr().out


def _garbage_out(real):
    """An op like ``real`` whose ``out`` is then overwritten with noise (a broken kernel)."""
    import torch

    def op(*args, out=None, **kw):
        real(*args, out=out, **kw)
        out.copy_(torch.randn_like(out.float()).to(out.dtype))
    return op


@pytest.mark.parametrize("bench, op, argv", [
    ("decode", "decode_attention", ["--cases", "2x40", "--head-dim", "16", "--n-kv-heads", "2"]),
    ("decode", "decode_attention", ["--cases", "2x40", "--head-dim", "16", "--n-kv-heads", "2",
                                    "--cache-dtype", "int8"]),
    ("decode", "decode_attention", ["--cases", "2x40", "--head-dim", "16", "--n-kv-heads", "2",
                                    "--layout", "hnd", "--cache-dtype", "float8_e4m3fn"]),
    ("prefill", "prefill_attention", ["--cases", "2:5:7", "--dtype", "float32"]),
    ("prefill", "prefill_attention", ["--cases", "2:5:7", "--cache-dtype", "float8_e4m3fn"]),
])
def test_bench_stops_on_a_wrong_or_failing_kvtvm_whatever_it_skips(bench, op, argv,
                                                                   monkeypatch):
    """A kvtvm column was checked only against the dense peer (none with --skip dense, none
    for the 8-bit columns) and a kvtvm that could not run at all was a note, exit 0."""
    import importlib

    from kvtvm import ops

    main = importlib.import_module(f"kvtvm.bench.{bench}").main
    argv = argv + ["--skip", "tvm", "dense", "gather", "flashinfer", "--repeat", "1",
                   "--warmup", "0"]
    real = getattr(ops, op)
    monkeypatch.setattr(ops, op, _garbage_out(real))
    with pytest.raises(SystemExit, match="disagrees with float32 attention"):
        main(argv)

    def failing(*args, **kw):
        raise RuntimeError("no kernel here")
    monkeypatch.setattr(ops, op, failing)
    with pytest.raises(SystemExit, match="kvtvm.* failed: RuntimeError: no kernel here"):
        main(argv)
    monkeypatch.setattr(ops, op, real)
    assert main(argv) == 0


def test_bench_copy_and_append_check_what_kvtvm_wrote(monkeypatch):
    from kvtvm import ops
    from kvtvm.bench import append, copy

    monkeypatch.setattr(ops, "copy_pages", lambda *a, **k: None)
    with pytest.raises(SystemExit, match="unlike their sources"):
        copy.main(["--head-dim", "8", "--n-kv-heads", "1", "--repeat", "1", "--warmup", "0"])
    real = ops.append_kv

    def skewed(k_cache, v_cache, k, v, *args, **kw):  # the 8-bit rows of other values
        real(k_cache, v_cache, k * 1.5 if k_cache.element_size() == 1 else k, v, *args, **kw)
    monkeypatch.setattr(ops, "append_kv", skewed)
    with pytest.raises(SystemExit, match="other bytes than the reference quantizer"):
        append.main(["--head-dim", "16", "--n-kv-heads", "1", "--cache-dtype", "int8",
                     "--repeat", "1", "--warmup", "0"])


def test_bench_transfer_moves_8bit_pages(tmp_path, capsys):
    """``--cache-dtype`` / ``--k-cache-dtype`` / ``--skip-layers``: the pages moved are the
    8-bit cache's byte rows (fewer bytes than the float16 cache's), both ways measured."""
    from kvtvm.bench.transfer import main

    base = ["--tokens", "40", "--layers", "2", "--n-kv-heads", "2", "--head-dim", "64",
            "--repeat", "1", "--warmup", "0"]  # a 64-wide int8 row and its scale: 80 bytes
    sizes = {}
    for extra in ([], ["--cache-dtype", "int8"], ["--k-cache-dtype", "float8_e4m3fn"],
                  ["--cache-dtype", "int8", "--skip-layers", "-1"]):
        out = tmp_path / "r.json"
        assert main(base + extra + ["--json", str(out)]) == 0
        res = json.loads(out.read_text())
        assert res["transfer"]["kvtvm_s"] > 0 and res["host"]["promote_s"] > 0
        sizes[" ".join(extra)] = res["transfer"]["nbytes"]
    text = capsys.readouterr().out
    assert "int8 K/V" in text and "K float8_e4m3fn V float16" in text
    assert sizes["--cache-dtype int8"] < sizes["--cache-dtype int8 --skip-layers -1"] \
        < sizes[""]
    assert sizes["--cache-dtype int8"] < sizes["--k-cache-dtype float8_e4m3fn"] < sizes[""]


@pytest.mark.parametrize("max_seq_len", [2, 3, 40])
def test_bench_manager_workload_fits_short_sequences(max_seq_len):
    """At --max-seq-len 2 the clip bounds were inverted: every output 0 tokens."""
    from kvtvm.bench.manager import memory_efficiency

    res = memory_efficiency(20, 4, max_seq_len, 16)
    assert res["output_len_mean"] >= 1 and res["prompt_len_mean"] >= 1
    assert res["prompt_len_p99"] + res["output_len_p99"] <= max_seq_len


def test_bench_decode_hnd_pages_hold_the_cases_rows():
    """``--layout hnd``: the kernels read a ``[pages, H, page_size, row]`` copy of the same
    rows (quantized rows whole: values, scale, padding), which the check compares against the
    case's own nhd K/V."""
    import torch

    from kvtvm.bench.decode import in_layout
    from kvtvm.bench.quant_cases import cache_as
    from kvtvm.quant import dequantize_rows

    cache = torch.randn(3, 4, 2, 16)
    assert in_layout(cache, "nhd") is cache
    hnd = in_layout(cache, "hnd")
    assert hnd.is_contiguous() and hnd.shape == (3, 2, 4, 16)
    assert torch.equal(hnd[1, 1, 2], cache[1, 2, 1])
    rows = in_layout(cache_as(cache, "int8"), "hnd")
    assert rows.is_contiguous() and rows.shape == (3, 2, 4, 32)
    got = dequantize_rows(rows[2, 0, 3].numpy(), 16)
    assert abs(got - cache[2, 3, 0].numpy()).max() <= cache[2, 3, 0].abs().max() / 127
