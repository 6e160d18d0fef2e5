"""What a kernel is: :class:`KernelSpec` (the compile key, the file name of the built module,
the key into ``tuning_logs/``), the target key of llvm builds, and the target of a device.

Needs no TVM compiler: runtime-only loads name files with it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import operator
import os
import re
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from ..cuda_limits import check_cuda_head_dim
from ..errors import DeviceMismatchError, DeviceUnavailableError, InvalidArgumentError, describe
from ..kernels.variants import variant_knobs
from ..params import dtype_name
from ..quant import QUANT_DTYPES

#: Kernel families, each defined by ``kvtvm.kernels.<family>`` and scheduled by
#: ``schedules/<family>/{cpu,cuda}.py``.
KERNEL_FAMILIES = ("append", "copy", "decode", "prefill")
#: Token layout inside a page: token-major ``[page, token, head, dim]`` or head-major.
LAYOUTS = ("nhd", "hnd")
#: CUDA archs kvtvm builds for (one CUDA schedule per family; arch differences are knob
#: defaults chosen inside it).
CUDA_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a")
#: Families whose kernels read or write quantized caches (``k_storage`` / ``v_storage``).
QUANT_FAMILIES = ("append", "decode", "prefill")
#: Families whose quantized specs are defined by a module of their own,
#: ``kvtvm.kernels.<op>_quant`` (the quantizing append); decode and prefill are defined once for
#: every storage type (their loads dequantize, :mod:`kvtvm.kernels.quant_access`).
QUANT_MODULES = ("append",)
#: Compile-time features (``KernelSpec.features``) and the families that have them.
FEATURES = ("sliding_window",)
FEATURE_FAMILIES = ("decode", "prefill")
#: How a storage type is spelled in a quantized spec's uri ("" = full precision).
_STORAGE_TAGS = {"": "full", "int8": "i8", "float8_e4m3fn": "e4m3"}


def _knob_value(name, value):
    """A knob value as the plain Python int, bool or str it is (numpy scalars converted: they
    slipped past the explicit-knob range checks, and hashed into other file names than the
    equal int); anything else is an InvalidArgumentError naming the knob."""
    if isinstance(value, (bool, str)):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    try:
        return operator.index(value)  # int and numpy integers; not floats (16.0 == 16)
    except TypeError:
        raise InvalidArgumentError(describe(f"knobs[{name!r}]", "an int, bool or str",
                                            repr(value))) from None


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
        Compile-time features that are on: names from :data:`FEATURES`
        (``"sliding_window"``, decode and prefill only).
    knobs : tuple of (str, value)
        Schedule knob overrides; a dict is accepted and frozen.
    variant : str
        A named runtime variant of the family on this target (``"serial"`` of append and
        decode on llvm, ``"short_query"`` of prefill on cuda; see
        :mod:`kvtvm.kernels.variants`); "" for the tuned default.
    k_storage, v_storage : str
        How the K (V) cache stores its rows: ``""`` (full precision, ``dtype``), ``"int8"`` or
        ``"float8_e4m3fn"`` (quantized rows with an inline float32 scale, :mod:`kvtvm.quant`).
        The ops read them off the cache views (:func:`kvtvm.storage.view_storage`); a spec
        with either quantized has its own file name and is built from the family's module
        (append: ``kvtvm.kernels.append_quant``) and schedule (``schedules/<op>/<cpu|cuda>.py``;
        append and CUDA decode: ``<cpu|cuda>_quant.py``, see
        :func:`kvtvm.compiler.knobs.schedule_module_name`).

    Raises
    ------
    InvalidArgumentError
        An unknown family, layout, target, arch, variant, feature or storage, a size that is
        not a positive int, or
        a head_dim the CUDA kernel of the family cannot take (:mod:`kvtvm.cuda_limits`).
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
    variant: str = ""
    k_storage: str = ""
    v_storage: str = ""

    def __post_init__(self):
        if self.op not in KERNEL_FAMILIES:
            raise InvalidArgumentError(describe("op", KERNEL_FAMILIES, repr(self.op)))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.layout not in LAYOUTS:
            raise InvalidArgumentError(describe("layout", LAYOUTS, repr(self.layout)))
        for name in ("head_dim", "n_kv_heads", "group_size"):
            value = getattr(self, name)
            try:  # a bool is no size (it named files "_dTrue"); numpy ints are
                value = None if isinstance(value, bool) else operator.index(value)
            except TypeError:
                value = None
            if value is None or not 0 < value < 1 << 31:  # the kernels index with int32
                raise InvalidArgumentError(describe(name, "a positive int below 2**31",
                                                    repr(getattr(self, name))))
            object.__setattr__(self, name, value)
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
        knobs = tuple(sorted((str(k), _knob_value(k, v)) for k, v in knobs))
        object.__setattr__(self, "knobs", knobs)
        features = () if self.features is None else self.features
        if isinstance(features, str) or not isinstance(features, (tuple, list, set, frozenset)) \
                or not all(isinstance(f, str) for f in features):
            raise InvalidArgumentError(describe("features", f"a tuple of names from {FEATURES}",
                                                repr(features)))
        features = tuple(sorted(set(features)))
        unknown = [f for f in features if f not in FEATURES or self.op not in FEATURE_FAMILIES]
        if unknown:  # a kernel built without it, under a name that says it has it
            raise InvalidArgumentError(describe(
                "features", f"names from {FEATURES} (of {', '.join(FEATURE_FAMILIES)} only)",
                f"{unknown} for {self.op}"))
        object.__setattr__(self, "features", features)
        object.__setattr__(self, "variant", str(self.variant or ""))
        for name in ("k_storage", "v_storage"):
            value = str(getattr(self, name) or "")
            if value == self.dtype:
                value = ""
            if value not in ("",) + QUANT_DTYPES:
                raise InvalidArgumentError(describe(name, ["", self.dtype, *QUANT_DTYPES],
                                                    repr(value)))
            if value and self.op not in QUANT_FAMILIES:
                raise InvalidArgumentError(describe(
                    name, f'"" for {self.op} (quantized caches: {", ".join(QUANT_FAMILIES)})',
                    repr(value)))
            object.__setattr__(self, name, value)
        variant_knobs(self.op, self.target, self.variant, self.quantized)  # raises if unknown
        if self.target == "cuda":
            check_cuda_head_dim(self.op, self.dtype, self.head_dim, self.k_storage,
                                self.v_storage)

    # -- names ------------------------------------------------------------------------------
    @property
    def uri(self) -> str:
        """Target-independent name of the specialization (no knobs, no variant)."""
        feats = "".join(f"_{f}" for f in self.features)
        quant = (f"_k{_STORAGE_TAGS[self.k_storage]}_v{_STORAGE_TAGS[self.v_storage]}"
                 if self.quantized else "")
        return (f"{self.op}_{self.dtype}_h{self.n_kv_heads}_g{self.group_size}"
                f"_d{self.head_dim}_{self.layout}{feats}{quant}")

    @property
    def quantized(self) -> bool:
        """Whether K or V is stored quantized (an 8-bit cache, :mod:`kvtvm.quant`)."""
        return bool(self.k_storage or self.v_storage)

    @property
    def family_module(self) -> str:
        """The module defining this spec's kernel: ``kvtvm.kernels.<op>`` (every storage type)
        or, for a quantized spec of a family in :data:`QUANT_MODULES`,
        ``kvtvm.kernels.<op>_quant``."""
        quant = self.quantized and self.op in QUANT_MODULES
        return f"kvtvm.kernels.{self.op}{'_quant' if quant else ''}"

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

    @property
    def variant_knobs(self) -> dict:
        """Knob overrides of :attr:`variant` ({} for the default)."""
        return variant_knobs(self.op, self.target, self.variant, self.quantized)

    def with_knobs(self, **knobs) -> "KernelSpec":
        """A copy with ``knobs`` overriding this spec's knobs."""
        merged = dict(self.knobs)
        merged.update(knobs)
        return replace(self, knobs=merged)

    def knobs_key(self) -> str:
        """Short hash of the explicit :attr:`knobs` ("" when there are none)."""
        if not self.knobs:
            return ""
        # a bool as the int it equals: specs equal as dataclasses name one file
        text = json.dumps([[k, int(v) if isinstance(v, bool) else v] for k, v in self.knobs],
                          sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]

    def file_name(self) -> str:
        """Module file name, relative to a kernel directory:
        ``<target_tag>/<uri>[-<variant>][-<cpu key>][-k<knobs hash>].so``.

        The name is the load key: it depends on the spec alone, never on source files (what a
        file was built from is recorded in its manifest, see :mod:`kvtvm.compiler.manifest`).
        """
        parts = [self.uri]
        if self.variant:
            parts.append(self.variant)
        if self.target == "llvm":
            parts.append(target_key())
        if self.knobs:
            parts.append("k" + self.knobs_key())
        return f"{self.target_tag}/{'-'.join(parts)}.so"

    def tvm_target(self):
        """The ``tvm.target.Target`` of this spec (needs the compiler).

        Raises
        ------
        InvalidArgumentError
            ``KVTVM_LLVM_MCPU`` names a CPU LLVM does not know (LLVM would print errors and
            build generic code, under the file name of that CPU).
        """
        import tvm

        if self.target == "llvm":
            target = {"kind": "llvm", "num-cores": os.cpu_count() or 1}
            mcpu = llvm_mcpu()
            if mcpu and "KVTVM_LLVM_MCPU" in os.environ:
                from tvm.target import codegen

                triple = codegen.llvm_get_system_triple()
                if not codegen.llvm_is_valid_cpu(mcpu, triple):
                    raise InvalidArgumentError(describe(
                        "KVTVM_LLVM_MCPU", f"a CPU LLVM knows for {triple} (this host: "
                        f"{_host_cpu() or 'generic'}), or unset", repr(mcpu)))
            if mcpu:  # without it LLVM emits generic x86-64 (SSE2) code
                target["mcpu"] = mcpu
            return tvm.target.Target(target)
        return tvm.target.Target({"kind": "cuda", "arch": self.arch})


def llvm_mcpu() -> str:
    """CPU that llvm specs are compiled for: ``KVTVM_LLVM_MCPU``, else the build host's CPU as
    LLVM names it (e.g. ``"znver4"``); "" for generic code."""
    if "KVTVM_LLVM_MCPU" in os.environ:
        return os.environ["KVTVM_LLVM_MCPU"]
    return _host_cpu()


def _host_cpu() -> str:
    """The build host's CPU as LLVM names it ("" when it cannot tell)."""
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
    loads must compute the same name): ``KVTVM_LLVM_MCPU`` when set, else the host's
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


def target_key() -> str:
    """The CPU part of an llvm module's file name: ``cpu-<mcpu>`` or ``host-<flags hash>``, so
    a module built for one CPU is never loaded on another."""
    key = _cpu_key()
    if key.startswith("host:"):
        return "host-" + key[5:]
    return "cpu-" + (re.sub(r"[^A-Za-z0-9_]", "_", key) or "generic")


def tvm_version() -> str:
    """The installed TVM's version (works with the runtime alone)."""
    import tvm

    return getattr(tvm, "__version__", "unknown")


class Target(NamedTuple):
    """Where a call runs: ``("llvm", None)`` or ``("cuda", "sm_90a")``."""

    target: str
    arch: str | None


@functools.lru_cache(maxsize=None)
def target_for_device(device) -> Target:
    """The kernel target for tensors on the torch ``device``.

    Raises
    ------
    DeviceUnavailableError
        A CUDA device on a machine without CUDA, or one older than compute capability 8.0.
    DeviceMismatchError
        Neither a CPU nor a CUDA device.
    """
    if device.type == "cpu":
        return Target("llvm", None)
    if device.type == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise DeviceUnavailableError(f"tensors are on {device} but CUDA is not available")
        major, minor = torch.cuda.get_device_capability(device)
        if major >= 9:
            return Target("cuda", "sm_90a")
        if major == 8:
            return Target("cuda", "sm_80")
        raise DeviceUnavailableError(
            f"{device} has compute capability {major}.{minor}; kvtvm's CUDA kernels need 8.0+")
    raise DeviceMismatchError(describe("device", "cpu or cuda", device))
