"""Shared test set-up: kernels built during tests go to a cache inside the repository unless
KVTVM_CACHE_DIR says otherwise, so repeated runs reuse them."""

import os
from pathlib import Path

os.environ.setdefault("KVTVM_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".kvtvm-cache"))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: runs only with a CUDA GPU (tools/gpu-check.sh runs these on a GPU "
        "machine with the TVM runtime alone)")
