"""Schedules of the decode family (``kvtvm.kernels.decode``): ``cpu`` (llvm) and ``cuda``."""
