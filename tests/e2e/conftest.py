"""Fixtures shared by the engine's end-to-end tests."""

import pytest

from kvtvm.engine import build_toy_model


@pytest.fixture(scope="module")
def toy():
    """A random 2-layer toy Llama (one per test module)."""
    return build_toy_model(num_layers=2)
