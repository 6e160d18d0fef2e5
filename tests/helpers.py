"""Helpers shared by tests in several folders (tests/conftest.py puts tests/ on sys.path, so
any test imports them as ``from helpers import ...``)."""

import subprocess
import sys


def run_python(code, *args, env=None, timeout=300):
    """``python -c code *args`` in a fresh process; asserts it exited 0 and returns its
    stdout (a fresh process: what it loads is what a runtime-only user would load)."""
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
