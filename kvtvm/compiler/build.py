"""Building (needs TVM's compiler): definition + schedule -> ``tvm.compile`` -> exported
module, CUDA device code compiled by nvcc into an embedded fatbin now, a manifest beside it.

1. ``kvtvm.kernels.<family>.define(spec)`` gives the unscheduled PrimFunc (named blocks);
2. ``schedules/<family>/<cpu|cuda>.py``'s ``schedule(mod, spec, knobs)`` schedules it, with
   the knobs of :func:`kvtvm.compiler.knobs.resolve_knobs`;
3. ``tvm.compile`` lowers it; for CUDA, nvcc compiles the device source into a fatbin that is
   embedded in the exported library in place of the source;
4. the module goes to ``<dir>/<spec.file_name()>`` (a temporary file in that directory, then
   renamed), its manifest beside it; a file lock keeps two processes from building the same
   file at once (the second waits, then finds the first's).
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterable

from .. import runtime
from ..errors import CompilerUnavailableError
from ..kernels.variants import variant_names
from .fatbin import fatbin_archs, fatbin_packer
from .knobs import resolve_knobs, schedule_module
from .manifest import is_fresh, write_manifest
from .nvcc import nvcc_fatbin
from .trust import make_dirs, set_file_mode
from .spec import KernelSpec

log = logging.getLogger(__name__)


def lower(spec: KernelSpec, knobs: dict | None = None):
    """Definition + schedule of ``spec``: the scheduled ``IRModule`` (for inspection).

    ``knobs`` default to :func:`~kvtvm.compiler.knobs.resolve_knobs` of ``spec``.
    """
    if not runtime.compiler_available():
        raise CompilerUnavailableError("building kernels needs TVM's compiler library")
    import tvm

    family = importlib.import_module(spec.family_module)
    func = family.define(spec).with_attr("global_symbol", spec.func_name)
    mod = tvm.IRModule({spec.func_name: func})
    return schedule_module(spec).schedule(mod, spec, resolve_knobs(spec) if knobs is None
                                          else knobs)


def build_spec(spec: KernelSpec, out_dir: str | os.PathLike) -> Path:
    """Build ``spec`` into ``out_dir/<spec.file_name()>`` (and its manifest); returns the path.

    A module already there that is fresh (same TVM, same source digest; another process may
    have just built it) is kept. CUDA specs are compiled by nvcc into a fatbin here; ptxas's
    resource report is written beside the module as ``<name>.ptxas.txt``.
    """
    out = Path(out_dir) / spec.file_name()
    make_dirs(out.parent)  # 0755 whatever the umask: the loader refuses group-writable
    with build_lock(out):
        remove_stale_work_dirs(out)
        if out.exists() and is_fresh(out, spec):
            log.debug("%s is already built", out)
            return out
        knobs = resolve_knobs(spec)
        log.info("building %s%s for %s with %s", spec.uri,
                 f" ({spec.variant})" if spec.variant else "", spec.target_tag, knobs)
        start = time.perf_counter()
        export_module(lower(spec, knobs), spec.tvm_target(), out,
                      spec.arch if spec.is_cuda else None)
        write_manifest(out, spec, knobs)
        log.info("built %s in %.1f s", out, time.perf_counter() - start)
    return out


def build_lock(out: Path, timeout: float = -1):
    """The file lock (``.<name>.lock``, hidden beside the module ``out``) held while ``out``
    and its manifest are written; ``timeout`` as :class:`filelock.FileLock`'s (-1: wait)."""
    from filelock import FileLock

    return FileLock(str(out.parent / f".{out.name}.lock"), timeout=timeout)


def remove_stale_work_dirs(out: Path) -> None:
    """Remove the work folders (``.<stem>.build-XXXX/``) a killed build of ``out`` left
    beside it. Call it holding :func:`build_lock` of ``out``: no live build of ``out`` has
    one then."""
    prefix = f".{out.stem}.build-"
    for work in out.parent.iterdir():
        if work.name.startswith(prefix) and work.is_dir() and not work.is_symlink():
            log.info("removing %s, left by an interrupted build", work)
            shutil.rmtree(work, ignore_errors=True)


def export_module(mod, target, out: Path, arch: str | None = None) -> Path:
    """Compile the IRModule ``mod`` for ``target`` and export it to the file ``out`` with
    :func:`export_built`."""
    import tvm

    with target:
        executable = tvm.compile(mod, target=target)
    return export_built(executable.mod, out, arch)


def export_built(module, out: Path, arch: str | None = None) -> Path:
    """Export a built runtime module (a compiled kernel's host module, or a Relax VM
    executable's) to the file ``out``.

    With ``arch`` (a CUDA build) the one CUDA module in its import tree is compiled by nvcc
    into a fatbin for ``FATBIN_ARCHS[arch]`` and embedded in place of the CUDA source, so the
    file loads with the TVM runtime alone; ptxas's report goes beside it as
    ``<name>.ptxas.txt``. Work files live in a temporary folder inside ``out``'s directory and
    the results are renamed into place (concurrent readers never see a partial file).
    """
    out = Path(out)
    make_dirs(out.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.stem}.build-", dir=out.parent))
    try:
        tmp_out = tmp / out.name
        if arch is not None:
            device = _cuda_modules(module)
            if len(device) != 1:
                raise RuntimeError(f"expected one CUDA module in the build of {out.name}, "
                                   f"found {len(device)}")
            source = device[0].inspect_source()
            fatbin, report = nvcc_fatbin(source, fatbin_archs(arch, source), tmp)
            report_path = tmp / (out.stem + ".ptxas.txt")
            report_path.write_text(report)
            module.export_library(str(tmp_out), workspace_dir=str(tmp),
                                  fpack_imports=fatbin_packer(source, fatbin))
            set_file_mode(report_path)
            os.replace(report_path, out.with_suffix(".ptxas.txt"))
        else:
            module.export_library(str(tmp_out), workspace_dir=str(tmp))
        set_file_mode(tmp_out)  # explicit, whatever the umask
        os.replace(tmp_out, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _cuda_modules(module) -> list:
    """The CUDA modules in ``module``'s import tree."""
    found = [module] if module.kind == "cuda" else []
    for child in module.imports:
        found += _cuda_modules(child)
    return found


def check_layout(spec: KernelSpec) -> None:
    """Raise the typed error scheduling ``spec`` would raise for a thread / tile layout its
    kernel cannot take (the schedule module's ``check_layout(spec, knobs)``, where it has
    one: the CUDA decodes, whose layout depends on head_dim, the GQA group and the knobs),
    without building anything: ``python -m kvtvm build`` refuses such a spec up front (it
    built the others, then failed, leaving a half-written directory)."""
    mod = schedule_module(spec)
    check = getattr(mod, "check_layout", None)
    if check is not None:
        check(spec, resolve_knobs(spec))


def with_runtime_variants(spec: KernelSpec) -> list[KernelSpec]:
    """``spec`` and the named variants of it the ops layer may load at run time (declared by
    the family, :mod:`kvtvm.kernels.variants`): what an ahead-of-time build must hold."""
    return [spec] + [replace(spec, variant=name)
                     for name in variant_names(spec.op, spec.target, spec.quantized)
                     if name != spec.variant]


def build_specs(specs: Iterable[KernelSpec], out_dir, progress=None,
                show_progress: bool | None = None) -> list[Path]:
    """Build every spec into ``out_dir`` (keeping fresh ones already built there).

    ``progress(spec, path)`` is called after each; a tqdm bar is shown on a terminal
    (``show_progress=False`` hides it, ``True`` forces it).
    """
    from tqdm import tqdm

    specs = list(specs)
    paths = []
    bar = tqdm(specs, desc="kvtvm build", unit="kernel",
               disable=None if show_progress is None else not show_progress)
    for spec in bar:
        bar.set_postfix_str(spec.uri, refresh=False)
        path = build_spec(spec, out_dir)
        if progress:
            progress(spec, path)
        paths.append(path)
    return paths
