"""The command lines off the usual grid (session 12's fuzzing of the serving path): option
values the other tests do not use. A user's mistake is one line naming the option and exit
status 2, never a traceback; odd but valid values run."""

import pytest

from kvtvm.bench.__main__ import main as bench_main

pytestmark = pytest.mark.e2e


def _status(call, argv):
    try:
        return call(argv)
    except SystemExit as exit_:
        return exit_.code


@pytest.mark.parametrize("argv, names", [
    # a one-token window scores nothing: ZeroDivisionError after loading SmolLM2
    (["quality", "--tokens", "40", "--window", "1", "--stride", "1"], "--window"),
    # no way at all: it loaded the model, ran nothing and exited 0
    (["e2e", "--model", "toy", "--ways", ","], "--ways"),
    (["e2e", "--model", "toy", "--ways", ""], "--ways"),
])
def test_bench_bad_option_is_one_line_naming_it(argv, names, capsys):
    status = _status(bench_main, argv)
    err = capsys.readouterr().err
    assert status == 2, (status, err)
    assert "Traceback" not in err
    assert names in err.strip().splitlines()[-1]


def test_bench_e2e_runs_a_way_named_twice_once(capsys):
    """``--ways engine,engine`` ran and printed the engine twice."""
    argv = ["e2e", "--model", "toy", "--requests", "1", "--prompt-lens", "3", "--new-tokens",
            "2", "--ways", "engine, engine"]
    assert _status(bench_main, argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("prompt") and " engine " in line]
    assert len(rows) == 1, rows
