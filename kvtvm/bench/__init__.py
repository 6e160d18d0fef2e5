"""Benchmarks: ``python -m kvtvm.bench <name> [options]``.

Each benchmark is a module ``kvtvm.bench.<name>`` with ``main(argv)``; peers are measured side
by side in the same run and reported as ratios. Shared timing and reporting live in
:mod:`kvtvm.bench.common`.
"""

BENCHMARKS = ("append", "copy", "manager", "decode", "prefill", "host", "e2e", "quality",
              "transfer")
