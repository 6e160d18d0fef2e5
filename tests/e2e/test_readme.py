"""The documentation runs as written: the README's quickstart (checked against attention
computed by hand), the managers tour of docs/managers.md, and every relative link of the
README and docs/ leads to a file (and heading) that exists."""

import re
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def _python_blocks(text):
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_quickstart_runs_and_attends_over_every_appended_token(monkeypatch):
    text = README.read_text()
    section = text[text.index("## Quickstart"):text.index("## What works")]
    (block,) = _python_blocks(section)
    assert len(block.strip().splitlines()) <= 25
    drawn = []  # every torch.randn the quickstart makes: q, k, v of the prompt, then the step's
    real_randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, **kw: drawn.append(real_randn(*a, **kw))
                        or drawn[-1])
    namespace: dict = {}
    exec(compile(block, str(README), "exec"), namespace)
    assert len(drawn) == 6
    q = drawn[3].double()                                      # the decode step's query [1, 8, 64]
    k = torch.cat([drawn[1], drawn[4]]).double()               # all 6 tokens' K [6, 2, 64]
    v = torch.cat([drawn[2], drawn[5]]).double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)   # [6, 8, 64]
    scores = torch.einsum("hd,thd->ht", q[0], k) / 64 ** 0.5
    want = torch.einsum("ht,thd->hd", scores.softmax(-1), v)
    out = namespace["out"]
    assert tuple(out.shape) == (1, 8, 64)
    torch.testing.assert_close(out[0].double(), want, rtol=1e-4, atol=1e-4)
    mgr = namespace["mgr"]
    assert not mgr.contains(namespace["seq"])  # released at the end
    assert len(mgr.slots_remaining) == 4  # every slot free again


def test_manager_tour_runs():
    text = (ROOT / "docs" / "managers.md").read_text()
    section = text[text.index("## The three managers"):text.index("## Rules every manager keeps")]
    blocks = _python_blocks(section)
    assert len(blocks) == 4
    namespace: dict = {}
    exec(compile("\n".join(blocks), "docs/managers.md", "exec"), namespace)
    assert tuple(namespace["out"].shape) == (40, 8, 64)  # paged prefill output
    assert namespace["lin"].active_batch_size == 2
    assert namespace["lin"].kv_cache_lengths.tolist() == [5, 2]
    assert namespace["arrays_in"].qo_indptr.tolist() == [0, 3, 4]
    assert namespace["decode"].counts.tolist() == [1, 1]


def _anchors(path):
    """GitHub's anchors of a Markdown file's headings."""
    anchors = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return anchors


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{doc.name}: broken links {broken}"


def test_docs_hold_the_old_readme_sections():
    """The README's former sections live on in docs/ (moved, not dropped)."""
    docs = "\n".join(p.read_text() for p in DOCS)
    for heading in ("## The three managers", "## Rules every manager keeps",
                    "## Serving a model (kvtvm.engine)", "## The ops",
                    "## Ahead-of-time builds and runtime-only deployment",
                    "## Graph integration (TVM Relax)", "## Tuning a kernel",
                    "## Running them", "## Layout of the repository",
                    "## What works, and how fast (the full table)"):
        assert heading in docs, heading
