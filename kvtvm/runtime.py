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
#: Most threads :func:`set_num_threads` takes: TVM starts every worker of its pool at once and
#: they spin-wait between kernels, so a count far past the cores only stalls (100000 threads
#: hung ``python -m kvtvm generate`` for minutes on this project's 2-core machine).
MAX_THREADS = 1024

_num_threads: int | None = None      # set_num_threads(); None: decided at first use
_thread_state = threading.local()    # .configured: the thread count this thread's pool has


def cpu_threads() -> int:
    """Threads TVM's thread pool runs kvtvm's CPU kernels on.

    In order: :func:`set_num_threads`, ``KVTVM_NUM_THREADS``, TVM's own ``TVM_NUM_THREADS``,
    else the physical cores this process may run on. ``KVTVM_NUM_THREADS`` outside
    ``[1, MAX_THREADS]`` (or not an int) is an :class:`~kvtvm.errors.InvalidArgumentError`
    naming it, never clamped, ignored or taken as is (100000 threads hang). (TVM's default is
    half the logical CPUs on x86 -- a guess that hyper-threads come in pairs; on machines
    without them, most VMs, it leaves half the cores idle.)
    """
    if _num_threads is not None:
        return _num_threads
    text = os.environ.get(NUM_THREADS_ENV, "").strip()
    if text:  # the same range as set_num_threads: never a silent clamp or a runaway pool
        try:
            n = int(text)
        except ValueError:
            n = 0
        if not 1 <= n <= MAX_THREADS:
            raise InvalidArgumentError(describe(
                NUM_THREADS_ENV, f"an int in [1, {MAX_THREADS}] (environment variable)",
                repr(os.environ[NUM_THREADS_ENV])))
        return n
    try:
        return max(1, int(os.environ["TVM_NUM_THREADS"]))
    except (KeyError, ValueError):
        pass
    return physical_cores()


def set_num_threads(n: int | None) -> None:
    """Run kvtvm's CPU kernels on ``n`` threads (at most :data:`MAX_THREADS`) from now on
    (None: back to the default of :func:`cpu_threads`). Takes effect in each thread at its
    next kernel call.

    torch's intra-op threads and TVM's pool share the same cores: an engine that runs torch
    between kernel calls usually wants ``torch.set_num_threads`` and this to agree.
    """
    global _num_threads
    if n is not None and (isinstance(n, bool) or not isinstance(n, int)
                          or not 1 <= n <= MAX_THREADS):
        raise InvalidArgumentError(describe("n", f"None or an int in [1, {MAX_THREADS}]",
                                            repr(n)))
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
    if n > len(cpus) and not _warned_oversubscribed:
        _warn_oversubscribed(n, len(cpus))
    tvm_ffi.get_global_func("runtime.config_threadpool")(-3, n, cpu_list)
    _thread_state.configured = n


_warned_oversubscribed = False


def _warn_oversubscribed(n: int, cpus: int) -> None:
    """Say once that ``n`` kernel threads exceed the ``cpus`` this process may run on: TVM's
    workers spin waiting for work, so extra ones slow the kernels, and the exit (64 threads
    on 2 CPUs: 22 s of teardown after the answer)."""
    global _warned_oversubscribed
    _warned_oversubscribed = True
    import logging

    logging.getLogger("kvtvm.runtime").warning(
        "%d kernel threads on %d CPUs: TVM's workers spin, so threads past the CPUs slow the "
        "kernels (and the exit); KVTVM_NUM_THREADS / kernel_threads of at most %d is faster",
        n, cpus, cpus)


class _CpuExecutor:
    """One long-lived thread that runs the *parallel* CPU kernels of threads without a pool
    of their own.

    TVM keeps one worker pool per calling thread and never frees it when that thread ends:
    short-lived threads calling parallel kernels would each leave ``n - 1`` spinning workers
    behind. Their calls are handed to this thread instead (one pool for all of them); serial
    kernels, the main thread and threads that opted in with :func:`use_own_pool` call inline.
    """

    def __init__(self):
        import queue

        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="kvtvm-cpu-kernels",
                                        daemon=True)
        self._thread.start()

    def _loop(self):
        while True:
            fn, args, box, done = self._queue.get()
            try:
                configure_cpu_threads()
                fn(*args)
            except BaseException as err:  # handed back to the caller
                box.append(err)
            done.set()

    def call(self, fn, args) -> None:
        box: list = []
        done = threading.Event()
        self._queue.put((fn, args, box, done))
        done.wait()
        if box:
            raise box[0]


_executor: _CpuExecutor | None = None


def use_own_pool(flag: bool = True) -> None:
    """Let the calling thread run parallel CPU kernels inline, on a TVM pool of its own (full
    speed, no hand-off), instead of on kvtvm's shared kernel thread. For long-lived threads
    (an engine's worker); TVM keeps that pool until the process exits. The main thread always
    has its own."""
    _thread_state.own_pool = bool(flag)


_threads_checked = False


def _check_threads_once() -> None:
    global _threads_checked
    cpu_threads()  # InvalidArgumentError naming KVTVM_NUM_THREADS
    _threads_checked = True


def call_cpu_kernel(fn, args, parallel: bool = True) -> None:
    """Call a CPU kernel: inline when it is serial or the calling thread owns a pool (the
    main thread, :func:`use_own_pool`), else on kvtvm's one shared kernel thread -- so threads
    that come and go leave no TVM workers behind."""
    if not parallel:
        if not _threads_checked:  # a bad KVTVM_NUM_THREADS is refused on serial calls too
            _check_threads_once()  # (it went unnoticed until a parallel one)
        fn(*args)
        return
    if (getattr(_thread_state, "own_pool", False)
            or threading.current_thread() is threading.main_thread()) \
            and not getattr(_thread_state, "pool_lost", False):
        configure_cpu_threads()
        fn(*args)
        return
    global _executor
    if _executor is None:
        with _lock:
            if _executor is None:
                _executor = _CpuExecutor()
    _executor.call(fn, args)


def _after_fork_in_child() -> None:
    """In a process forked from one that ran parallel kernels: TVM's workers of the forking
    thread's pool, and kvtvm's shared kernel thread, are the parent's -- a kernel waiting on
    them hung for good. That thread's parallel kernels go to a fresh kernel thread (with a
    fresh pool) instead; the locks held by threads that did not come along are new."""
    global _executor, _lock
    _executor = None
    _lock = threading.Lock()
    if getattr(_thread_state, "configured", None) is not None:
        _thread_state.pool_lost = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


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
