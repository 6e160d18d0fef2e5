"""The TVM runtime side of kvtvm: load built kernel modules and call them.

Everything here works with the TVM runtime alone (``TVM_USE_RUNTIME_LIB=1`` and no
``libtvm_compiler.so``): it never imports TVM's compiler, never calls NVRTC or nvcc. CUDA
kernels are loaded from binaries (fatbin) embedded in the module at build time.
"""

from __future__ import annotations

import ctypes
import os
import threading

from .errors import DeviceUnavailableError

_lock = threading.Lock()
_cuda_runtime_loaded = False


def physical_cores() -> int:
    """CPU cores this process may run on, hyper-thread siblings counted once."""
    cpus = (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:  # no sysfs topology: count the CPU itself
            cores.add(str(cpu))
    return max(1, len(cores))


def cpu_threads() -> int:
    """Threads TVM's thread pool runs kvtvm's CPU kernels on (``TVM_NUM_THREADS``)."""
    try:
        return max(1, int(os.environ["TVM_NUM_THREADS"]))
    except (KeyError, ValueError):
        return physical_cores()


# TVM sizes its CPU thread pool, when it first starts it, from TVM_NUM_THREADS, else from half the
# logical CPUs on x86 (a guess that hyper-threads come in pairs): on a machine without them --
# most VMs -- that left half the cores idle. Unless the user chose, use the physical cores.
os.environ.setdefault("TVM_NUM_THREADS", str(physical_cores()))


def tvm_runtime():
    """Import and return the ``tvm.runtime`` package (runtime-only safe)."""
    import tvm.runtime

    return tvm.runtime


def compiler_available() -> bool:
    """True when TVM's compiler library is loaded or can be loaded in this process."""
    import tvm

    try:
        from tvm.base import _RUNTIME_ONLY  # type: ignore[attr-defined]
    except ImportError:  # pragma: no cover - layout of other TVM versions
        _RUNTIME_ONLY = False
    if _RUNTIME_ONLY:
        return False
    return hasattr(tvm, "compile")


def ensure_cuda_runtime() -> None:
    """Load ``libtvm_runtime_cuda.so`` into the process (once).

    Raises
    ------
    DeviceUnavailableError
        When the CUDA driver (``libcuda.so.1``) or TVM's CUDA runtime cannot be loaded,
        i.e. this machine cannot run CUDA kernels.
    """
    global _cuda_runtime_loaded
    with _lock:
        if _cuda_runtime_loaded:
            return
        import tvm

        path = os.path.join(os.path.dirname(tvm.__file__), "lib", "libtvm_runtime_cuda.so")
        if not os.path.exists(path):
            raise DeviceUnavailableError(
                f"kvtvm needs TVM's CUDA runtime to run CUDA kernels, but {path} is missing")
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as err:
            raise DeviceUnavailableError(
                "a CUDA kernel was requested but this machine cannot run CUDA: loading TVM's "
                f"CUDA runtime failed ({err}). Is an NVIDIA driver installed?") from None
        _cuda_runtime_loaded = True


def load_module(path: str, needs_cuda: bool):
    """Load a built kernel module (``.so``) with the TVM runtime.

    Parameters
    ----------
    path : str
        Module file written by :mod:`kvtvm.compiler`.
    needs_cuda : bool
        The module holds CUDA kernels; the CUDA runtime is loaded first.
    """
    if needs_cuda:
        ensure_cuda_runtime()
    return tvm_runtime().load_module(path)
