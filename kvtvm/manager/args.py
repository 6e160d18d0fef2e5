"""Argument checks every manager shares: positive ints and the device list."""

from __future__ import annotations

import numpy as np

from ..errors import DeviceUnavailableError, InvalidArgumentError, describe

__all__ = ["check_positive_int", "parse_devices"]


def check_positive_int(name: str, value, allow_zero: bool = False) -> int:
    """``value`` as an int, or :class:`InvalidArgumentError` naming ``name``."""
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if not ok or value < (0 if allow_zero else 1):
        raise InvalidArgumentError(describe(
            name, "a non-negative int" if allow_zero else "a positive int", repr(value)))
    return int(value)


def parse_devices(devices) -> tuple:
    """``devices`` (strings like ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or torch devices) as a
    tuple of ``torch.device``."""
    import torch

    if isinstance(devices, (str, torch.device)):
        devices = (devices,)
    try:
        parsed = tuple(torch.device(d) for d in devices)
    except (TypeError, RuntimeError) as err:
        raise InvalidArgumentError(describe("devices", "device names like 'cpu' or 'cuda:0'",
                                            repr(devices))) from err
    if not parsed:
        raise InvalidArgumentError(describe("devices", "at least one device", repr(devices)))
    for d in parsed:
        if d.type not in ("cpu", "cuda"):
            raise InvalidArgumentError(describe("devices", "cpu or cuda devices", str(d)))
        if d.type == "cuda" and not torch.cuda.is_available():
            raise DeviceUnavailableError(
                f"devices: {d} was asked for but CUDA is not available on this machine")
    return parsed
