"""The one place the engine sets torch's and kvtvm's CPU thread counts.

torch runs the model's linear layers on its intra-op thread pool; kvtvm's CPU kernels run on
TVM's thread pool (:func:`kvtvm.runtime.set_num_threads`). Both pools spin-wait for work after a
task, so on a machine with few cores two big pools steal each other's cores between every layer:
measured on this project's 2-core machine, SmolLM2 served 2.8x slower with torch on 2 threads
than on 1 (docs/PERF.md). The engine therefore runs torch on one thread by default and leaves
kvtvm's kernels at :func:`kvtvm.runtime.cpu_threads` (``KVTVM_NUM_THREADS``, else the physical
cores). Pass other counts to :class:`kvtvm.engine.Engine` (``torch_threads``,
``kernel_threads``), or None to leave a pool as the caller set it.
"""

from __future__ import annotations

import torch

from .. import runtime
from ..errors import InvalidArgumentError, describe

__all__ = ["configure_threads", "check_thread_count", "DEFAULT_TORCH_THREADS"]

#: torch intra-op threads the engine uses unless told otherwise.
DEFAULT_TORCH_THREADS = 1


def check_thread_count(name: str, n) -> None:
    """Raise :class:`~kvtvm.errors.InvalidArgumentError` naming ``name`` unless ``n`` is None
    or an int in ``[1, kvtvm.runtime.MAX_THREADS]``."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int)
                          or not 1 <= n <= runtime.MAX_THREADS):
        raise InvalidArgumentError(describe(name, f"None or an int in [1, "
                                            f"{runtime.MAX_THREADS}]", repr(n)))


def configure_threads(torch_threads: int | None = DEFAULT_TORCH_THREADS,
                      kernel_threads: int | None = None) -> tuple[int, int]:
    """Set torch's intra-op threads and kvtvm's kernel threads.

    Parameters
    ----------
    torch_threads : int or None
        ``torch.set_num_threads`` value; None leaves torch as it is.
    kernel_threads : int or None
        :func:`kvtvm.runtime.set_num_threads` value; None leaves kvtvm's setting (by default
        ``KVTVM_NUM_THREADS`` or the physical cores).

    Returns
    -------
    (int, int)
        The torch and kernel thread counts now in effect.
    """
    check_thread_count("torch_threads", torch_threads)
    check_thread_count("kernel_threads", kernel_threads)
    if torch_threads is not None and torch.get_num_threads() != torch_threads:
        torch.set_num_threads(torch_threads)
    if kernel_threads is not None:
        runtime.set_num_threads(kernel_threads)
    return torch.get_num_threads(), runtime.cpu_threads()
