"""argparse ``type=`` checks shared by the command lines (``python -m kvtvm ...``,
``python -m kvtvm.bench ...``).

Each refuses a bad value while the arguments are parsed, before anything is loaded or
measured: argparse then prints the usage and one line naming the option
(``error: argument --device: ...``) and exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

from .quant import QUANT_DTYPES

#: the activation dtypes the ops and the benchmarks take
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
#: the 8-bit KV cache storage types
CACHE_DTYPES = QUANT_DTYPES


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


def int_between(low: int, high: int):
    """A ``type`` accepting ints in ``[low, high]``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an int in [{low}, {high}], got "
                                             f"{text!r}")
        return value
    parse.__name__ = f"int in [{low}, {high}]"
    return parse


def thread_count(text: str) -> int:
    """A thread count: an int in ``[1, kvtvm.runtime.MAX_THREADS]``."""
    from .runtime import MAX_THREADS

    return int_between(1, MAX_THREADS)(text)


def temperature(text: str) -> float:
    """A sampling temperature: a finite number >= 0 (0: greedy)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0 (0: greedy), got "
                                         f"{text!r}")
    return value


def top_p(text: str) -> float:
    """A nucleus-sampling mass: a number in ``(0, 1]``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


#: ``seed``: the ints ``torch.Generator.manual_seed`` takes
seed = int_between(-(1 << 63), (1 << 64) - 1)


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
    """A file path whose directory exists and can be written (checked now, so a long run does
    not fail at its end when it writes its results)."""
    parent = Path(text).expanduser().resolve().parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: directory {str(parent)!r} does not exist")
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, expected a file path")
    why = unwritable_dir(parent)  # a temporary file, removed: the path itself is untouched
    if why:
        raise argparse.ArgumentTypeError(f"{text!r}: cannot write in {str(parent)!r} ({why})")
    return text


def nonempty(text: str) -> str:
    """A name or path that is not empty or blank (an unset shell variable: ``--model ""``
    would load the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a name or a path, got {text!r}")
    return text


def dir_path(text: str) -> Path:
    """A directory path, not empty (``Path("")`` is the current directory: an unset shell
    variable would write there)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a directory path, got {text!r}")
    try:
        return Path(text).expanduser()
    except RuntimeError as err:  # ~user of an unknown user, or ~ without HOME
        raise argparse.ArgumentTypeError(f"expected a directory path whose '~' can be "
                                         f"expanded, got {text!r} ({err})") from None


def unwritable_dir(path) -> str:
    """Why files cannot be written into directory ``path`` (created, with its parents, when
    missing: mode 0755 whatever the umask, as kvtvm's trust checks want), or ``""``: checked
    before a long run that writes there at its end."""
    from .compiler.trust import make_dirs

    try:
        make_dirs(path)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as err:
        return err.strerror or str(err)
    return ""


def quant_storage(text: str) -> str:
    """An 8-bit storage type: one of :data:`CACHE_DTYPES` or an alias
    :class:`~kvtvm.params.KVCacheParams` takes (``fp8``, ``e4m3``, ...), canonical."""
    from .params import _CACHE_DTYPE_ALIASES

    if text not in _CACHE_DTYPE_ALIASES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(CACHE_DTYPES)} (or "
                                         f"fp8, e4m3), got {text!r}")
    return _CACHE_DTYPE_ALIASES[text]


def cache_storage(text: str) -> str:
    """A storage type of K or V: one of :data:`CACHE_DTYPES` (or an alias of one), or a float
    dtype (the model's: that half kept at full precision)."""
    if text in FLOAT_DTYPES:
        return text
    try:
        return quant_storage(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(CACHE_DTYPES)} or the "
                                         f"model's dtype ({', '.join(FLOAT_DTYPES)}), got "
                                         f"{text!r}") from None


def storage_pair(text: str) -> tuple[str, str]:
    """``(k_storage, v_storage)`` of a kernel spec named ``int8``, ``float8_e4m3fn`` (K and
    V), ``none`` (full precision) or a ``K/V`` pair of those such as ``int8/none`` (K-only);
    ``""`` stands for full precision. An argparse ``type`` too."""
    k, sep, v = text.partition("/")
    v = v if sep else k
    if not {k, v} <= {"none", *QUANT_DTYPES}:
        raise argparse.ArgumentTypeError(
            f"expected none, {', '.join(QUANT_DTYPES)} or a K/V pair of them such as "
            f"int8/none, got {text!r}")
    return tuple("" if s == "none" else s for s in (k, v))


def add_cache_storage_options(parser: argparse.ArgumentParser) -> None:
    """``--cache-dtype``, ``--k-cache-dtype``, ``--v-cache-dtype`` and ``--skip-layers``: an
    8-bit KV cache (:class:`kvtvm.params.KVCacheParams`); read back by
    :func:`cache_storage_kwargs`."""
    parser.add_argument("--cache-dtype", type=quant_storage, default=None,
                        help="store K and V in 8 bits (one scale per token and head; default: "
                        "the model's dtype)")
    parser.add_argument("--k-cache-dtype", type=cache_storage, default=None,
                        help="storage of K alone (default --cache-dtype), e.g. int8 for a "
                        "K-only 8-bit cache")
    parser.add_argument("--v-cache-dtype", type=cache_storage, default=None,
                        help="storage of V alone (default --cache-dtype)")
    parser.add_argument("--skip-layers", type=int, nargs="+", default=[], metavar="LAYER",
                        help="layers kept in the model's dtype in an 8-bit cache (negative: "
                        "from the end)")


def cache_storage_kwargs(parser: argparse.ArgumentParser, args) -> dict:
    """The ``Engine`` keywords of :func:`add_cache_storage_options`' options. Usage errors
    (exit 2, naming the option): ``--skip-layers`` without an 8-bit K or V, or naming a layer
    twice; a full-precision ``--k-cache-dtype`` / ``--v-cache-dtype`` other than ``--dtype``
    (when the command has one: the model's)."""
    chosen = (args.cache_dtype, args.k_cache_dtype, args.v_cache_dtype)
    if args.skip_layers and not any(d in CACHE_DTYPES for d in chosen):
        parser.error("--skip-layers needs an 8-bit cache: give --cache-dtype, --k-cache-dtype "
                     f"or --v-cache-dtype one of {', '.join(CACHE_DTYPES)}")
    if len(set(args.skip_layers)) != len(args.skip_layers):
        parser.error(f"--skip-layers: each layer once, got {args.skip_layers}")
    dtype = getattr(args, "dtype", None)
    for option, given in (("--k-cache-dtype", args.k_cache_dtype),
                          ("--v-cache-dtype", args.v_cache_dtype)):
        if dtype is not None and given in FLOAT_DTYPES and given != dtype:
            parser.error(f"argument {option}: expected one of {', '.join(CACHE_DTYPES)} or the "
                         f"model's dtype --dtype {dtype}, got {given!r}")
    return dict(cache_dtype=args.cache_dtype, k_cache_dtype=args.k_cache_dtype,
                v_cache_dtype=args.v_cache_dtype, skip_layers=tuple(args.skip_layers))
