"""Schedules of the prefill family (``kvtvm.kernels.prefill``): ``cpu`` (llvm) and ``cuda``."""
