"""``python -m kvtvm.bench <name> [options]`` dispatch (also ``python -m kvtvm bench``)."""

import importlib
import sys

from . import BENCHMARKS
from .common import configure_logging


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        print(f"usage: python -m kvtvm.bench {{{','.join(BENCHMARKS)}}} [options]\n"
              "       python -m kvtvm.bench <name> --help")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    configure_logging()  # long steps (kernel builds, peers compiled on first use) say so
    module = importlib.import_module(f"kvtvm.bench.{argv[0]}")
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
