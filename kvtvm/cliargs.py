"""argparse ``type=`` checks shared by the command lines (``python -m kvtvm ...``,
``python -m kvtvm.bench ...``).

Each refuses a bad value while the arguments are parsed, before anything is loaded or
measured: argparse then prints the usage and one line naming the option
(``error: argument --device: ...``) and exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
from pathlib import Path

#: the activation dtypes the ops and the benchmarks take
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def int_at_least(low: int):
    """A ``type`` accepting ints ``>= low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {value}")
        return value
    parse.__name__ = f"int >= {low}"
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def int_list(text: str) -> list[int]:
    """Comma-separated positive ints (``"1,64,256"``)."""
    values = [positive_int(x) for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}")
    return values


def float_dtype(text: str) -> str:
    """One of :data:`FLOAT_DTYPES`."""
    if text not in FLOAT_DTYPES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(FLOAT_DTYPES)}, "
                                         f"got {text!r}")
    return text


def device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, and CUDA only where torch can reach a GPU."""
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available here (torch "
                                             f"{torch.__version__} sees no GPU)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: only {torch.cuda.device_count()} "
                                             "GPU(s) here")
    return text


def output_file(text: str) -> str:
    """A file path whose directory exists (checked now, so a long run does not fail at its
    end when it writes its results)."""
    parent = Path(text).expanduser().resolve().parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: directory {str(parent)!r} does not exist")
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, expected a file path")
    return text
