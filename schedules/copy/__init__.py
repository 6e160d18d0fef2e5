"""Schedules of the copy family (``kvtvm.kernels.copy``): ``cpu`` (llvm) and ``cuda``."""
