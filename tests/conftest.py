"""Shared test set-up: kernels built during tests go to a cache inside the repository unless
KVTVM_CACHE_DIR says otherwise, so repeated runs reuse them."""

import os
from pathlib import Path

os.environ.setdefault("KVTVM_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".kvtvm-cache"))
