"""``python -m kvtvm.tune``: search a spec's schedule knobs on this device and record the best
in ``tuning_logs/<target_tag>/<uri>.json``, which later builds read.

The knob space of each op is declared by its family (``kvtvm.kernels.<op>.knob_space``). Every
candidate is built, loaded, checked against the default build's output on the same inputs,
and timed (median of ``--repeat`` runs; on CUDA, CUDA-graph replays with the L2 cache flushed
before each); a candidate that fails to build or gives different results is skipped and reported.

Tuning for a GPU on a machine that has only the TVM runtime (no compiler) takes two steps:
``--build-only DIR --arch sm_90a`` (here, with the compiler and nvcc: builds every candidate
and writes ``DIR/<arch>/<uri>.candidates.json``), then ``--prebuilt DIR --device cuda`` there
(loads and times the candidates of every manifest in DIR, or of ``--op`` only).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import logging
import random
import sys
import tempfile
from datetime import date
from pathlib import Path

from . import cliargs, compiler, runtime
from .bench.common import device_name, median_seconds
from .compiler.spec import QUANT_FAMILIES
from .compiler.manifest import manifest_path as manifest_path_of
from .compiler.manifest import read_manifest, spec_mismatch
from .compiler.trust import (check_digest, check_trusted, check_trusted_tree, read_json,
                             write_file)
from .errors import CorruptKernelError, InvalidArgumentError, KVCacheError
from .kernels.errflag import ERR_SLOTS

log = logging.getLogger(__name__)


def append_workload(spec, device: str):
    """Inputs of one append: 32 sequences adding 64 tokens each, page 16, K and V stored as
    the spec says (a quantized side: its rows as the ``int8`` view the ops hand over)."""
    from .bench.append import make_case
    from .bench.quant_cases import kernel_cache_arg

    case = make_case(64, 32, spec.n_kv_heads, spec.head_dim, 16, spec.dtype, device)
    # hnd: a strided [pages, H, page_size, ...] view of the same memory
    kc = kernel_cache_arg(case["cache"][:, 0, 0], spec.k_storage, spec.layout)
    vc = kernel_cache_arg(case["cache"][:, 1, 0], spec.v_storage, spec.layout)
    args = (kc, vc, case["k"], case["v"], case["indptr"], case["lengths"], case["table"])
    return args, (kc, vc)


def workload(spec, device: str):
    """``(args, outputs)`` for calling ``spec``'s kernel function directly: ``args`` is the
    argument tuple and ``outputs`` the tensors to compare between candidates."""
    import torch

    if spec.op == "append":
        args, outputs = append_workload(spec, device)
    else:
        bench = importlib.import_module(f"kvtvm.bench.{spec.op}")
        make = getattr(bench, "tuning_workload", None)
        if make is None:
            raise SystemExit(f"no tuning workload for op {spec.op!r}")
        args, outputs = make(spec, device)
    # every kernel's last argument: its error flag (kvtvm.kernels.errflag)
    return (*args, torch.zeros(ERR_SLOTS, dtype=torch.int32, device=device)), outputs


def candidates(spec, max_trials: int, seed: int = 0) -> list[dict]:
    """Knob settings to try: the default first, then the space (sampled when too large)."""
    default = compiler.resolve_knobs(spec)
    space = compiler.knob_space(spec)
    grid = []
    for sub in space if isinstance(space, list) else [space]:  # a list: a union of grids
        names = sorted(sub)
        grid += [dict(zip(names, values)) for values in itertools.product(*(sub[n] for n in names))]
    grid = [dict(default, **g) for g in grid]
    random.Random(seed).shuffle(grid)
    out = [default] + [g for g in grid if g != default]
    return out[:max_trials]


SPEC_FIELDS = ("op", "dtype", "head_dim", "n_kv_heads", "group_size", "layout", "target",
               "arch", "features", "k_storage", "v_storage")


def manifest_path(spec, root: Path) -> Path:
    """``<root>/<target_tag>/<uri>.candidates.json``: the candidates built for ``spec``."""
    return Path(root) / spec.target_tag / f"{spec.uri}.candidates.json"


def build_candidates(spec, max_trials: int, root: Path) -> Path:
    """Build ``spec``'s candidates (:func:`candidates`) into ``root`` and list them, each
    with its module file or its build error, in :func:`manifest_path`; returns that path."""
    listed = []
    cands = candidates(spec, max_trials)
    bar = _bar(cands, f"build {spec.uri}")
    for knobs in bar:
        bar.set_postfix_str(str(knobs), refresh=False)
        cand = compiler.KernelSpec(**{**spec.__dict__, "knobs": knobs})
        try:
            path = compiler.build_spec(cand, root)
            listed.append({"knobs": knobs, "file": str(path.relative_to(root))})
        except Exception as err:  # recorded; the device run reports it as a failed trial
            listed.append({"knobs": knobs, "error": str(err).splitlines()[-1][:200]})
    out = manifest_path(spec, root)
    write_file(out, json.dumps({"spec": {f: getattr(spec, f) for f in SPEC_FIELDS},
                                "candidates": listed}, indent=1) + "\n")
    return out


def _read_candidates(path: Path) -> dict:
    """A ``--build-only`` manifest (this user's, not group/other-writable), checked for shape.

    Raises
    ------
    CorruptKernelError
        It is not JSON, or lacks its ``spec`` or ``candidates``.
    """
    check_trusted(path, "candidates list")
    try:
        data = read_json(path)
        fields, listed = data["spec"], data["candidates"]
        fields["features"] = tuple(fields["features"])
        if not isinstance(listed, list) or not all(
                isinstance(c, dict) and isinstance(c.get("knobs"), dict)
                and isinstance(c.get("file", c.get("error")), str) for c in listed):
            raise ValueError("a candidate without knobs and a file or an error")
        root = path.parent.parent.resolve()  # <root>/<target_tag>/<uri>.candidates.json
        for c in listed:  # a module of the candidates' tree, never one elsewhere
            if "file" in c and not (root / c["file"]).resolve().is_relative_to(root):
                raise ValueError(f"candidate file {c['file']!r} lies outside {root}")
    except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise CorruptKernelError(f"candidates list {path} is unreadable or corrupt "
                                 f"({type(err).__name__}: {err}); build it again with "
                                 "--build-only") from None
    return data


def manifest_specs(root: Path, op: str | None = None) -> list:
    """The specs whose candidates ``root`` holds (``--build-only`` manifests), of ``op`` only
    when given."""
    specs = []
    for path in sorted(Path(root).glob("*/*.candidates.json")):
        fields = _read_candidates(path)["spec"]
        try:
            spec = compiler.KernelSpec(**fields)
        except TypeError as err:  # fields of another kvtvm version
            raise CorruptKernelError(f"candidates list {path} names a spec this kvtvm cannot "
                                     f"make ({err}); build it again with --build-only") from None
        if op is None or spec.op == op:
            specs.append(spec)
    return specs


def prebuilt_candidates(spec, root: Path) -> list[tuple[dict, Path | str]]:
    """``(knobs, module path or build error)`` of each candidate listed for ``spec``."""
    path = manifest_path(spec, root)
    if not path.exists():
        raise SystemExit(f"no candidates of {spec.uri} for {spec.target_tag} in {root} "
                         f"(build them with --build-only)")
    return [(c["knobs"], Path(root) / c["file"] if "file" in c else c["error"])
            for c in _read_candidates(path)["candidates"]]


def check_candidate(spec, path: Path) -> None:
    """Refuse (:class:`~kvtvm.errors.CorruptKernelError`, naming the file) a prebuilt
    candidate module whose manifest describes another spec or whose bytes differ from the
    manifest's sha256 (truncated, modified): it is never loaded (a truncated module crashed
    the tuner with SIGBUS)."""
    if manifest_path_of(path).exists():  # as the kernel cache: this user's, not writable
        check_trusted(manifest_path_of(path), "prebuilt candidate manifest")
    why = spec_mismatch(path, spec) or check_digest(path, read_manifest(path))
    if why is not None:
        raise CorruptKernelError(f"prebuilt candidate {path}: {why}; build the candidates "
                                 "again with --build-only")


#: Show tqdm progress bars: None = on a terminal only, False = never (``--no-progress``).
SHOW_PROGRESS: bool | None = None


def _bar(items, desc: str):
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="trial",
                disable=None if SHOW_PROGRESS is None else not SHOW_PROGRESS)


def tune(spec, device: str, max_trials: int = 32, repeat: int = 20, warmup: int = 3,
         log_root: Path | None = None, write: bool = True, inputs=None,
         prebuilt: Path | None = None) -> dict:
    """Search ``spec``'s knobs; returns (and, with ``write``, records) the best entry.

    ``inputs`` is ``(args, outputs)`` for calling the kernel directly (``args`` the argument
    tuple, ``outputs`` the tensors it writes); by default :func:`workload` makes them.
    ``prebuilt`` is a ``--build-only`` directory holding ``spec``'s candidates, built
    elsewhere (nothing is compiled here then; ``max_trials`` was applied when they were built).
    """
    import torch

    args, outputs = inputs if inputs is not None else workload(spec, device)
    snapshot = [t.clone() for t in outputs]
    trials, reference = [], None
    timing = "graph" if device.startswith("cuda") else "eager"
    if prebuilt is not None:  # modules built elsewhere are loaded: the kernel trust rules
        check_trusted_tree(prebuilt, "prebuilt candidates directory")
    with tempfile.TemporaryDirectory(prefix="kvtvm-tune-") as tmp:
        cands = (prebuilt_candidates(spec, prebuilt) if prebuilt is not None
                 else [(knobs, None) for knobs in candidates(spec, max_trials)])
        for knobs, path in cands:  # all of them before any is loaded
            if isinstance(path, Path):
                check_trusted(path.parent, "prebuilt candidates directory")
                if path.exists():
                    check_trusted(path, "prebuilt candidate")
                    check_candidate(compiler.KernelSpec(**{**spec.__dict__, "knobs": knobs}),
                                    path)
        bar = _bar(cands, f"tune {spec.uri}")
        for knobs, path in bar:
            bar.set_postfix_str(str(knobs), refresh=False)
            cand = compiler.KernelSpec(**{**spec.__dict__, "knobs": knobs})
            try:
                if isinstance(path, str):  # the manifest's build error
                    raise RuntimeError(path)
                path = path or compiler.build_spec(cand, tmp)
                module = runtime.load_module(str(path), needs_cuda=cand.is_cuda)
                fn = module[cand.func_name]
                for out, snap in zip(outputs, snapshot):
                    out.copy_(snap)
                fn(*args)
                result = [o.clone() for o in outputs]
                if reference is None:
                    reference = result
                elif not all(torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2,
                                            equal_nan=False)
                             for a, b in zip(reference, result)):
                    trials.append({"knobs": knobs, "error": "result differs from the default"})
                    continue
                sec = median_seconds(lambda: fn(*args), device, repeat, warmup, timing)
                trials.append({"knobs": knobs, "median_ms": sec * 1e3})
            except Exception as err:  # a knob setting that does not build is skipped
                log.info("trial %s failed: %s", knobs, str(err).splitlines()[-1][:200])
                trials.append({"knobs": knobs, "error": str(err).splitlines()[-1][:200]})
    timed = [t for t in trials if "median_ms" in t]
    if not timed:
        raise SystemExit(f"no candidate of {spec.uri} could be built and run: {trials}")
    best = min(timed, key=lambda t: t["median_ms"])
    entry = {"uri": spec.uri, "target": spec.target_tag, "knobs": best["knobs"],
             "timing": "CUDA-graph replays, L2 flushed" if timing == "graph" else "wall",
             "median_ms": best["median_ms"], "default_ms": trials[0].get("median_ms"),
             "date": date.today().isoformat(), "device": device_name(device),
             "trials": trials}
    if write:
        path = compiler.tuning_log_path(spec, log_root)  # 0644 in 0755 dirs, as builds
        write_file(path, json.dumps(entry, indent=1) + "\n")  # trust them (any umask)
        entry["path"] = str(path)
    return entry


def main(argv=None, prog: str = "python -m kvtvm.tune") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", choices=compiler.KERNEL_FAMILIES,
                        help="kernel family (required, except with --prebuilt: all of DIR)")
    parser.add_argument("--dtype", default="float16", type=cliargs.float_dtype)
    parser.add_argument("--head-dim", type=cliargs.positive_int, default=128)
    parser.add_argument("--kv-heads", type=cliargs.positive_int, default=8)
    parser.add_argument("--group-size", type=cliargs.positive_int, default=1)
    parser.add_argument("--layout", default="nhd", choices=compiler.LAYOUTS)
    parser.add_argument("--cache-dtype", default="none", type=cliargs.storage_pair,
                        help="K/V storage of append, decode and prefill: none (full precision), "
                             "int8, float8_e4m3fn, or a K/V pair such as int8/none (K-only)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--arch", choices=sorted(compiler.CUDA_ARCHS),
                        help="with --build-only: the CUDA arch to build for (no GPU needed)")
    parser.add_argument("--max-trials", type=cliargs.positive_int, default=32)
    parser.add_argument("--repeat", type=cliargs.positive_int, default=20)
    parser.add_argument("--log-root", type=cliargs.dir_path, default=None,
                        help="tuning_logs directory to write (default: the package's)")
    parser.add_argument("--dry-run", action="store_true", help="search but write nothing")
    parser.add_argument("--build-only", type=cliargs.dir_path, metavar="DIR",
                        help="build the candidates into DIR for a later --prebuilt run")
    parser.add_argument("--prebuilt", type=cliargs.dir_path, metavar="DIR",
                        help="time the candidates a --build-only run left in DIR")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    try:
        return _run(parser, args)
    except KVCacheError as err:  # a spec kvtvm refuses, an untrusted or corrupt file
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2


def _run(parser, args) -> int:
    global SHOW_PROGRESS
    if args.no_progress:
        SHOW_PROGRESS = False
    if args.build_only and args.prebuilt:
        parser.error("--build-only and --prebuilt are two steps: give one")
    if not args.build_only:
        try:
            cliargs.device(args.device)
        except argparse.ArgumentTypeError as err:
            parser.error(f"argument --device: {err} (--build-only DIR builds without a GPU)")
    if args.arch and not args.build_only and not args.device.startswith("cuda"):
        parser.error(f"--arch {args.arch}: builds for that CUDA arch with --build-only DIR; "
                     f"this run measures on {args.device} (give --device cuda, or no --arch)")
    if args.prebuilt and not args.prebuilt.is_dir():
        parser.error(f"--prebuilt: no such directory: {str(args.prebuilt)!r}")
    if args.prebuilt:
        specs = manifest_specs(args.prebuilt, args.op)
        if not specs:
            raise SystemExit(f"no --build-only manifests in {args.prebuilt}")
        cuda = args.device.startswith("cuda")
        other = [s for s in specs if s.is_cuda != cuda]
        if other:  # each would fail to load, one trial at a time
            parser.error(f"--device {args.device}: the candidates of {other[0].uri} in "
                         f"{str(args.prebuilt)!r} are built for {other[0].target_tag} "
                         f"(give --device {'cuda' if other[0].is_cuda else 'cpu'}, or --op)")
        if cuda:  # sm_90a candidates timed on an A100 would write an sm_90a log from it
            import torch

            arch = compiler.target_for_device(torch.device(args.device)).arch
            other = [s for s in specs if s.arch != arch]
            if other:
                parser.error(f"--device {args.device}: it runs {arch} kernels, and the "
                             f"candidates of {other[0].uri} in {str(args.prebuilt)!r} are "
                             f"built for {other[0].arch} (give --op, or build for {arch})")
    else:
        if args.op is None:
            parser.error("--op is required (except with --prebuilt)")
        specs = [command_line_spec(args)]  # a spec kvtvm refuses: before any directory is made
    # a directory that cannot be written fails now, not after the whole search
    writes = [("--build-only", args.build_only)] if args.build_only else []
    if not args.build_only and not args.dry_run:
        writes.append(("--log-root", args.log_root or compiler.tuning_logs_dir()))
    for option, path in writes:
        why = cliargs.unwritable_dir(path)
        if why:
            parser.error(f"{option}: cannot write to {str(path)!r}: {why}"
                         + (" (or --dry-run)" if option == "--log-root" else ""))
    for spec in specs:
        if args.build_only:
            print(f"{spec.uri} for {spec.target_tag}: candidates listed in "
                  f"{build_candidates(spec, args.max_trials, args.build_only)}")
            continue
        entry = tune(spec, args.device, args.max_trials, args.repeat, log_root=args.log_root,
                     write=not args.dry_run, prebuilt=args.prebuilt)
        default_ms = entry["default_ms"]
        default = "failed" if default_ms is None else f"{default_ms:.4f} ms"
        print(f"{spec.uri} on {entry['device']}: best {entry['knobs']} "
              f"{entry['median_ms']:.4f} ms (default {default})")
        if "path" in entry:
            print(f"wrote {entry['path']}")
    return 0


def command_line_spec(args):
    """The spec the command line names, for the device (or ``--arch``) it runs on."""
    if args.arch:
        target, arch = "cuda", args.arch
    elif args.device.startswith("cuda"):
        import torch

        tgt = compiler.target_for_device(torch.device(args.device))
        target, arch = tgt.target, tgt.arch
    else:
        target, arch = "llvm", None
    if args.op == "copy":  # the copy op always loads the copy kernel this way
        args.kv_heads, args.group_size, args.layout = 1, 1, "nhd"
        if any(args.cache_dtype):
            # an 8-bit cache's pages are bytes, which the copy op moves as float32 words, four
            # to a 16-byte row (kvtvm.ops.copy): that kernel, whatever --dtype/--head-dim say
            if not all(args.cache_dtype):
                raise InvalidArgumentError(
                    "--cache-dtype: copy moves K and V buffers with separate kernels; tune "
                    "the 8-bit side with --cache-dtype int8 (or float8_e4m3fn) and the "
                    "full-precision side with --cache-dtype none")
            args.dtype, args.head_dim = "float32", 4
    k_storage, v_storage = args.cache_dtype if args.op in QUANT_FAMILIES else ("", "")
    return compiler.KernelSpec(op=args.op, dtype=args.dtype, head_dim=args.head_dim,
                               n_kv_heads=args.kv_heads, group_size=args.group_size,
                               layout=args.layout, target=target, arch=arch,
                               k_storage=k_storage, v_storage=v_storage)


if __name__ == "__main__":
    sys.exit(main())
