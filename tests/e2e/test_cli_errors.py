"""A user's mistake on a command line (a bad option value, a missing directory, an unknown
dtype, device or benchmark) ends with one line naming the option and exit status 2, before
anything is loaded or measured -- never a traceback. Run in-process: argparse's exit is a
``SystemExit``; anything else escaping ``main`` is the bug these tests look for."""

import pytest
import torch

from kvtvm.bench.__main__ import main as bench_main
from kvtvm.cli import main as cli_main

pytestmark = pytest.mark.e2e

NO_CUDA = not torch.cuda.is_available()

#: ``python -m kvtvm generate`` on the toy model: the start of most cases' argv
GEN = ["generate", "--model", "toy", "--prompt", "5 6"]

CASES = [
    # (argv of python -m kvtvm, what the one error line must name)
    ([*GEN, "--max-new-tokens", "-1"], "--max-new-tokens"),
    ([*GEN, "--device", "tpu"], "--device"),
    ([*GEN, "--torch-threads", "0"], "--torch-threads"),
    ([*GEN, "--kernel-threads", "-3"], "--kernel-threads"),
    ([*GEN, "--host-tier-pages", "-1"], "--host-tier-pages"),
    ([*GEN, "--disk-tier-dir", "/proc/kvtvm-x"], "--disk-tier-dir"),
    (["generate", "--model", "/nonexistent/model", "--prompt", "hi"], "--model"),
    ([*GEN, "--cache-dtype", "int4"], "--cache-dtype"),
    ([*GEN, "--k-cache-dtype", "fp16"], "--k-cache-dtype"),
    ([*GEN, "--skip-layers", "0"], "--skip-layers"),
    ([*GEN, "--cache-dtype", "int8", "--skip-layers", "9"], "argument --skip-layers"),
    ([*GEN, "--cache-dtype", "int8", "--v-cache-dtype", "bfloat16"], "argument --v-cache-dtype"),
    # off the grid: a huge thread count (hung), a non-finite temperature (sampled
    # uniformly), a seed torch cannot take and an empty disk-tier path (the current
    # directory) (the last two were a traceback / taken)
    ([*GEN, "--kernel-threads", "100000"], "--kernel-threads"),
    ([*GEN, "--torch-threads", "5000"], "--torch-threads"),
    ([*GEN, "--temperature", "inf"], "temperature"),
    ([*GEN, "--temperature", "1", "--seed", str(1 << 70)], "seed"),
    ([*GEN, "--disk-tier-dir", ""], "--disk-tier-dir"),  # was named disk_dir (the manager's)
    # an --out that cannot be written: one line before any kernel is built (it was one
    # FAILED line per kernel, each after its compile, and exit 1)
    (["build", "--target", "llvm", "--out", "/proc/kvtvm-x", "--ops", "copy", "--dtypes",
      "float32", "--head-dims", "16"], "--out"),
    (["bench", "manager", "--max-seq-len", "1"], "--max-seq-len"),
    (["build", "--target", "llvm", "--out", "", "--ops", "copy"], "--out"),
    # tune: directories it writes at the end of a search are checked before it (a traceback
    # after the search before), a missing --prebuilt is a usage error, --arch on a CPU run
    # tuned CUDA knobs on the CPU (every candidate failed)
    (["tune", "--op", "copy", "--dtype", "float32", "--head-dim", "16", "--max-trials", "1",
      "--log-root", "/proc/kvtvm-x"], "--log-root"),
    (["tune", "--op", "copy", "--log-root", "", "--dry-run"], "--log-root"),
    (["tune", "--op", "copy", "--arch", "sm_90a", "--build-only", "/proc/kvtvm-x"],
     "--build-only"),
    (["tune", "--prebuilt", "/nonexistent/kvtvm-dir"], "--prebuilt"),
    (["tune", "--op", "decode", "--arch", "sm_90a", "--dry-run"], "--arch"),
    (["build", "--target", "llvm", "--out", "unused", "--head-dims", "0"], "--head-dims"),
    # an empty list (`--dtypes=$UNSET`) built nothing, or for --ops everything, and exit 0
    (["build", "--target", "llvm", "--out", "unused", "--dtypes="], "--dtypes"),
    (["build", "--target", "llvm", "--out", "unused", "--features", ","], "--features"),
    (["build", "--target", "llvm", "--out", "unused", "--cache-dtypes="], "--cache-dtypes"),
    # known parts, but no K/V pair: was argparse's ArgumentTypeError as a traceback
    (["build", "--target", "llvm", "--out", "unused", "--cache-dtypes", "int8/int8/int8"],
     "--cache-dtypes"),
    (["build", "--target", "llvm", "--out", "unused", "--ops="], "--ops"),
    # a size the CUDA kernel cannot take: a traceback (after making the --build-only dir)
    (["tune", "--op", "decode", "--head-dim", "112", "--group-size", "4", "--arch", "sm_90a",
      "--build-only", "unused-kvtvm-tune-dir"], "head_dim"),
    (["build", "--target", "llvm", "--out", "unused", "--dtypes", "float64"], "--dtypes"),
    (["build", "--target", "llvm", "--out", "unused", "--ops", "attention"], "--ops"),
    (["tune", "--op", "decode", "--dtype", "floot32"], "--dtype"),
    (["tune", "--op", "decode", "--head-dim", "0"], "--head-dim"),
    (["tune", "--op", "decode", "--device", "tpu"], "--device"),
    (["bench", "nosuch"], "nosuch"),
    (["bench", "append", "--dtype", "floot32"], "--dtype"),
    (["bench", "append", "--device", "tpu"], "--device"),
    (["bench", "append", "--repeat", "0"], "--repeat"),
    (["bench", "append", "--head-dim", "0"], "--head-dim"),
    (["bench", "copy", "--dtype", "float64"], "--dtype"),
    (["bench", "decode", "--cases", "4y100"], "--cases"),
    (["bench", "decode", "--json", "/nonexistent/dir/out.json"], "--json"),
    # a directory that exists but cannot be written: the run failed at its end (traceback)
    (["bench", "decode", "--json", "/proc/kvtvm-out.json"], "--json"),
    (["bench", "append", "--plot", "/proc/kvtvm-out.png"], "--plot"),
    (["bench", "prefill", "--cases", "1:2"], "--cases"),
    (["bench", "prefill", "--skip", "dense,nosuch"], "--skip"),
    (["bench", "manager", "--batches", "0"], "--batches"),
    (["bench", "host", "--layers", "0"], "--layers"),
    (["bench", "e2e", "--model", "/nonexistent/model", "--ways", "engine"], "--model"),
    (["bench", "e2e", "--prompt-lens", "8,x"], "--prompt-lens"),
    (["bench", "quality", "--tokens", "0"], "--tokens"),
    (["bench", "quality", "--tokens", "100", "--window", "200", "--stride", "100"],
     "--tokens 100"),
    (["bench", "transfer", "--dtype", "floot32"], "--dtype"),
    (["bench", "transfer", "--backend", "nccl"], "--backend nccl"),
    (["bench", "transfer", "--skip", "nosuch"], "--skip"),
    (["bench", "transfer", "--skip-layers", "0"], "--skip-layers"),
    (["bench", "transfer", "--cache-dtype", "int4"], "--cache-dtype"),
    (["bench", "transfer", "--cache-dtype", "int8", "--skip-layers", "9"], "skip_layers"),
    (["build", "--out", "~nosuchuser-kvtvm/x"], "--out"),   # was a bare RuntimeError
]
if NO_CUDA:
    CASES += [([*GEN, "--device", "cuda"], "CUDA"),
              (["bench", "decode", "--device", "cuda"], "CUDA"),
              (["tune", "--op", "decode", "--device", "cuda"], "CUDA")]


def _status(call, argv):
    try:
        return call(argv)
    except SystemExit as exit_:
        return exit_.code


@pytest.mark.parametrize("argv,names", CASES, ids=lambda a: " ".join(a) if isinstance(a, list)
                         else None)
def test_bad_option_is_one_line_naming_it(argv, names, capsys):
    status = _status(cli_main, argv)
    err = capsys.readouterr().err
    assert status == 2, (status, err)
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert names in last, last


def test_bench_entry_point_refuses_the_same_way(capsys):
    """``python -m kvtvm.bench`` (not through ``python -m kvtvm bench``)."""
    assert _status(bench_main, ["decode", "--cases", "0x10"]) == 2
    assert "--cases" in capsys.readouterr().err
    assert _status(bench_main, ["nosuch"]) == 2
    assert "unknown benchmark 'nosuch'" in capsys.readouterr().err
    assert _status(bench_main, ["--help"]) == 0


def test_typed_error_past_the_options_is_one_line(capsys, monkeypatch):
    """A kvtvm error raised while a command runs (a value only the library can judge) is
    printed as one ``error:`` line with status 2."""
    from kvtvm.bench import host
    from kvtvm.errors import InvalidArgumentError

    def refuse(*args, **kwargs):
        raise InvalidArgumentError("n_kv_heads: expected a multiple of 2, got 3")
    monkeypatch.setattr(host, "step_ms", refuse)
    assert _status(bench_main, ["host", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().endswith("got 3")


def test_load_model_refuses_a_bad_device_by_name():
    from kvtvm.engine import load_model
    from kvtvm.errors import DeviceUnavailableError, InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="^device: expected cpu or cuda"):
        load_model("toy", device="meta")
    with pytest.raises(InvalidArgumentError, match="^device: expected device names.*'tpu'$"):
        load_model("toy", device="tpu")
    if NO_CUDA:
        with pytest.raises(DeviceUnavailableError, match="^device: cuda"):
            load_model("toy", device="cuda")


def test_cache_dtype_aliases_are_those_the_params_take():
    """``--cache-dtype fp8`` (an alias KVCacheParams takes) was refused by the CLI."""
    import argparse

    from kvtvm.cliargs import add_cache_storage_options

    parser = argparse.ArgumentParser()
    add_cache_storage_options(parser)
    args = parser.parse_args(["--cache-dtype", "fp8", "--k-cache-dtype", "e4m3",
                              "--v-cache-dtype", "float16"])
    assert (args.cache_dtype, args.k_cache_dtype, args.v_cache_dtype) == (
        "float8_e4m3fn", "float8_e4m3fn", "float16")


def test_max_new_tokens_past_the_int32_tables_names_the_option():
    """It named ``max_seq_len``, which is no option of ``generate``."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "kvtvm", "generate", "--model", "toy",
                           "--prompt", "5 6", "--max-new-tokens", "99999999999"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: --max-new-tokens 99999999999")
    assert "max_seq_len" not in proc.stderr
