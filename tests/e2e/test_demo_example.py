"""examples/demo.py (the append round-trip the README points a first reader to) runs as
written and checks what it says it checks. Was: it crashed on its first real line (a
``cache_shape`` call with sizes of 0) and no test ran it."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_demo_example_runs_its_round_trip():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py")], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("read back OK") == 3
    assert "round-trip OK" in out.stdout
