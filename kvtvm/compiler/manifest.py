"""The manifest beside each built module (``<name>.json``): what it was built from.

It records the kvtvm and TVM versions, the spec, the resolved knobs and the *source digest*:
a hash of the family's definition, the accessor, the family's schedule modules for the target
and the tuning log's knobs -- of their syntax trees with docstrings dropped, so editing a
comment or a docstring leaves it unchanged. Loading compares it (see :mod:`.cache`).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from .._version import __version__
from .knobs import schedules_dir, tuned_knobs
from .trust import check_digest, read_json, set_file_mode, sha256_of
from .spec import QUANT_FAMILIES, KernelSpec, target_key, tvm_version

#: Bumped when the manifest's fields change meaning.
MANIFEST_FORMAT = 1

_KERNELS = Path(__file__).resolve().parent.parent / "kernels"


def kernels_dir() -> Path:
    """Folder of the kernel family sources (``kvtvm/kernels``)."""
    return _KERNELS


def manifest_path(module_path: str | os.PathLike) -> Path:
    """``<name>.json`` beside the module ``<name>.so``."""
    return Path(module_path).with_suffix(".json")


def source_files(spec: KernelSpec) -> list[Path]:
    """The sources a build of ``spec`` depends on (besides TVM and the tuning log)."""
    kernels, sched = kernels_dir(), schedules_dir()
    prefix = "cpu" if spec.target == "llvm" else "cuda"
    quant = [kernels / "quant_access.py"] if spec.op in QUANT_FAMILIES else []
    if spec.family_module.endswith("_quant"):
        quant.append(kernels / f"{spec.op}_quant.py")
    if quant:  # the storage formats' constants (QMAX, row bytes, MIN_SCALE)
        quant.append(kernels.parent / "quant.py")
    # which CUDA kernel a spec gets (e.g. the tensor-core decode's rule) lives in cuda_limits,
    # nvcc's flags (and the retry of a spilling build) in compiler/nvcc.py
    limits = [kernels.parent / "cuda_limits.py", Path(__file__).with_name("nvcc.py")] \
        if spec.target == "cuda" else []
    return ([kernels / f"{spec.op}.py", kernels / "accessor.py", kernels / "_tvm.py",
             kernels / "variants.py", sched / "common.py"] + quant + limits
            + sorted((sched / spec.op).glob(f"{prefix}*.py")))


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(
                    getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


@functools.lru_cache(maxsize=256)
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    tree = _strip_docstrings(ast.parse(Path(path).read_text(), filename=path))
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()


def source_digest(spec: KernelSpec) -> str:
    """Hash of what ``spec``'s build depends on: its sources' syntax trees (comments and
    docstrings do not count) and the tuning log's knobs."""
    h = hashlib.sha256()
    for path in source_files(spec):
        h.update(path.name.encode())
        if path.exists():
            st = path.stat()
            h.update(_file_digest(str(path), st.st_mtime_ns, st.st_size).encode())
        else:
            h.update(b"-")
    h.update(json.dumps(tuned_knobs(spec), sort_keys=True, default=str).encode())
    return h.hexdigest()[:24]


def spec_fields(spec: KernelSpec) -> dict:
    return {"op": spec.op, "dtype": spec.dtype, "head_dim": spec.head_dim,
            "n_kv_heads": spec.n_kv_heads, "group_size": spec.group_size,
            "layout": spec.layout, "target": spec.target, "arch": spec.arch,
            "features": list(spec.features), "knobs": [list(kv) for kv in spec.knobs],
            "variant": spec.variant, "k_storage": spec.k_storage,
            "v_storage": spec.v_storage}


def write_manifest(module_path: Path, spec: KernelSpec, knobs: dict) -> Path:
    """Write the manifest of the module just built at ``module_path`` (atomically)."""
    data = {"format": MANIFEST_FORMAT, "kvtvm": __version__, "tvm": tvm_version(),
            "spec": spec_fields(spec), "target_key": target_key() if spec.target == "llvm"
            else spec.arch, "knobs": knobs, "source_digest": source_digest(spec),
            "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sha256": sha256_of(module_path)}
    out = manifest_path(module_path)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True, default=str)
        f.write("\n")
    set_file_mode(Path(tmp))
    os.replace(tmp, out)
    return out


def read_manifest(module_path: str | os.PathLike) -> dict | None:
    """The manifest of ``module_path``, or None when it is missing or unreadable."""
    try:
        data = read_json(manifest_path(module_path))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def spec_mismatch(module_path: Path, spec: KernelSpec, data: dict | None = None) -> str | None:
    """Why the manifest of ``module_path`` describes another kernel than ``spec`` (another
    spec, variant, knobs or CPU target: a file renamed or copied to ``spec``'s name), or None
    when it describes ``spec``."""
    data = read_manifest(module_path) if data is None else data
    if data is None:
        return f"it has no readable manifest ({manifest_path(module_path).name})"

    def norm(value):
        return json.loads(json.dumps(value, sort_keys=True, default=str))

    want, got = norm(spec_fields(spec)), norm(data.get("spec"))
    if got != want:
        fields = sorted(k for k in want if not isinstance(got, dict) or got.get(k) != want[k])
        return (f"its manifest describes another kernel ({', '.join(fields) or 'spec'}: "
                f"{[got.get(k) if isinstance(got, dict) else got for k in fields]}, expected "
                f"{[want[k] for k in fields]}); it was renamed or copied to this name")
    key = target_key() if spec.target == "llvm" else spec.arch
    if data.get("target_key") != key:
        return (f"its manifest says it was built for {data.get('target_key')!r}, not for "
                f"{key!r}; it was renamed or copied to this name")
    return None


def is_fresh(module_path: Path, spec: KernelSpec) -> bool:
    """Whether the module at ``module_path`` was built for ``spec`` (the spec its manifest
    records) by this kvtvm and TVM from the current sources, and its bytes are the ones its
    manifest's sha256 names. (The kvtvm version too: a runtime-only process refuses a module
    another version built, so a build must not keep one.)"""
    data = read_manifest(module_path)
    return (data is not None and data.get("tvm") == tvm_version()
            and data.get("kvtvm") == __version__
            and spec_mismatch(module_path, spec, data) is None
            and data.get("source_digest") == source_digest(spec)
            and check_digest(Path(module_path), data) is None)


def version_mismatch(module_path: Path) -> str | None:
    """Why the module at ``module_path`` cannot be trusted by this runtime (another kvtvm or
    TVM version, or no readable manifest), or None when it can."""
    data = read_manifest(module_path)
    if data is None:
        return f"it has no readable manifest ({manifest_path(module_path).name})"
    built = (data.get("kvtvm"), data.get("tvm"))
    here = (__version__, tvm_version())
    if built != here:
        return (f"it was built by kvtvm {built[0]} with TVM {built[1]}, and this is kvtvm "
                f"{here[0]} with TVM {here[1]}")
    return None
