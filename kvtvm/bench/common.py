"""Timing, reporting, progress and logging shared by the benchmarks.

Tables go to stdout; what a long benchmark is doing goes to the ``kvtvm.bench`` logger (stdlib
:mod:`logging`, under ``kvtvm``) and, on a terminal, to a ``tqdm`` progress bar on stderr.
``--json`` writes the rows; ``--plot`` draws them (matplotlib, the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import date

from .. import cliargs

log = logging.getLogger("kvtvm.bench")

#: What ``--plot`` says when matplotlib is missing.
PLOT_HINT = "--plot needs matplotlib: pip install 'kvtvm[bench]' (or pip install matplotlib)"


def plot_path(value: str) -> str:
    """argparse ``type`` of ``--plot``: refuses at once (before anything is measured) when
    matplotlib is not installed, saying how to get it, or cannot write the file's format (its
    suffix; none: PNG)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError(PLOT_HINT)
    from matplotlib.figure import Figure

    suffix = os.path.splitext(value)[1].lstrip(".").lower()
    formats = Figure().canvas.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise argparse.ArgumentTypeError(
            f"{value!r}: matplotlib writes {', '.join(sorted(formats))}; end the file name "
            "with one of those (e.g. .png)")
    return cliargs.output_file(value)


def progress(iterable=None, *, total: int | None = None, desc: str | None = None):
    """``iterable`` wrapped in a ``tqdm`` bar on stderr when stderr is a terminal; the
    iterable itself otherwise (pipes, CI, tests) or when tqdm is not installed."""
    if not sys.stderr.isatty():
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, leave=False, file=sys.stderr,
                dynamic_ncols=True)


def configure_logging(level: int = logging.INFO) -> None:
    """Show the ``kvtvm`` logger's messages on stderr (the command-line entry points call this;
    a program that configured logging itself keeps its own handlers)."""
    logger = logging.getLogger("kvtvm")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", type=cliargs.device,
                        help="cpu or cuda (default: cpu)")
    parser.add_argument("--repeat", type=cliargs.positive_int, default=20,
                        help="timed runs per case")
    parser.add_argument("--warmup", type=cliargs.nonnegative_int, default=3,
                        help="untimed runs per case")
    parser.add_argument("--json", metavar="PATH", type=cliargs.output_file,
                        help="also write the results as JSON")
    parser.add_argument("--plot", metavar="PNG", type=plot_path,
                        help="also draw the results as a bar chart with the values on the bars "
                             "(needs matplotlib: pip install 'kvtvm[bench]')")
    parser.add_argument("--timing", choices=("graph", "eager"), default="graph",
                        help="CUDA: time CUDA-graph replays of each call (the kernels' time; "
                             "default) or the calls as issued from Python (host overhead "
                             "included); the L2 cache is flushed before every run either way")


#: ``--skip`` key -> the name a peer has in every benchmark's table.
PEERS = {"dense": "torch SDPA dense", "gather": "torch gather+SDPA", "tvm": "TVM builtin",
         "flashinfer": "FlashInfer"}


def skip_keys(text: str) -> str:
    """argparse ``type`` of ``--skip``: comma-separated keys of :data:`PEERS`."""
    unknown = sorted({k for k in text.split(",") if k} - set(PEERS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peer(s) {unknown}; choose from "
                                         f"{', '.join(PEERS)}")
    return text


def add_skip_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--skip", nargs="*", default=[], metavar="PEER", type=skip_keys,
                        help=f"peers to leave out ({', '.join(PEERS)}; space or comma separated)")


def parse_skip(args) -> set[str]:
    """The ``--skip`` keys given; an unknown one is an error naming the choices."""
    keys = {k for item in args.skip for k in item.split(",") if k}
    unknown = keys - set(PEERS)
    if unknown:
        raise SystemExit(f"--skip: unknown peer(s) {sorted(unknown)}; choose from {list(PEERS)}")
    return keys


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


#: Bytes read between timed CUDA runs so that no run finds its inputs in the L2 cache left by
#: the previous one (H100: 50 MiB of L2). Read, not written: a flush that writes leaves the L2
#: full of dirty lines, and the timed run would pay for writing them back (on an H100 it cost
#: the decode benchmark ~9 us per call: docs/PERF.md).
L2_FLUSH_BYTES = 256 << 20
_flush_buffers: dict = {}


def median_seconds(fn, device: str, repeat: int, warmup: int, timing: str = "eager") -> float:
    """Median time of ``fn()`` over ``repeat`` runs after ``warmup`` runs (see :func:`timed`)."""
    return timed(fn, device, repeat, warmup, timing)[0]


def timed(fn, device: str, repeat: int, warmup: int, timing: str = "eager") -> tuple[float, str]:
    """``(median seconds, how it was timed)`` of ``fn()`` over ``repeat`` runs.

    CPU: wall time of each call. CUDA: device events around each run, with the L2 cache
    flushed (by reading :data:`L2_FLUSH_BYTES`) before it; ``timing="eager"`` times the call
    as issued from Python (its host overhead included whenever it exceeds the GPU's time), ``"graph"`` captures ``fn`` once in
    a CUDA graph and times its replays (the kernels' own time, as a CUDA-graph engine sees
    it). A function that cannot be captured (one that synchronizes, say) falls back to eager;
    the second element says which was used: ``"wall"``, ``"eager"`` or ``"graph"``.
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    if not device.startswith("cuda"):
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), "wall"
    import torch

    run, mode = fn, "eager"
    if timing == "graph":
        graph = _capture(fn)
        if graph is not None:
            run, mode = graph.replay, "graph"
    key = str(device)
    if key not in _flush_buffers:
        _flush_buffers[key] = torch.zeros(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    flush = _flush_buffers[key]
    times = []
    for _ in range(repeat):
        flush.amax()  # reads the buffer: the L2 holds clean lines of it afterwards
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), mode


def _capture(fn):
    """``fn`` captured in a ``torch.cuda.CUDAGraph`` (warmed up on a side stream first, as
    capture requires), or ``None`` when it cannot be captured."""
    import torch

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        return graph
    except Exception:  # noqa: BLE001 -- anything capture refuses: time it eagerly instead
        torch.cuda.synchronize()
        return None


@dataclass
class Row:
    """One measured (case, implementation) pair."""

    case: str
    impl: str
    ms: float
    metric: float | None = None  # TB/s, TFLOP/s, ... (see the table's metric name)
    extra: dict = field(default_factory=dict)


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()} CPU"


#: How each timing mode of :func:`timed` is described under a table.
TIMING_WORDS = {"graph": "CUDA-graph replays, L2 flushed before each (kernel time)",
                "eager": "calls issued from Python, L2 flushed before each (host time included)",
                "wall": "wall time per call"}


def report(title: str, rows: list[Row], metric_name: str, baseline: str, args,
           device: str) -> None:
    """Print a side-by-side table with ratios to ``baseline`` (kvtvm); write JSON/PNG."""
    seen, named = {}, []  # a case given twice is measured twice: shown as "<case> #2"
    for r in rows:
        k = seen[r.case, r.impl] = seen.get((r.case, r.impl), 0) + 1
        named.append((r.case if k == 1 else f"{r.case} #{k}", r))
    cases = list(dict.fromkeys(name for name, _ in named))
    impls = list(dict.fromkeys(r.impl for r in rows))
    print(f"\n{title} — {device_name(device)} — {date.today().isoformat()}")
    header = f"{'case':<22}" + "".join(f"  {i + ' ms':>22} {metric_name:>8}" for i in impls)
    peers = [i for i in impls if i != baseline]
    header += "".join(f"  {p + ' / ' + baseline:>28}" for p in peers)
    print(header)
    by = {(name, r.impl): r for name, r in named}
    for case in cases:
        line = f"{case:<22}"
        for impl in impls:
            r = by.get((case, impl))
            if r is None:
                line += f"  {'—':>22} {'':>8}"
            else:
                metric = r.metric if r.metric is not None else float("nan")
                line += f"  {r.ms:>22.4f} {metric:>8.3f}"
        for p in peers:
            mine, theirs = by.get((case, baseline)), by.get((case, p))
            if mine and theirs:
                line += f"  {theirs.ms / mine.ms:>27.2f}x"  # >1: kvtvm is faster
            else:
                line += f"  {'—':>28}"
        print(line)
    print(f"(ratio columns: peer time / {baseline} time; above 1 means {baseline} is faster; "
          f"{metric_name} of the ratio columns' peers are in their own columns)")
    modes = {}
    for r in rows:
        modes.setdefault(r.extra.get("timing", "wall"), []).append(r.impl)
    if set(modes) != {"wall"}:
        print("timing: " + "; ".join(f"{TIMING_WORDS.get(m, m)}: "
                                     f"{', '.join(dict.fromkeys(impls_))}"
                                     for m, impls_ in modes.items()))
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump({"title": title, "device": device_name(device),
                       "date": date.today().isoformat(), "metric": metric_name,
                       "rows": [asdict(r) for r in rows]}, f, indent=1)
        log.info("wrote %s", args.json)
    if getattr(args, "plot", None):
        plot(title, rows, metric_name, args.plot)
        log.info("wrote %s", args.plot)


def plot(title: str, rows: list[Row], metric_name: str, path: str) -> None:
    """Grouped bars of ``metric_name`` per case and implementation, each bar labelled with its
    value; written to ``path`` (any format matplotlib knows by the suffix, PNG usually)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(PLOT_HINT) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seen, named = {}, []  # a case given twice is measured twice: shown as "<case> #2"
    for r in rows:
        k = seen[r.case, r.impl] = seen.get((r.case, r.impl), 0) + 1
        named.append((r.case if k == 1 else f"{r.case} #{k}", r))
    cases = list(dict.fromkeys(name for name, _ in named))
    impls = list(dict.fromkeys(r.impl for r in rows))
    width = 0.8 / max(1, len(impls))
    fig, ax = plt.subplots(figsize=(max(7, 1.2 * len(cases) + 2), 4))
    for i, impl in enumerate(impls):
        vals = [next((r.metric or 0 for r in rows if r.case == c and r.impl == impl), 0)
                for c in cases]
        bars = ax.bar([x + i * width for x in range(len(cases))], vals, width, label=impl)
        ax.bar_label(bars, labels=[f"{v:.3g}" if v else "" for v in vals], fontsize=7,
                     padding=2, rotation=90 if len(impls) * len(cases) > 12 else 0)
    ax.set_xticks([x + width * (len(impls) - 1) / 2 for x in range(len(cases))])
    ax.set_xticklabels(cases, rotation=30, ha="right")
    ax.set_ylabel(metric_name)
    ax.set_title(title, fontsize=9)
    ax.margins(y=0.15)  # room for the labels above the tallest bar
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside, not on, bars
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
