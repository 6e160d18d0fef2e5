"""``python -m kvtvm.bench <name> [options]`` dispatch (also ``python -m kvtvm bench``)."""

import importlib
import sys

from . import BENCHMARKS
from ..errors import KVCacheError
from .common import configure_logging


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in ("-h", "--help") and argv[0] not in BENCHMARKS:
        print(f"python -m kvtvm.bench: error: unknown benchmark {argv[0]!r}; choose from "
              f"{', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m kvtvm.bench {{{','.join(BENCHMARKS)}}} [options]\n"
              "       python -m kvtvm.bench <name> --help")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    configure_logging()  # long steps (kernel builds, peers compiled on first use) say so
    module = importlib.import_module(f"kvtvm.bench.{argv[0]}")
    try:
        return module.main(argv[1:]) or 0
    except KVCacheError as err:  # a value the options let through that kvtvm refuses
        print(f"python -m kvtvm.bench {argv[0]}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
