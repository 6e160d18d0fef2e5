"""Whether a benchmark case's tensors fit in memory, asked before they are built: a size the
machine cannot hold is a usage error naming the options (exit 2), not an allocator traceback
after minutes of work."""

from __future__ import annotations

import os


def free_bytes(device: str) -> int | None:
    """Bytes that can be allocated on ``device`` now (host: ``MemAvailable``; CUDA: the
    driver's free memory); None where it cannot be told."""
    if device.startswith("cuda"):
        try:
            import torch

            return int(torch.cuda.mem_get_info(torch.device(device))[0])
        except Exception:  # no driver, a bad device string: the run itself will say
            return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(parser, case: str, nbytes: int, device: str, options: str) -> None:
    """``parser.error`` (exit 2) when case ``case`` needs about ``nbytes`` bytes, more than
    the host (where the cases are built) or ``device`` has free; ``options``: the command-line
    options that size it."""
    for where in dict.fromkeys(("cpu", device)):
        free = free_bytes(where)
        if free is not None and nbytes > free:
            parser.error(f"case {case}: its tensors need about {nbytes / 2**30:.3g} GiB, more "
                         f"than the {free / 2**30:.3g} GiB free on {where}: choose smaller "
                         f"{options}")
