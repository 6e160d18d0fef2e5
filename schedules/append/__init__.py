"""Schedules of the append family (``kvtvm.kernels.append``): ``cpu`` (llvm) and ``cuda``."""
