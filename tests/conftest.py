"""Shared test set-up.

- Kernels built during tests go to a cache inside the repository (``.kvtvm-cache``) unless
  KVTVM_CACHE_DIR says otherwise, so repeated runs reuse them.
- tests/ is on ``sys.path``, so tests in every folder (manager/, ops/, kernels/, compiler/,
  integrations/, e2e/) import the shared helpers as ``from helpers import ...``.
- The markers ``gpu``, ``slow`` and ``e2e`` are registered in pytest.ini (``--strict-markers``).
"""

import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

os.environ.setdefault("KVTVM_CACHE_DIR", str(TESTS.parent / ".kvtvm-cache"))
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
