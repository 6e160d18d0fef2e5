"""KernelSpec -> IRModule -> schedule -> build -> exported ``.so``; disk cache; runtime-only load.

A :class:`KernelSpec` names one specialization of one kernel family. It is the compile key, the
file name of the built module and the key into ``tuning_logs/``. The pipeline:

1. ``kvtvm.kernels.<op>.define(spec)`` gives the unscheduled PrimFunc (named blocks);
2. ``schedules.<family>.schedule_<op>(mod, spec, knobs)`` schedules it for the target, with
   knobs = the schedule's defaults, then ``tuning_logs/<arch>/<uri>.json``, then ``spec.knobs``;
3. ``tvm.compile`` lowers it; for CUDA the device source is compiled **now** by nvcc into a
   fatbin (sm_80 + sm_90a for an sm_90a spec) and embedded in the exported library in place of
   the source, so loading never calls NVRTC or nvcc;
4. the module is exported to ``<dir>/<target_tag>/<uri>-<digest>.so``.

:func:`get_kernel` loads a spec from the kernel directories (``KVTVM_KERNEL_PATH``, dirs added
with :func:`add_kernel_dir`, then the cache ``KVTVM_CACHE_DIR`` or ``~/.cache/kvtvm``), and,
when the TVM compiler is present, builds a missing spec once and caches it. Only
:func:`build_spec` and below touch TVM's compiler; loading uses :mod:`kvtvm.runtime` alone.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

from . import runtime
from .errors import CompilerUnavailableError, InvalidArgumentError, describe
from .params import dtype_name

#: Kernel families and the module defining each (``define(spec)`` + ``reference_*``).
KERNEL_FAMILIES = ("append", "copy", "decode", "prefill")
#: Token layout inside a page: token-major ``[page, token, head, dim]`` or head-major.
LAYOUTS = ("nhd", "hnd")
#: CUDA archs kvtvm schedules for, and the schedule module of each.
CUDA_ARCHS = {"sm_90a": "cuda_sm90", "sm_90": "cuda_sm90", "sm_80": "cuda_sm80",
              "sm_86": "cuda_sm80", "sm_89": "cuda_sm80"}
#: Extra architectures compiled into the fatbin of a spec built for ``arch``.
FATBIN_ARCHS = {"sm_90a": ("sm_80", "sm_90a"), "sm_90": ("sm_80", "sm_90"),
                "sm_80": ("sm_80",), "sm_86": ("sm_80", "sm_86"), "sm_89": ("sm_80", "sm_89")}

_ROOT = Path(__file__).resolve().parent
_REPO = _ROOT.parent


@dataclass(frozen=True)
class KernelSpec:
    """One specialization of one kernel family.

    Parameters
    ----------
    op : str
        Kernel family: ``"append"``, ``"copy"``, ``"decode"`` or ``"prefill"``.
    dtype : str
        Element type of the cache (and of q/k/v): float16, bfloat16 or float32.
    head_dim, n_kv_heads : int
        Compile-time shape of a head and the KV heads per device.
    group_size : int
        Query heads per KV head (GQA); 1 for kernels without queries.
    layout : str
        ``"nhd"`` (CONTINUOUS and PAGED caches) or ``"hnd"`` (LINEAR cache).
    target : str
        ``"llvm"`` (CPU) or ``"cuda"``.
    arch : str, optional
        CUDA architecture (``"sm_90a"``, ``"sm_80"``); None for llvm.
    features : tuple of str
        Compile-time features that are on (e.g. ``"sliding_window"``).
    knobs : tuple of (str, value)
        Schedule knob overrides; a dict is accepted and frozen.
    """

    op: str
    dtype: str
    head_dim: int
    n_kv_heads: int
    group_size: int = 1
    layout: str = "nhd"
    target: str = "llvm"
    arch: str | None = None
    features: tuple = ()
    knobs: tuple = field(default=())

    def __post_init__(self):
        if self.op not in KERNEL_FAMILIES:
            raise InvalidArgumentError(describe("op", KERNEL_FAMILIES, repr(self.op)))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.layout not in LAYOUTS:
            raise InvalidArgumentError(describe("layout", LAYOUTS, repr(self.layout)))
        for name in ("head_dim", "n_kv_heads", "group_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(describe(name, "a positive int", repr(value)))
        if self.target == "llvm":
            if self.arch is not None:
                raise InvalidArgumentError(describe("arch", "None for the llvm target",
                                                    repr(self.arch)))
        elif self.target == "cuda":
            if self.arch not in CUDA_ARCHS:
                raise InvalidArgumentError(describe("arch", sorted(CUDA_ARCHS), repr(self.arch)))
        else:
            raise InvalidArgumentError(describe("target", ("llvm", "cuda"), repr(self.target)))
        knobs = self.knobs.items() if isinstance(self.knobs, dict) else self.knobs
        object.__setattr__(self, "knobs", tuple(sorted((str(k), v) for k, v in knobs)))
        object.__setattr__(self, "features", tuple(sorted(self.features)))

    # -- names ------------------------------------------------------------------------------
    @property
    def uri(self) -> str:
        """Target-independent name of the specialization (no knobs)."""
        feats = "".join(f"_{f}" for f in self.features)
        return (f"{self.op}_{self.dtype}_h{self.n_kv_heads}_g{self.group_size}"
                f"_d{self.head_dim}_{self.layout}{feats}")

    @property
    def target_tag(self) -> str:
        """``"llvm"`` or the CUDA arch; the folder of ``tuning_logs/`` and of built modules."""
        return "llvm" if self.target == "llvm" else self.arch

    @property
    def func_name(self) -> str:
        """Name of the entry function inside the built module."""
        return f"kvtvm_{self.op}"

    @property
    def is_cuda(self) -> bool:
        return self.target == "cuda"

    def with_knobs(self, **knobs) -> "KernelSpec":
        """A copy with ``knobs`` overriding this spec's knobs."""
        merged = dict(self.knobs)
        merged.update(knobs)
        return replace(self, knobs=merged)

    def digest(self) -> str:
        """Hash of everything the built module depends on: the spec, TVM's version, the
        kernel and schedule sources and the tuning log."""
        h = hashlib.sha256()
        h.update(repr((self.op, self.dtype, self.head_dim, self.n_kv_heads, self.group_size,
                       self.layout, self.target, self.arch, self.features,
                       self.knobs, _cpu_key() if self.target == "llvm" else None)).encode())
        h.update(_tvm_version().encode())
        for path in _source_files(self):
            h.update(path.name.encode())
            h.update(path.read_bytes() if path.exists() else b"-")
        return h.hexdigest()[:16]

    def file_name(self) -> str:
        """Module file name, relative to a kernel directory."""
        return f"{self.target_tag}/{self.uri}-{self.digest()}.so"

    def tvm_target(self):
        """The ``tvm.target.Target`` of this spec (needs the compiler)."""
        import tvm

        if self.target == "llvm":
            target = {"kind": "llvm", "num-cores": os.cpu_count() or 1}
            if llvm_mcpu():  # without it LLVM emits generic x86-64 (SSE2) code
                target["mcpu"] = llvm_mcpu()
            return tvm.target.Target(target)
        return tvm.target.Target({"kind": "cuda", "arch": self.arch})


def llvm_mcpu() -> str:
    """CPU that llvm specs are compiled for: ``KVTVM_LLVM_MCPU``, else the build host's CPU as
    LLVM names it (e.g. ``"znver4"``); "" for generic code. Part of the spec digest, so a
    module built for one CPU is never loaded for a spec resolved on another."""
    if "KVTVM_LLVM_MCPU" in os.environ:
        return os.environ["KVTVM_LLVM_MCPU"]
    global _HOST_CPU
    if _HOST_CPU is None:
        try:
            from tvm.target import codegen

            _HOST_CPU = str(codegen.llvm_get_system_cpu())
        except Exception:  # runtime-only TVM, or an LLVM without host detection
            _HOST_CPU = ""
    return _HOST_CPU


_HOST_CPU = None


def _cpu_key() -> str:
    """What llvm modules are specialized for, readable without TVM's compiler (runtime-only
    loads must compute the same digest): ``KVTVM_LLVM_MCPU`` when set, else the host's
    instruction-set flags."""
    if "KVTVM_LLVM_MCPU" in os.environ:
        return os.environ["KVTVM_LLVM_MCPU"]
    return _host_flags_key()


@functools.lru_cache(maxsize=None)
def _host_flags_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        import platform

        flags = platform.machine() + platform.processor()
    return "host:" + hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:12]


def _tvm_version() -> str:
    import tvm

    return getattr(tvm, "__version__", "unknown")


def schedule_module_name(spec: KernelSpec) -> str:
    """``schedules.<name>`` module that schedules ``spec``."""
    return "cpu" if spec.target == "llvm" else CUDA_ARCHS[spec.arch]


def _schedules_dir() -> Path:
    installed = _ROOT / "schedules"
    return installed if installed.is_dir() else _REPO / "schedules"


def tuning_logs_dir() -> Path:
    """Root of the tuning logs builds read: ``KVTVM_TUNING_LOGS`` if set, else the package's
    ``tuning_logs/``."""
    if os.environ.get("KVTVM_TUNING_LOGS"):
        return Path(os.environ["KVTVM_TUNING_LOGS"])
    installed = _ROOT / "tuning_logs"
    return installed if installed.is_dir() else _REPO / "tuning_logs"


def tuning_log_path(spec: KernelSpec, root: Path | None = None) -> Path:
    """``<root>/<target_tag>/<uri>.json`` for ``spec`` (root: :func:`tuning_logs_dir`)."""
    return Path(root or tuning_logs_dir()) / spec.target_tag / f"{spec.uri}.json"


def _source_files(spec: KernelSpec) -> list[Path]:
    kernels = _ROOT / "kernels"
    return [Path(__file__), kernels / f"{spec.op}.py", kernels / "accessor.py",
            _schedules_dir() / f"{schedule_module_name(spec)}.py",
            _schedules_dir() / "common.py", tuning_log_path(spec)] \
        + sorted(_schedules_dir().glob(f"*_{spec.op}.py"))  # per-op schedule files


def tuned_knobs(spec: KernelSpec) -> dict:
    """Knob values recorded for ``spec`` in ``tuning_logs/`` (empty when none)."""
    path = tuning_log_path(spec)
    if not path.exists():
        return {}
    return dict(json.loads(path.read_text()).get("knobs", {}))


def resolve_knobs(spec: KernelSpec) -> dict:
    """Schedule defaults, overridden by the tuning log, overridden by ``spec.knobs``."""
    sched = _schedule_module(spec)
    knobs = dict(getattr(sched, "default_knobs")(spec))
    knobs.update(tuned_knobs(spec))
    knobs.update(dict(spec.knobs))
    return knobs


def _schedule_module(spec: KernelSpec):
    try:
        return importlib.import_module(f"kvtvm.schedules.{schedule_module_name(spec)}")
    except ModuleNotFoundError:  # running from a source tree that is not installed
        return importlib.import_module(f"schedules.{schedule_module_name(spec)}")


# ------------------------------------------------------------------------------------------
# Kernel directories and loading
# ------------------------------------------------------------------------------------------

_extra_dirs: list[Path] = []
_loaded: dict[tuple, Any] = {}
_load_lock = threading.RLock()


def cache_dir() -> Path:
    """Directory where kernels built on demand are cached (``KVTVM_CACHE_DIR``)."""
    base = os.environ.get("KVTVM_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "kvtvm")
    return Path(base) / f"tvm-{_tvm_version()}"


def add_kernel_dir(path: str | os.PathLike) -> None:
    """Search ``path`` (a ``python -m kvtvm build --out`` directory) for built kernels."""
    path = Path(path)
    if path not in _extra_dirs:
        _extra_dirs.append(path)


def search_key() -> tuple:
    """What decides where kernels are found (cheap: strings only); part of every memo key."""
    return (os.environ.get("KVTVM_KERNEL_PATH", ""), os.environ.get("KVTVM_CACHE_DIR", ""),
            tuple(_extra_dirs))


@functools.lru_cache(maxsize=16)
def _kernel_dirs(key: tuple) -> tuple:
    env = [Path(p) for p in key[0].split(os.pathsep) if p]
    return tuple(env + list(key[2]) + [cache_dir()])


def kernel_dirs() -> list[Path]:
    """Directories searched for built kernels, in order: ``KVTVM_KERNEL_PATH``, directories
    added with :func:`add_kernel_dir`, then the cache."""
    return list(_kernel_dirs(search_key()))


def find_built(spec: KernelSpec) -> Path | None:
    """Path of an already built module for ``spec``, or None."""
    name = spec.file_name()
    for d in kernel_dirs():
        if (d / name).exists():
            return d / name
    return None


def get_kernel(spec: KernelSpec):
    """The callable entry function of ``spec``, loading or building it once per process.

    Raises
    ------
    CompilerUnavailableError
        The spec is not built anywhere on the kernel path and TVM's compiler is absent.
    DeviceUnavailableError
        A CUDA spec is requested on a machine that cannot run CUDA.
    """
    key = (spec, search_key())
    with _load_lock:
        if key in _loaded:
            return _loaded[key][1]
        path = find_built(spec)
        if path is None:
            if not runtime.compiler_available():
                raise CompilerUnavailableError(
                    f"kernel {spec.uri} for {spec.target_tag} is not built in any of "
                    f"{[str(d) for d in kernel_dirs()]} and the TVM compiler is not available "
                    "(runtime-only mode); build it ahead of time with `python -m kvtvm build`")
            path = build_spec(spec, cache_dir())
        module = runtime.load_module(str(path), needs_cuda=spec.is_cuda)
        fn = module[spec.func_name]
        _loaded[key] = (module, fn)  # the module must outlive its functions
        return fn


# ------------------------------------------------------------------------------------------
# Building (needs TVM's compiler)
# ------------------------------------------------------------------------------------------


def lower(spec: KernelSpec):
    """Definition + schedule of ``spec``: the scheduled ``IRModule`` (for inspection)."""
    if not runtime.compiler_available():
        raise CompilerUnavailableError("building kernels needs TVM's compiler library")
    import tvm

    kernels = importlib.import_module(f"kvtvm.kernels.{spec.op}")
    func = kernels.define(spec).with_attr("global_symbol", spec.func_name)
    mod = tvm.IRModule({spec.func_name: func})
    schedule = getattr(_schedule_module(spec), f"schedule_{spec.op}")
    return schedule(mod, spec, resolve_knobs(spec))


def build_spec(spec: KernelSpec, out_dir: str | os.PathLike) -> Path:
    """Build ``spec`` and export it to ``out_dir/<spec.file_name()>``; returns the path.

    CUDA specs are compiled by nvcc into a fatbin here; ptxas's resource report is written
    beside the module as ``<name>.ptxas.txt``.
    """
    out = Path(out_dir) / spec.file_name()
    return export_module(lower(spec), spec.tvm_target(), out, spec.arch if spec.is_cuda else None)


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
    ``<name>.ptxas.txt``.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="kvtvm-build-"))
    try:
        tmp_out = tmp / out.name
        if arch is not None:
            device = _cuda_modules(module)
            if len(device) != 1:
                raise RuntimeError(f"expected one CUDA module in the build of {out.name}, "
                                   f"found {len(device)}")
            source = device[0].inspect_source()
            fatbin, report = nvcc_fatbin(source, fatbin_archs(arch, source), tmp)
            (tmp / (out.name[:-3] + ".ptxas.txt")).write_text(report)
            module.export_library(str(tmp_out), workspace_dir=str(tmp),
                                  fpack_imports=_fatbin_packer(source, fatbin))
            shutil.copy(tmp / (out.name[:-3] + ".ptxas.txt"), out.with_suffix(".ptxas.txt"))
        else:
            module.export_library(str(tmp_out), workspace_dir=str(tmp))
        os.replace(tmp_out, out)  # atomic: concurrent builders never see a partial file
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _cuda_modules(module) -> list:
    """The CUDA modules in ``module``'s import tree."""
    found = [module] if module.kind == "cuda" else []
    for child in module.imports:
        found += _cuda_modules(child)
    return found


def with_runtime_variants(spec: KernelSpec) -> list[KernelSpec]:
    """``spec`` and the knob variants of it the ops layer may load at run time (declared by
    the schedule module's ``RUNTIME_VARIANTS``): what an ahead-of-time build must hold."""
    variants = getattr(_schedule_module(spec), "RUNTIME_VARIANTS", {}).get(spec.op, [])
    return [spec] + [spec.with_knobs(**v) for v in variants]


def build_specs(specs: Iterable[KernelSpec], out_dir, progress=None) -> list[Path]:
    """Build every spec into ``out_dir`` (skipping ones already built there)."""
    paths = []
    for spec in specs:
        path = Path(out_dir) / spec.file_name()
        if not path.exists():
            build_spec(spec, out_dir)
        if progress:
            progress(spec, path)
        paths.append(path)
    return paths


def fatbin_archs(arch: str, source: str) -> tuple[str, ...]:
    """Architectures the fatbin of a build for ``arch`` holds: ``FATBIN_ARCHS[arch]``, less
    the older ones when the kernel uses an instruction only ``arch`` has (``wgmma``)."""
    if "wgmma." in source:
        return (arch,)
    return FATBIN_ARCHS[arch]


def nvcc_fatbin(source: str, archs: Iterable[str], workdir: Path) -> tuple[bytes, str]:
    """Compile CUDA ``source`` with nvcc into a fatbin holding SASS for every arch in
    ``archs`` (plus PTX of the newest, for forward compatibility).

    Returns the fatbin bytes and ptxas's verbose report (registers, spills).
    """
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise CompilerUnavailableError("building CUDA kernels needs nvcc on PATH")
    cu = workdir / "kernel.cu"
    cu.write_text(source)
    target = workdir / "kernel.fatbin"
    cmd = [nvcc, "--fatbin", "-O3", "-std=c++17", "--use_fast_math",
           "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
           "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
           "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
           "--expt-relaxed-constexpr", "-Xptxas=-v,--warn-on-spills"]
    archs = list(archs)
    for arch in archs:
        num = arch[3:]
        cmd += ["-gencode", f"arch=compute_{num},code=sm_{num}"]
    num = archs[-1][3:]
    cmd += ["-gencode", f"arch=compute_{num},code=compute_{num}", "-o", str(target), str(cu)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
    return target.read_bytes(), proc.stderr + proc.stdout


def spill_report(ptxas_text: str) -> dict[str, dict[str, int]]:
    """Per (arch, kernel) registers and spill bytes parsed from a ptxas ``-v`` report.

    Spill bytes are read from each function's "Function properties" line; ptxas's separate
    "Registers are spilled ... in function 'f'" warning can come after the next function's
    heading, so it is attributed by the name it gives.
    """
    result: dict[str, dict[str, int]] = {}
    current = None
    for line in ptxas_text.splitlines():
        m = re.search(r"Compiling entry function '(\w+)' for '(\w+)'", line)
        if m:
            current = f"{m.group(2)}:{m.group(1)}"
            result[current] = {"registers": 0, "spill_stores": 0, "spill_loads": 0}
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            named = re.search(r"in function '(\w+)'", line)
            key = f"{current.split(':')[0]}:{named.group(1)}" if named else current
            entry = result.setdefault(key, {"registers": 0, "spill_stores": 0,
                                            "spill_loads": 0})
            entry["spill_stores"] = max(entry["spill_stores"], int(m.group(1)))
            entry["spill_loads"] = max(entry["spill_loads"], int(m.group(2)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            result[current]["registers"] = int(m.group(1))
    return result


# -- embedding a fatbin in place of CUDA source -------------------------------------------
# The exported library carries its imported modules as one blob, ``__tvm_ffi__library_bin``:
#   u64 size | import tree (vec<u64> row_ptr, vec<u64> child) | per module: str kind [payload]
# where every module but the host ("_lib") is followed by u64 size + payload, and a CUDA
# payload is: str fmt | function-info map | str data. We rewrite fmt "cuda" (source, compiled
# when loaded) to "fatbin" (loaded as is) and data to the fatbin.


def _read_u64(buf: bytes, pos: int) -> tuple[int, int]:
    return struct.unpack_from("<Q", buf, pos)[0], pos + 8


def _read_str(buf: bytes, pos: int) -> tuple[bytes, int]:
    n, pos = _read_u64(buf, pos)
    return buf[pos:pos + n], pos + n


def _pack_str(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def replace_cuda_source_with_fatbin(blob: bytes, source: str, fatbin: bytes) -> bytes:
    """Rewrite a packed import blob so its CUDA module holds ``fatbin`` instead of source."""
    size, pos = _read_u64(blob, 0)
    if size != len(blob) - 8:
        raise ValueError("unexpected import blob header")
    start = pos
    for _ in range(2):  # row_ptr, child indices
        n, pos = _read_u64(blob, pos)
        pos += 8 * n
    out = bytearray(blob[start:pos])
    src = source.encode()
    replaced = 0
    while pos < len(blob):
        kind, pos = _read_str(blob, pos)
        out += _pack_str(kind)
        if kind == b"_lib":
            continue
        payload, pos = _read_str(blob, pos)
        if kind == b"cuda":
            fmt, ppos = _read_str(payload, 0)
            if fmt != b"cuda" or not payload.endswith(src):
                raise ValueError(f"CUDA module holds format {fmt!r}, expected CUDA source")
            fmap = payload[ppos:len(payload) - len(src) - 8]
            payload = _pack_str(b"fatbin") + fmap + _pack_str(fatbin)
            replaced += 1
        out += _pack_str(payload)
    if replaced != 1:
        raise ValueError(f"expected one CUDA module in the import blob, found {replaced}")
    return struct.pack("<Q", len(out)) + bytes(out)


def _fatbin_packer(source: str, fatbin: bytes):
    def pack(mod, is_system_lib, symbol_prefix, workspace_dir):
        import tvm_ffi

        blob = bytes(tvm_ffi.get_global_func("runtime.ModulePackImportsToTensor")(mod).numpy())
        blob = replace_cuda_source_with_fatbin(blob, source, fatbin)
        symbol = f"{symbol_prefix}__tvm_ffi__library_bin"
        path = os.path.join(workspace_dir, "devc.c")
        with open(path, "w") as f:
            f.write('#ifdef __cplusplus\nextern "C" {\n#endif\n')
            f.write(f"extern const unsigned char {symbol}[];\n")
            f.write(f"const unsigned char {symbol}[{len(blob)}] = {{\n")
            for i in range(0, len(blob), 32):
                f.write(",".join(str(b) for b in blob[i:i + 32]) + ",\n")
            f.write("};\n#ifdef __cplusplus\n}\n#endif\n")
        return path

    return pack


def fatbin_architectures(fatbin: bytes) -> list[str]:
    """SASS architectures (e.g. ``["sm_80", "sm_90a"]``) of the ELF entries in a fatbin."""
    magic, _, header, size = struct.unpack_from("<IHHQ", fatbin, 0)
    if magic != 0xBA55ED50:
        raise ValueError("not a fatbin")
    archs, pos = [], header
    while pos < header + size:
        kind, _, entry_header, payload = struct.unpack_from("<HHIQ", fatbin, pos)
        arch = struct.unpack_from("<I", fatbin, pos + 28)[0]
        flags = struct.unpack_from("<Q", fatbin, pos + 40)[0]
        if kind == 2:  # ELF (SASS); kind 1 is PTX
            archs.append(f"sm_{arch}" + ("a" if flags & 0x100000 else ""))
        pos += entry_header + payload
    return archs


def embedded_fatbin(library: str | os.PathLike) -> bytes:
    """The fatbin embedded in a built CUDA module file (for inspection and tests)."""
    data = Path(library).read_bytes()
    start = data.find(struct.pack("<I", 0xBA55ED50))
    if start < 0:
        raise ValueError(f"{library} holds no fatbin")
    _, _, header, size = struct.unpack_from("<IHHQ", data, start)
    return data[start:start + header + size]
