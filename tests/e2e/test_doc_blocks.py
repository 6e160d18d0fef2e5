"""Every ```python block of README.md and docs/*.md runs as written.

A block that continues a story (``prefill_mgr`` exported earlier, a ``model`` loaded earlier)
gets the names it assumes from a small prelude; then its results are checked against what the
block says it does. Blocks listed in ``SKIPPED`` do not run here, each with its reason; a new
block that is neither run nor skipped fails ``test_every_block_is_run_or_skipped``.
"""

import logging
import re
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def _blocks(name):
    return re.findall(r"```python\n(.*?)```", (ROOT / name).read_text(), re.S)


def _block(name, first_line):
    """The one block of ``name`` whose first line starts with ``first_line``."""
    (block,) = [b for b in _blocks(name) if b.lstrip().startswith(first_line)]
    return block


def _run(name, first_line, namespace):
    exec(compile(_block(name, first_line), name, "exec"), namespace)
    return namespace


#: (file, first line of the block): where it runs
RUN_HERE = {
    ("README.md", "import torch"): "tests/e2e/test_readme.py (quickstart)",
    ("docs/managers.md", "import torch"): "tests/e2e/test_readme.py (manager tour)",
    ("docs/managers.md", "from kvtvm.manager import ContinuousBatchingKVCacheManager"):
        "tests/e2e/test_readme.py (manager tour)",
    ("docs/managers.md", "from kvtvm.manager import TokenBatch"):
        "tests/e2e/test_readme.py (manager tour)",
    ("docs/managers.md", "from kvtvm.manager import LinearKVCache"):
        "tests/e2e/test_readme.py (manager tour)",
    ("docs/managers.md", "ex = prefill_mgr.export_pages"): "test_export_import_block",
    ("docs/managers.md", "from kvtvm.engine import Engine"): "test_engine_and_hf_blocks",
    ("docs/managers.md", "from kvtvm.integrations.hf import"): "test_engine_and_hf_blocks",
    ("docs/kernels.md", "ops.append_kv("): "test_ops_block",
    ("docs/design.md", "import logging"): "test_logging_block",
}
#: blocks that do not run here, with the reason (none at present)
SKIPPED: dict = {}


def test_every_block_is_run_or_skipped():
    found = set()
    for name in ["README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))]:
        for block in _blocks(name):
            line = block.lstrip().splitlines()[0]
            keys = [k for k in (*RUN_HERE, *SKIPPED) if k[0] == name and line.startswith(k[1])]
            assert keys, f"{name}: block starting {line!r} is neither run nor skipped"
            found.update(keys)
    assert found == set(RUN_HERE) | set(SKIPPED)  # no stale entry


def _paged(num_layers=2):
    from kvtvm import KVCacheParams
    from kvtvm.manager import PagedKVCacheManager

    params = KVCacheParams("float32", n_kv_heads=2, head_dim=64, cache_strategy="paged",
                           page_size=16, enable_prefix_caching=True)
    return PagedKVCacheManager(params, max_batch_size=4, max_seq_len=256,
                               num_layers=num_layers)


def _filled(mgr, tokens, gen):
    """A sequence of ``mgr`` holding ``tokens`` with random K/V in every layer."""
    from kvtvm import ops
    from kvtvm.manager import BatchItem

    (seq,) = mgr.claim(1)
    (inp,) = mgr.fetch([BatchItem(seq, tokens)])
    for layer in range(mgr.num_layers):
        k, v = (torch.randn(len(tokens), 2, 64, generator=gen) for _ in range(2))
        ops.append_kv(inp.k_cache(layer), inp.v_cache(layer), k, v, inp.qo_indptr,
                      inp.cache_lengths, inp.lookup_table)
    mgr.step([BatchItem(seq, tokens)])
    return seq


def test_export_import_block():
    gen = torch.Generator().manual_seed(7)
    prefill_mgr, decode_mgr = _paged(), _paged()
    seq_id = _filled(prefill_mgr, list(range(100, 140)), gen)
    ns = _run("docs/managers.md", "ex = prefill_mgr.export_pages",
              dict(prefill_mgr=prefill_mgr, decode_mgr=decode_mgr, seq_id=seq_id))
    t = ns["t"]
    assert decode_mgr.cache_length(t) == 40        # continues at the exported length
    assert prefill_mgr.end_lease(ns["ex"].lease_id) is False   # the block ended it once
    assert ns["sent"] == 1   # send_sequence: the full pages were there, the partial one not
    sent, got = prefill_mgr.export_pages(seq_id), decode_mgr.export_pages(t)
    assert torch.equal(sent.data, got.data) and sent.data.abs().sum() > 0
    assert list(got.header.tokens) == list(range(100, 140))


def test_ops_block():
    """kernels.md's four calls, on a paged cache holding two sequences (cached 5 and 3
    tokens) that add one token each; prefill's output checked against attention by hand."""
    from kvtvm import ops
    from kvtvm.manager import BatchItem

    gen = torch.Generator().manual_seed(11)
    mgr = _paged(num_layers=1)
    prompts = ([1, 2, 3, 4, 5], [6, 7, 8])
    seqs = [_filled(mgr, p, gen) for p in prompts]
    items = [BatchItem(s, [9]) for s in seqs]
    (inp,) = mgr.fetch(items)
    k_cache, v_cache = inp.k_cache(0), inp.v_cache(0)
    q = torch.randn(2, 8, 64, generator=gen)
    k, v = torch.randn(2, 2, 64, generator=gen), torch.randn(2, 2, 64, generator=gen)
    blocks = inp.blocks
    src_pages = torch.tensor([int(inp.lookup_table[0, 0])], dtype=torch.int32)
    dst_pages = torch.tensor([blocks.shape[0] - 1], dtype=torch.int32)
    ns = _run("docs/kernels.md", "ops.append_kv(", dict(
        ops=ops, k_cache=k_cache, v_cache=v_cache, k=k, v=v, q=q, qo_indptr=inp.qo_indptr,
        cache_lengths=inp.cache_lengths, lookup_table=inp.lookup_table, blocks=blocks,
        src_pages=src_pages, dst_pages=dst_pages))
    page = 16
    for b, n in enumerate(len(p) + 1 for p in prompts):   # each row attends over n tokens
        pages = inp.lookup_table[b, : (n + page - 1) // page].long()
        kk = k_cache[pages].reshape(-1, 2, 64)[:n].double().repeat_interleave(4, 1)
        vv = v_cache[pages].reshape(-1, 2, 64)[:n].double().repeat_interleave(4, 1)
        assert torch.equal(kk[-1, ::4].float(), k[b])     # the step's row was appended
        scores = torch.einsum("hd,thd->ht", q[b].double(), kk) / 64 ** 0.5
        want = torch.einsum("ht,thd->hd", scores.softmax(-1), vv)
        torch.testing.assert_close(ns["out"][b].double(), want, rtol=1e-4, atol=1e-4)
    assert torch.equal(blocks[dst_pages[0]], blocks[src_pages[0]])   # the page was copied
    mgr.step(items)


def test_logging_block():
    logger = logging.getLogger("kvtvm")
    root_handlers, level = list(logging.getLogger().handlers), logger.level
    try:
        _run("docs/design.md", "import logging", {})
        assert logger.getEffectiveLevel() == logging.INFO
        assert logging.getLogger().handlers   # basicConfig gave the root logger a handler
    finally:
        logging.getLogger().handlers[:] = root_handlers
        logger.setLevel(level)


@pytest.mark.slow
def test_engine_and_hf_blocks():
    """The engine block (SmolLM2, a chat turn) and the transformers blocks: plain generate on
    a left-padded batch and generate_batch give the same greedy tokens."""
    pytest.importorskip("transformers")
    from transformers import GenerationConfig

    ns = _run("docs/managers.md", "from kvtvm.engine import Engine", {})
    req = ns["req"]
    assert req.status == "done" and 0 < len(req.output) <= 32 and req.ttft > 0
    prompts = ["The capital of France is", "Two plus two is"]
    gen = GenerationConfig(max_new_tokens=32, do_sample=False)
    hf = _run("docs/managers.md", "from kvtvm.integrations.hf import",
              dict(model=ns["model"], tokenizer=ns["tok"], prompts=prompts, gen=gen))
    width = hf["batch"]["input_ids"].shape[1]
    outs = sorted(hf["outs"].items())
    assert len(outs) == 2
    for row, (_, out) in enumerate(outs):
        plain = hf["out"][row, width:].tolist()
        n = min(8, len(out.generated_tokens))
        assert n > 0 and plain[:n] == list(out.generated_tokens[:n]), row
