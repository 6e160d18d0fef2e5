"""The TVM runtime side of kvtvm: load built kernel modules and call them.

Everything here works with the TVM runtime alone (``TVM_USE_RUNTIME_LIB=1`` and no
``libtvm_compiler.so``): it never imports TVM's compiler, never calls NVRTC or nvcc. CUDA
kernels are loaded from binaries (fatbin) embedded in the module at build time.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading

from .errors import DeviceUnavailableError, InvalidArgumentError, describe

_lock = threading.Lock()
_cuda_runtime_loaded = False


@functools.lru_cache(maxsize=None)
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


#: The one knob for the CPU threads kvtvm's kernels use (see :func:`set_num_threads`).
NUM_THREADS_ENV = "KVTVM_NUM_THREADS"

_num_threads: int | None = None      # set_num_threads(); None: decided at first use
_thread_state = threading.local()    # .configured: the thread count this thread's pool has


def cpu_threads() -> int:
    """Threads TVM's thread pool runs kvtvm's CPU kernels on.

    In order: :func:`set_num_threads`, ``KVTVM_NUM_THREADS``, TVM's own ``TVM_NUM_THREADS``,
    else the physical cores this process may run on. (TVM's default is half the logical
    CPUs on x86 -- a guess that hyper-threads come in pairs; on machines without them, most
    VMs, it leaves half the cores idle.)
    """
    if _num_threads is not None:
        return _num_threads
    for name in (NUM_THREADS_ENV, "TVM_NUM_THREADS"):
        try:
            return max(1, int(os.environ[name]))
        except (KeyError, ValueError):
            pass
    return physical_cores()


def set_num_threads(n: int | None) -> None:
    """Run kvtvm's CPU kernels on ``n`` threads from now on (None: back to the default of
    :func:`cpu_threads`). Takes effect in each thread at its next kernel call.

    torch's intra-op threads and TVM's pool share the same cores: an engine that runs torch
    between kernel calls usually wants ``torch.set_num_threads`` and this to agree.
    """
    global _num_threads
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise InvalidArgumentError(describe("n", "None or an int >= 1", repr(n)))
    _num_threads = n


def configure_cpu_threads() -> None:
    """Size the calling thread's TVM thread pool to :func:`cpu_threads` (TVM keeps one pool
    per calling thread): done at a thread's first CPU kernel call and again after
    :func:`set_num_threads` changes the count; otherwise a thread-local lookup."""
    n = cpu_threads()
    if getattr(_thread_state, "configured", None) == n:
        return
    cpus = (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else list(range(os.cpu_count() or 1)))
    import tvm_ffi

    # mode -3 (kSpecifyThreadShareAllCore): n workers, each free to run on every allowed CPU;
    # TVM caps the pool at the length of the CPU list, so it is repeated when n exceeds it
    cpu_list = [str(cpus[i % len(cpus)]) for i in range(max(n, len(cpus)))]
    tvm_ffi.get_global_func("runtime.config_threadpool")(-3, n, cpu_list)
    _thread_state.configured = n


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
