"""Knob values of a build: the schedule's defaults < the tuning log < the spec's variant < the
spec's explicit knobs; where tuning logs and schedule modules are found."""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

from ..errors import (CompilerUnavailableError, CorruptKernelError, InvalidArgumentError,
                      describe)
from ..kernels.variants import UNTUNED
from .spec import KernelSpec
from .trust import check_trusted, check_trusted_parents, expand_user, read_json

_PKG = Path(__file__).resolve().parent.parent  # kvtvm/
_REPO = _PKG.parent


#: (family, target) pairs whose quantized specs have a schedule module of their own,
#: ``schedules/<family>/<cpu|cuda>_quant.py``; the CPU decode and the CPU and CUDA prefill
#: schedules serve every storage type.
QUANT_SCHEDULES = (("append", "llvm"), ("append", "cuda"), ("decode", "cuda"))


def schedule_module_name(spec: KernelSpec) -> str:
    """``<family>.<cpu|cuda>``: the module of ``schedules/`` that schedules ``spec``
    (``<family>.<cpu|cuda>_quant`` for a quantized spec of :data:`QUANT_SCHEDULES`)."""
    quant = "_quant" if spec.quantized and (spec.op, spec.target) in QUANT_SCHEDULES else ""
    return f"{spec.op}.{'cpu' if spec.target == 'llvm' else 'cuda'}{quant}"


def schedule_module(spec: KernelSpec):
    """The schedule module of ``spec`` (``kvtvm.schedules.<family>.<cpu|cuda>``; from a source
    tree that is not installed, ``schedules.<family>.<cpu|cuda>``).

    Raises
    ------
    CompilerUnavailableError
        TVM's compiler is absent (runtime only): schedules, their knobs and builds need it
        (importing a schedule there failed with an ImportError from deep inside TVM).
    """
    from .. import runtime

    if not runtime.compiler_available():
        raise CompilerUnavailableError(
            f"scheduling or building {spec.uri} needs TVM's compiler, and this is the TVM "
            "runtime alone (TVM_USE_RUNTIME_LIB=1 or no libtvm_compiler.so): build kernels "
            "where the compiler is (`python -m kvtvm build`, `python -m kvtvm tune "
            "--build-only`) and load them here")
    try:
        return importlib.import_module(f"kvtvm.schedules.{schedule_module_name(spec)}")
    except ModuleNotFoundError:  # running from a source tree that is not installed
        return importlib.import_module(f"schedules.{schedule_module_name(spec)}")


def schedules_dir() -> Path:
    """Folder of the schedule sources: where :func:`schedule_module` imports them from
    (``kvtvm.schedules``, else a source tree's ``schedules``), so the digests that name a
    build hash the very files it ran -- not another checkout's (an editable install maps
    ``kvtvm.schedules`` to its own tree whatever ``kvtvm`` is imported from)."""
    for name in ("kvtvm.schedules", "schedules"):
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            found = None
        if found is not None and found.submodule_search_locations:
            return Path(list(found.submodule_search_locations)[0]).resolve()
    installed = _PKG / "schedules"
    return installed if installed.is_dir() else _REPO / "schedules"


def tuning_logs_dir() -> Path:
    """Root of the tuning logs builds read: ``KVTVM_TUNING_LOGS`` if set, else the package's
    ``tuning_logs/``."""
    if os.environ.get("KVTVM_TUNING_LOGS"):
        return expand_user(os.environ["KVTVM_TUNING_LOGS"], "KVTVM_TUNING_LOGS")
    installed = _PKG / "tuning_logs"
    return installed if installed.is_dir() else _REPO / "tuning_logs"


def tuning_log_path(spec: KernelSpec, root: Path | None = None) -> Path:
    """``<root>/<target_tag>/<uri>.json`` for ``spec`` (root: :func:`tuning_logs_dir`)."""
    return Path(root or tuning_logs_dir()) / spec.target_tag / f"{spec.uri}.json"


def tuned_knobs(spec: KernelSpec) -> dict:
    """Knob values recorded for ``spec`` in ``tuning_logs/`` (empty when none).

    The log, its directory and every directory above up to the user's home must be this
    user's or root's and not writable by group/others (:mod:`.trust`), else
    :class:`~kvtvm.errors.UntrustedKernelError` names the path and the reason."""
    path = tuning_log_path(spec)
    if not path.exists():
        if path.is_symlink():  # a dangling link or a loop: somebody meant a log to be here
            raise CorruptKernelError(f"tuning log {path} is a symlink to nothing (dangling "
                                     "or a loop); delete it or re-run `python -m kvtvm.tune`")
        return {}
    real = check_trusted(path, "tuning log")  # read that very file, not the path again
    check_trusted(real.parent, "tuning log directory")
    check_trusted_parents(real.parent, "tuning log directory")
    try:
        data = read_json(real)
        if not isinstance(data, dict):
            raise ValueError(f"it holds a JSON {type(data).__name__}, not an object")
        knobs = data.get("knobs", {})
        if not isinstance(knobs, dict):
            raise ValueError(f"'knobs' is {type(knobs).__name__}, not an object")
        for field, want in (("uri", spec.uri), ("target", spec.target_tag)):
            if data.get(field, want) != want:  # tuned for another kernel or target
                raise ValueError(f"it was tuned for {field} {data[field]!r}, not {want!r}")
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise CorruptKernelError(f"tuning log {path} is unreadable or corrupt ({err}); "
                                 "delete it or re-run `python -m kvtvm.tune`") from None
    return dict(knobs)


def searched_values(spec: KernelSpec) -> dict:
    """knob name -> the values :func:`knob_space` lists for it (over all its grids)."""
    values: dict = {}
    for grid in knob_grids(spec):
        for name, options in grid.items():
            values.setdefault(name, set()).update(options)
    return values


def _check_tuned(spec: KernelSpec, tuned: dict, defaults: dict) -> None:
    """Refuse tuned knobs the schedule does not have, of another type than its defaults, or
    of a value ``kvtvm.tune`` does not search other than the default (a log of another kvtvm
    version or target, or edited: a value the schedule was never checked with can build a
    wrong kernel, or hang the build): :class:`CorruptKernelError` naming the log. (A default
    may lie outside the space: the 8-bit CUDA decode's ``head_split`` 0 derives the parts
    from ``vec``.)"""
    searched = searched_values(spec)
    for name, value in tuned.items():
        why = None
        if name not in defaults:
            why = f"knob {name!r} is not one of this schedule's ({', '.join(sorted(defaults))})"
        else:
            want = type(defaults[name])
            if not (type(value) is want or (want is float and type(value) is int)):
                why = (f"knob {name!r} is {value!r}, expected {want.__name__} like the "
                       f"default {defaults[name]!r}")
            elif name in searched and value not in searched[name] and value != defaults[name]:
                why = (f"knob {name!r} is {value!r}, not one of the values kvtvm.tune "
                       f"searches ({sorted(searched[name])})")
        if why:
            raise CorruptKernelError(
                f"tuning log {tuning_log_path(spec)}: {why}; was it written by another kvtvm "
                "version or for another target? delete it or re-run `python -m kvtvm.tune`")
    _check_combination(spec, tuned, defaults)


def knob_grids(spec: KernelSpec) -> list[dict]:
    """:func:`knob_space` of ``spec`` as a list of grids (one dict of lists each)."""
    space = knob_space(spec)
    return space if isinstance(space, list) else [space]


def in_a_grid(knobs: dict, grids: list[dict]) -> bool:
    """Whether ``knobs`` lie inside one of ``grids``: each knob a grid lists has one of its
    values there (the knobs it does not list are free, as :func:`kvtvm.tune.candidates`
    leaves them at the defaults, or at a previous log's values)."""
    return any(all(knobs.get(name) in options for name, options in grid.items())
               for grid in grids)


def _check_combination(spec: KernelSpec, tuned: dict, defaults: dict) -> None:
    """Refuse tuned knobs that, over the defaults, lie in no single grid of
    :func:`knob_space` (a union: each value of some grid, the combination of none; e.g. the
    mma.sync prefill's 16 warps with 128-position tiles, which spills and overflows shared
    memory): :class:`CorruptKernelError` naming the log and the combination. The defaults
    themselves (a log of the default candidate) pass."""
    merged = {**defaults, **tuned}
    if not tuned or merged == defaults or in_a_grid(merged, knob_grids(spec)):
        return
    raise CorruptKernelError(
        f"tuning log {tuning_log_path(spec)}: its knobs {tuned} (with the defaults: "
        f"{merged}) are no combination kvtvm.tune searches: each value is in some grid, "
        "not all in one; was it edited? delete it or re-run `python -m kvtvm.tune`")


def default_knobs(spec: KernelSpec) -> dict:
    """The schedule's default knobs for ``spec`` (they may depend on the arch)."""
    return dict(schedule_module(spec).default_knobs(spec))


def resolve_knobs(spec: KernelSpec) -> dict:
    """Schedule defaults, overridden by the tuning log (unless the spec's variant is
    :data:`~kvtvm.kernels.variants.UNTUNED`), by the spec's variant, then by ``spec.knobs``.

    Raises
    ------
    CorruptKernelError
        The tuning log is unreadable, was tuned for another uri or target, or names a knob
        the schedule does not have or a value of another type than its default.
    """
    knobs = default_knobs(spec)
    variant = spec.variant_knobs
    if not variant.pop(UNTUNED, False):
        tuned = tuned_knobs(spec)
        _check_tuned(spec, tuned, knobs)
        knobs.update(tuned)
    knobs.update(variant)
    _check_explicit(spec, dict(spec.knobs))
    knobs.update(dict(spec.knobs))
    return knobs


#: An explicit knob may exceed the largest value ``kvtvm.tune`` searches by this factor.
EXPLICIT_KNOB_HEADROOM = 64


def _check_explicit(spec: KernelSpec, explicit: dict) -> None:
    """Refuse an explicit int knob (``KernelSpec(knobs=...)``) the tuner searches that is
    negative or past :data:`EXPLICIT_KNOB_HEADROOM` times the top searched value: a negative
    tile built a wrong kernel or crashed TVM, and 10**9 hung the build. (0 may mean something
    -- the CPU prefill's ``tile_q = 0`` schedules the definition itself --; schedules refuse
    what else they cannot build.)"""
    if not explicit:
        return
    searched = searched_values(spec)
    for name, value in explicit.items():
        options = [v for v in searched.get(name, ()) if type(v) is int]
        if type(value) is not int or not options:
            continue
        lo, hi = 0, EXPLICIT_KNOB_HEADROOM * max(max(options), 1)
        if not lo <= value <= hi:
            raise InvalidArgumentError(describe(
                f"knobs[{name!r}] of {spec.uri}", f"an int in [{lo}, {hi}] (kvtvm.tune "
                f"searches {sorted(options)})", value))


def knob_space(spec: KernelSpec):
    """The knob values ``kvtvm.tune`` searches for ``spec``: a dict of lists, or a list of
    such grids (their union), declared by the family (``kvtvm.kernels.<family>``)."""
    return importlib.import_module(spec.family_module).knob_space(spec)
