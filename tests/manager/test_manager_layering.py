"""Managers sit low: they import no kernels and no TVM, and what they need from above (the
page / slot copier, the graph typing of their inputs) is handed in.

An injected fake copier records the copies of fork's copy-on-write and of LinearKVCache.evict
(and does them with torch, so the cache contents are checked too); managers built without one
use kvtvm's registered default, the copy kernel; an ast walk over kvtvm/manager/*.py finds no
import of kvtvm.ops, the compiler, the kernels, the integrations or TVM.
"""

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

import kvtvm
from kvtvm import KVCacheParams
from kvtvm.errors import InvalidArgumentError
from kvtvm.manager import BatchItem, LinearKVCache, PagedKVCacheManager, copier, symbols
from kvtvm.manager.symbols import TensorSymbol

MANAGER_DIR = Path(kvtvm.__file__).resolve().parent / "manager"
H, D, L, P = 2, 4, 2, 4


class RecordingCopier:
    """A copier that records its calls and copies rows of ``axis`` with torch, in order."""

    def __init__(self, axis):
        self.axis, self.calls = axis, []

    def __call__(self, blocks, src, dst):
        assert src.dtype == torch.int32 and dst.dtype == torch.int32
        assert src.device.type == "cpu" and src.shape == dst.shape
        self.calls.append((blocks.data_ptr(), src.tolist(), dst.tolist()))
        for s, d in zip(src.tolist(), dst.tolist()):
            blocks.select(self.axis, d).copy_(blocks.select(self.axis, s))


def _imports(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (lazy imports inside functions too)."""
    pkg = "kvtvm.manager"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            out.update(a.value for a in node.args if isinstance(a, ast.Constant))
    return out


def test_manager_modules_import_no_ops_no_tvm_nothing_above():
    files = sorted(MANAGER_DIR.glob("*.py"))
    assert {f.name for f in files} >= {"base.py", "paged.py", "linear.py", "copier.py",
                                       "symbols.py", "tables.py"}
    allowed_kvtvm = ("kvtvm.manager", "kvtvm.params", "kvtvm.inputs", "kvtvm.errors",
                     "kvtvm.collection")
    for f in files:
        names = _imports(f)
        for name in names:
            assert name != "tvm" and not name.startswith("tvm."), (f.name, name)
            if name == "kvtvm" or name.startswith("kvtvm."):
                assert name.startswith(allowed_kvtvm), (f.name, name)
        assert not any(n.startswith(("kvtvm.ops", "kvtvm.compiler", "kvtvm.kernels",
                                     "kvtvm.integrations", "kvtvm.relax")) for n in names)


def test_import_path_checker_sees_lazy_and_relative_imports(tmp_path):
    """The walker above resolves relative and in-function imports (it could miss nothing)."""
    f = tmp_path / "m.py"
    f.write_text("from ..ops import copy_pages\n"
                 "def g():\n    from tvm import relax\n    import kvtvm.compiler\n")
    assert {"kvtvm.ops", "tvm", "kvtvm.compiler"} <= _imports(f)


def _paged(copier_=None, n_pages=16):
    params = KVCacheParams("float32", H, D, "paged", page_size=P)
    return PagedKVCacheManager(params, 4, 32, L, num_pages=n_pages, page_copier=copier_)


def test_paged_fork_copy_on_write_goes_through_the_injected_copier():
    rec = RecordingCopier(axis=0)
    mgr = _paged(rec)
    assert mgr.page_copier is rec
    (a,) = mgr.claim(1)
    toks = list(range(6))  # one full page + a partial one
    mgr.fetch([BatchItem(a, toks)])
    mgr.step([BatchItem(a, toks)])
    blocks = mgr.blocks[0]
    blocks.copy_(torch.randn(blocks.shape))
    tail = mgr.pages_of(a)[1]
    want_tail = blocks[tail].clone()
    b = mgr.fork(a)
    assert rec.calls == []           # fork shares; nothing copied yet
    mgr.fetch([BatchItem(b, [9])])   # first write into the shared partial page: copy it
    ((ptr, src, dst),) = rec.calls
    assert ptr == blocks.data_ptr() and src == [tail] and dst == [mgr.pages_of(b)[1]]
    assert dst[0] != tail and mgr.pages_of(b)[0] == mgr.pages_of(a)[0]
    assert torch.equal(blocks[dst[0]], want_tail)
    mgr.step([BatchItem(b, [9])])
    mgr.fetch([BatchItem(a, [7])])   # the parent's page is its own again: no copy
    assert len(rec.calls) == 1
    mgr.check_invariants()


def test_a_failing_copier_leaves_the_manager_as_it_was():
    def broken(blocks, src, dst):
        raise RuntimeError("copier failed")

    mgr = _paged(broken)
    (a,) = mgr.claim(1)
    mgr.fetch([BatchItem(a, [1, 2, 3])])
    mgr.step([BatchItem(a, [1, 2, 3])])
    b = mgr.fork(a)
    before = (mgr.pages_of(a), mgr.pages_of(b), mgr.stats())
    with pytest.raises(RuntimeError, match="copier failed"):
        mgr.fetch([BatchItem(b, [4])])
    assert (mgr.pages_of(a), mgr.pages_of(b), mgr.stats()) == before
    mgr.check_invariants()


def test_linear_evict_goes_through_the_injected_copier():
    rec = RecordingCopier(axis=1)
    params = KVCacheParams("float32", H, D, "linear")
    cache = LinearKVCache(params, 4, 8, L, slot_copier=rec)
    assert cache.slot_copier is rec
    cache.reset_for_new_sequences([1, 2, 3, 4])
    buf = cache.get_kv_cache_buffer()
    buf.copy_(torch.randn(buf.shape))
    want = buf[:, [1, 3]].clone()
    cache.evict([3, 1])
    ((ptr, src, dst),) = rec.calls
    assert ptr == buf.data_ptr() and (src, dst) == ([1, 3], [0, 1])
    assert torch.equal(buf[:, :2], want)
    assert cache.host_lengths.tolist() == [2, 4]
    cache.evict([0, 1])              # nothing moves: the copier is not called
    assert len(rec.calls) == 1


def test_default_copiers_are_the_kernels_registered_by_kvtvm():
    from kvtvm import ops

    assert copier.default_page_copier() is kvtvm._copy_pages
    assert copier.default_slot_copier() is kvtvm._copy_slots
    mgr = _paged()
    assert mgr.page_copier is kvtvm._copy_pages
    blocks = torch.randn(5, 2, L, P, H, D)
    want = blocks.clone()
    want[3] = want[1]
    want[4] = want[3]
    src, dst = torch.tensor([1, 3], dtype=torch.int32), torch.tensor([3, 4], dtype=torch.int32)
    mgr.page_copier(blocks, src, dst)   # sequential, as ops.copy_pages
    assert torch.equal(blocks, want)
    ops.copy_pages(want, src, dst)
    assert torch.equal(blocks, want)


def test_a_copier_must_be_callable():
    with pytest.raises(InvalidArgumentError, match="page_copier"):
        _paged("not a copier")
    params = KVCacheParams("float32", H, D, "linear")
    with pytest.raises(InvalidArgumentError, match="slot_copier"):
        LinearKVCache(params, 2, 8, L, slot_copier=3)
    with pytest.raises(InvalidArgumentError):
        copier.set_default_copiers(page=42)
    assert copier.default_page_copier() is kvtvm._copy_pages


def test_input_specs_are_plain_data_and_input_symbols_use_the_registered_builder(
        monkeypatch):
    mgr = _paged()
    (spec,) = mgr.input_specs()
    assert spec.blocks == TensorSymbol((16, 2, L, P, H, D), "float32")
    assert spec.cache_lengths == TensorSymbol(("batch",), "int32")
    assert spec.lookup_table == TensorSymbol(("batch", 8), "int32")
    assert spec.max_lengths == TensorSymbol(("num_steps", 2), "int32")
    seen = []
    monkeypatch.setattr(symbols, "_builder", lambda specs: seen.append(specs) or "typed")
    assert mgr.input_symbols() == "typed"
    assert seen == [mgr.input_specs()]


def test_per_step_tables_module_sizes_match_the_manager():
    from kvtvm.manager.tables import StepTables, table_elems

    mgr = _paged()
    assert isinstance(mgr._tables, StepTables)
    assert mgr._tables.device_nbytes() == 4 * table_elems(4, 8)
    assert np.shares_memory(mgr._tables.lookup, mgr._tables.host_np)
