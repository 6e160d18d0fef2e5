"""The README's manager tour runs as written."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

README = Path(__file__).resolve().parents[2] / "README.md"


def test_manager_tour_runs():
    text = README.read_text()
    section = text[text.index("## The managers"):text.index("## Kernels and ops")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 4
    namespace: dict = {}
    exec(compile("\n".join(blocks), str(README), "exec"), namespace)
    assert tuple(namespace["out"].shape) == (40, 8, 64)  # paged prefill output
    assert namespace["lin"].active_batch_size == 2
    assert namespace["lin"].kv_cache_lengths.tolist() == [5, 2]
    assert namespace["arrays_in"].qo_indptr.tolist() == [0, 3, 4]
    assert namespace["decode"].counts.tolist() == [1, 1]
