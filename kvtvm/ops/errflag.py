"""The error flags of kernel launches: who owns them, when they are read, what they raise.

Every kernel takes an int32 ``[ERR_SLOTS]`` flag as its last argument and sets an entry when it
skips an out-of-range index (:mod:`kvtvm.kernels.errflag`). Here:

- CPU: each thread preparing launches has one flag (thread-local: it goes with its thread);
  ``run()`` reads it right after the call (a 16-byte compare) and raises
  :class:`~kvtvm.errors.KernelIndexError`, after zeroing it, when an entry is set. (A launch
  prepared in one thread and run in another while the first runs its own may report the other's
  error: the flag is per preparing thread, not per launch.)
- CUDA: one flag per device, shared by every launch on it, never read on the fast path (that
  would synchronize). :func:`check` reads it -- so does every call with
  ``check_indices=True``, which synchronizes anyway -- raises and zeroes it.
"""

from __future__ import annotations

import threading

import numpy as np

from ..errors import KernelIndexError
from ..kernels.errflag import ERR_MEANING, ERR_SLOTS

__all__ = ["new_flag", "raise_flag", "check", "ERR_SLOTS"]

_ZERO = bytes(4 * ERR_SLOTS)
_lock = threading.Lock()
_device_flags: dict = {}  # torch.device (cuda) -> int32 [ERR_SLOTS] tensor
_host = threading.local()  # .flag: (tensor, numpy view) of this thread's CPU flag


def new_flag(device):
    """The flag a launch on ``device`` writes: the calling thread's host flag on the CPU (with
    its numpy view), the device's shared flag on a GPU (view None). Returns ``(tensor, view)``."""
    import torch

    if device.type == "cpu":
        flag = getattr(_host, "flag", None)
        if flag is None:
            arr = np.zeros(ERR_SLOTS, np.int32)
            flag = _host.flag = (torch.from_numpy(arr), arr)
        return flag
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    flag = _device_flags.get(device)
    if flag is None:
        with _lock:
            flag = _device_flags.get(device)
            if flag is None:
                flag = _device_flags[device] = torch.zeros(ERR_SLOTS, dtype=torch.int32,
                                                           device=device)
    return flag, None


def is_set(view: np.ndarray) -> bool:
    """Whether a host flag has an entry set (a 16-byte compare)."""
    return view.tobytes() != _ZERO


def raise_flag(values, what: str) -> None:
    """Raise :class:`KernelIndexError` for the set entries of ``values`` (host ints)."""
    parts = [f"{arg}: {meaning}" for slot, (arg, meaning) in ERR_MEANING.items()
             if int(values[slot])]
    if not parts:
        parts = [f"unknown error flag {list(map(int, values))}"]
    raise KernelIndexError(f"{what} skipped out-of-range entries (nothing outside the tensors "
                           "was read or written; the skipped entries were not written): "
                           + "; ".join(parts))


def check_view(view: np.ndarray, what: str) -> None:
    """Raise (after zeroing the flag) when the host flag ``view`` has an entry set."""
    if view.tobytes() != _ZERO:
        values = view.copy()
        view[:] = 0
        raise_flag(values, what)


def check(device=None) -> None:
    """Report what GPU kernels skipped since the last check (synchronizes with the device).

    Parameters
    ----------
    device : torch.device or str, optional
        The GPU whose flag to read; every GPU that ran a kvtvm kernel when None. CPU launches
        report at once and have nothing pending.

    Raises
    ------
    KernelIndexError
        A kernel on the device skipped an out-of-range index since the last check (the flag
        is zeroed).
    """
    import torch

    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        devices = [device]
    else:
        devices = list(_device_flags)
    for dev in devices:
        flag = _device_flags.get(dev)
        if flag is None:
            continue
        values = flag.cpu().numpy()
        if values.tobytes() != _ZERO:
            flag.zero_()
            raise_flag(values, f"a kvtvm kernel on {dev}")
