"""Finding and loading built kernels: the kernel directories (``KVTVM_KERNEL_PATH``, dirs added
with :func:`add_kernel_dir`, then the cache), their files' manifests, and building a missing
or stale spec into the cache when TVM's compiler is present.

A module is found by its spec's file name (spec URI + variant + target key + explicit knobs),
then its manifest decides:

- compiler present: fresh (built for this very spec, by this TVM, from the current source
  digest) -> load; otherwise rebuild into the cache (a prebuilt directory is never written);
- runtime only: built by this kvtvm and TVM -> load; another version, or no readable
  manifest -> :class:`~kvtvm.errors.KernelVersionError` naming the file and the versions; a
  manifest of another spec (a file renamed or copied to this name) or bytes that differ from
  its sha256 -> :class:`~kvtvm.errors.CorruptKernelError` naming the file.
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path
from typing import Any

from .. import runtime
from ..errors import (CompilerUnavailableError, CorruptKernelError, InvalidArgumentError,
                      KernelCacheError, KernelVersionError, KVCacheError, describe)
from . import build as _build
from .manifest import is_fresh, manifest_path, read_manifest, spec_mismatch, version_mismatch
from .trust import (check_digest, check_trusted, check_trusted_tree, corrupt, expand_user,
                    secure_cache_dir)
from .spec import KernelSpec, tvm_version

_extra_dirs: list[Path] = []
_loaded: dict[tuple, Any] = {}
_load_lock = threading.RLock()


def cache_dir() -> Path:
    """Directory where kernels built on demand are cached: ``KVTVM_CACHE_DIR``, else the
    user cache directory (``platformdirs``: ``$XDG_CACHE_HOME/kvtvm`` or ``~/.cache/kvtvm`` on
    Linux), in a folder per TVM version."""
    base, name = os.environ.get("KVTVM_CACHE_DIR"), "KVTVM_CACHE_DIR"
    if not base:
        import platformdirs

        base, name = platformdirs.user_cache_dir("kvtvm"), "XDG_CACHE_HOME"
    return expand_user(base, name) / f"tvm-{tvm_version()}"  # "~/x" from Docker's ENV too


def add_kernel_dir(path: str | os.PathLike) -> None:
    """Search ``path`` (a ``python -m kvtvm build --out`` directory) for built kernels.

    Raises
    ------
    InvalidArgumentError
        ``path`` is not a path, is empty (``Path("")`` would search the current
        directory), or starts with a ``~user`` of an unknown user.
    """
    if not isinstance(path, (str, os.PathLike)) or not str(os.fspath(path)).strip():
        raise InvalidArgumentError(describe("path", "a directory path", repr(path)))
    path = expand_user(os.fspath(path), "path")
    if path not in _extra_dirs:
        _extra_dirs.append(path)


def search_key() -> tuple:
    """What decides where kernels are found (cheap: strings only); part of every memo key."""
    return (os.environ.get("KVTVM_KERNEL_PATH", ""), os.environ.get("KVTVM_CACHE_DIR", ""),
            os.environ.get("XDG_CACHE_HOME", ""), tuple(_extra_dirs))


@functools.lru_cache(maxsize=16)
def _kernel_dirs(key: tuple) -> tuple:
    env = [expand_user(p, "KVTVM_KERNEL_PATH") for p in key[0].split(os.pathsep) if p.strip()]
    return tuple(env + list(key[3]) + [cache_dir()])


def kernel_dirs() -> list[Path]:
    """Directories searched for built kernels, in order: ``KVTVM_KERNEL_PATH``, directories
    added with :func:`add_kernel_dir`, then the cache."""
    return list(_kernel_dirs(search_key()))


def find_built(spec: KernelSpec) -> Path | None:
    """Path of a built module for ``spec`` on the kernel path (whatever its manifest says),
    or None."""
    name = spec.file_name()
    for d in kernel_dirs():
        if (d / name).exists():
            return d / name
    return None


#: Seconds a runtime-only process waits for a rebuild in progress of a module whose bytes
#: differ from its manifest (the build renames the module into place, then its manifest).
REBUILD_WAIT_S = 600


def _checked_entry(d: Path, path: Path) -> Path:
    """Run the trust checks on the module ``path`` found in the kernel directory ``d``: ``d``
    and every directory above it, the ``<target_tag>/`` folder between them, the file and its
    manifest (:mod:`.trust`; raises :class:`~kvtvm.errors.UntrustedKernelError`). Returns
    the module's resolved path: the one to hash and to load, so a symlink re-pointed after
    the checks changes nothing; its manifest is the one beside it."""
    real_dir = check_trusted_tree(d, "kernel directory")  # never load another user's code
    real = check_trusted(path)
    if real.parent != real_dir:  # the <target_tag>/ folder (or a link's), as every parent
        check_trusted(real.parent, "kernel directory")
    if manifest_path(real).exists():
        check_trusted(manifest_path(real), "kernel manifest")
    return real


def _corruption(path: Path, spec: KernelSpec) -> str | None:
    """Why the module ``path`` is not ``spec``'s as its manifest records it (None when it is)."""
    return spec_mismatch(path, spec) or check_digest(path, read_manifest(path))


def _after_rebuild(path: Path, spec: KernelSpec, bad: str) -> tuple[str | None, str | None]:
    """``(version mismatch, corruption)`` of ``path`` once a build of it in progress has
    finished (its build lock taken: a reader between the module's rename and its manifest's
    saw new bytes with the old manifest); ``(None, bad)`` when the lock cannot be taken (a
    directory this process cannot write: nobody builds there then)."""
    try:
        with _build.build_lock(path, timeout=REBUILD_WAIT_S):
            check_trusted(path)  # the file renamed into place, as the one it replaced
            return version_mismatch(path), _corruption(path, spec)
    except OSError:  # the lock file cannot be made, or filelock's Timeout
        return None, bad


def _usable(spec: KernelSpec, can_build: bool) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The first module for ``spec`` on the kernel path that may be loaded as is (resolved:
    :func:`_checked_entry`), and the ones passed over with the reason."""
    rejected = []
    for d in kernel_dirs():
        path = d / spec.file_name()
        if not path.exists():
            continue
        path = _checked_entry(d, path)
        if can_build:
            if is_fresh(path, spec):
                return path, rejected
            rejected.append((path, "stale"))
            continue
        why = version_mismatch(path)
        if why is None:
            bad = _corruption(path, spec)
            if bad is not None:
                why, bad = _after_rebuild(path, spec, bad)
            if why is None:
                if bad is None:
                    return path, rejected
                raise corrupt(path, bad)
        rejected.append((path, why))
    return None, rejected


def _build_into_cache(spec: KernelSpec) -> Path:
    """Build ``spec`` into the user cache; returns the module's resolved path once it passed
    the checks a module found there passes (:func:`_checked_entry`: a group-writable
    ``<target_tag>/`` folder is refused, before the build when it exists). A cache that
    cannot be made or written is a :class:`KernelCacheError` naming it (not a bare
    ``OSError`` from deep in the build)."""
    where = cache_dir()
    try:
        own_base = not os.environ.get("KVTVM_CACHE_DIR")  # ~/.cache/kvtvm is kvtvm's own
        root = secure_cache_dir(where, own_base)
        folder = (root / spec.file_name()).parent
        if folder.exists():  # refused before anything is built into it
            check_trusted(folder, "kernel directory")
        return _checked_entry(root, _build.build_spec(spec, root))
    except OSError as err:
        if isinstance(err, KVCacheError):  # UntrustedKernelError is a PermissionError
            raise
        raise KernelCacheError(
            f"cannot build kernel {spec.uri} into the kernel cache {where}: "
            f"{err.strerror or err} ({err.filename or where}); point KVTVM_CACHE_DIR at a "
            "writable directory, or build the kernels ahead of time (`python -m kvtvm build "
            "--out DIR`) and set KVTVM_KERNEL_PATH=DIR") from None


def get_kernel(spec: KernelSpec):
    """The callable entry function of ``spec``, loading or building it once per process.

    Raises
    ------
    CompilerUnavailableError
        The spec is not built anywhere on the kernel path and TVM's compiler is absent.
    KernelVersionError
        Runtime only, and the module found was built by another kvtvm or TVM version (or has
        no readable manifest).
    UntrustedKernelError
        A kernel directory or file is another user's or writable by group/others.
    CorruptKernelError
        Runtime only, and the module's bytes differ from its manifest's sha256 (truncated,
        modified), its manifest describes another spec (renamed or copied), or TVM cannot
        load it.
    DeviceUnavailableError
        A CUDA spec is requested on a machine that cannot run CUDA.
    KernelCacheError
        The spec must be built but the cache directory cannot be created or written.
    """
    key = (spec, search_key())
    with _load_lock:
        if key in _loaded:
            return _loaded[key][1]
        can_build = runtime.compiler_available()
        path, rejected = _usable(spec, can_build)
        if path is None:
            if not can_build:
                if rejected:
                    bad, why = rejected[0]
                    raise KernelVersionError(
                        f"cannot load {bad}: {why}; the TVM compiler is not available to "
                        "rebuild it (runtime-only mode): rebuild the kernels with this "
                        "version (`python -m kvtvm build`)")
                raise CompilerUnavailableError(
                    f"kernel {spec.uri}{f' (variant {spec.variant})' if spec.variant else ''}"
                    f" for {spec.target_tag}, file {spec.file_name()}, is not built in any of "
                    f"{[str(d) for d in kernel_dirs()]} and the TVM compiler is not available "
                    "(runtime-only mode); build it ahead of time with `python -m kvtvm build`")
            path = _build_into_cache(spec)
        try:
            module = runtime.load_module(str(path), needs_cuda=spec.is_cuda)
        except Exception as err:  # digest matched: a module TVM cannot load is still corrupt
            if type(err).__module__.startswith("kvtvm"):
                raise
            raise CorruptKernelError(f"cannot load {path}: {err}") from None
        try:
            fn = module[spec.func_name]
        except (AttributeError, KeyError) as err:  # a module of another kernel
            raise CorruptKernelError(f"{path} holds no function {spec.func_name} ({err})") \
                from None
        _loaded[key] = (module, fn)  # the module must outlive its functions
        return fn
