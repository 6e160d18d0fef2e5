"""kvtvm.relax: kernels called from a Relax graph, and the Relax Llama example end to end.

Unit tests compile small Relax functions that append into strided per-layer views of one
cache tensor and run attention on the written caches, and compare with the numpy references
(``reference_append``, ``reference_prefill``, ``reference_decode``) on random inputs. The
example test serves a small random Llama through the Relax VM with a paged manager and
asserts its greedy tokens equal ``transformers``' ``generate``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

tvm = pytest.importorskip("tvm")
from tvm import relax  # noqa: E402

import kvtvm.relax as kr  # noqa: E402
from kvtvm import KVCacheParams  # noqa: E402
from kvtvm.errors import InvalidArgumentError  # noqa: E402
from kvtvm.kernels._tvm import tir  # noqa: E402
from kvtvm.kernels.reference import reference_append  # noqa: E402
from kvtvm.kernels.reference import reference_decode  # noqa: E402
from kvtvm.kernels.reference import reference_prefill  # noqa: E402
from kvtvm.manager import (BatchItem, ContinuousBatchingKVCacheManager,  # noqa: E402
                           LinearKVCache, PagedKVCacheManager)

H, G, D = 2, 3, 16          # kv heads, query heads per kv head, head dim
HQ = H * G
LAYERS = 2


def _compile(mod):
    ex = tvm.compile(mod, target=kr.llvm_target())
    return relax.VirtualMachine(ex, tvm.cpu())


def _random_batch(rng, layout, num_pages, page_size, cached, new):
    """A 6-D cache of random values (both layers), per-layer views of layer 1, random page
    tables covering cached + new tokens, random new K/V and queries."""
    batch = len(cached)
    if layout == "nhd":   # PAGED: [pages, 2, layers, page, H, D]
        cache = torch.randn(num_pages, 2, LAYERS, page_size, H, D)
        views = cache[:, 0, 1], cache[:, 1, 1]
        width = max(-(-(c + n) // page_size) for c, n in zip(cached, new)) + 1
        perm = rng.permutation(num_pages)
        table = np.zeros((batch, width), np.int32)
        cursor = 0
        for b in range(batch):
            need = -(-(cached[b] + new[b]) // page_size)
            table[b, :need] = perm[cursor:cursor + need]
            cursor += need
    else:                 # LINEAR: [layers, slots, 2, H, seq, D]; a slot is one page
        cache = torch.randn(LAYERS, num_pages, 2, H, page_size, D)
        views = cache[1, :, 0], cache[1, :, 1]
        table = rng.permutation(num_pages)[:batch].astype(np.int32).reshape(batch, 1)
    ntok = sum(new)
    return dict(cache=cache, k_cache=views[0], v_cache=views[1],
                k=torch.randn(ntok, H, D), v=torch.randn(ntok, H, D), q=torch.randn(ntok, HQ, D),
                qo_indptr=torch.tensor(np.concatenate([[0], np.cumsum(new)]), dtype=torch.int32),
                cache_lengths=torch.tensor(cached, dtype=torch.int32),
                lookup_table=torch.from_numpy(table))


def _step_module(layout, *, decode=False, cuda=False, flag=True, **attn_kwargs):
    """Relax ``main(q, k, v, k_cache, v_cache, qo_indptr, cache_lengths, lookup_table,
    error_flag)``: append, then attention on the appended caches; returns (out, lse).
    ``cuda``: the CUDA (sm_90a) kernels instead of the llvm ones; ``flag``: the kernels
    record skipped entries in ``error_flag`` (else in a scratch flag)."""
    if cuda:
        attn_kwargs.update(target="cuda", arch="sm_90a")
    target = {k: attn_kwargs[k] for k in ("target", "arch") if k in attn_kwargs}
    kv = kr.kv_input_vars(1, H, D, "float32", layout=layout)
    if flag:
        attn_kwargs["error_flag"] = target["error_flag"] = kv.error_flag
    n = tir.Var("num_tokens", "int64")
    q = relax.Var("q", relax.TensorType([n, HQ, D], "float32"))
    k = relax.Var("k", relax.TensorType([n, H, D], "float32"))
    v = relax.Var("v", relax.TensorType([n, H, D], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, v, *kv.params()], pure=False):
        kc, vc = kr.emit_append_kv(bb, kv.k_caches[0], kv.v_caches[0], k, v, kv.qo_indptr,
                                   kv.cache_lengths, kv.lookup_table, layout=layout,
                                   **target)
        if decode:
            out = kr.emit_decode_attention(bb, q, kc, vc, kv.cache_lengths, kv.lookup_table,
                                           layout=layout, return_lse=True, **attn_kwargs)
        else:
            out = kr.emit_attention(bb, q, kc, vc, kv.qo_indptr, kv.cache_lengths,
                                    kv.lookup_table, layout=layout, return_lse=True,
                                    **attn_kwargs)
        bb.emit_func_output(relax.Tuple(list(out)))
    return bb.get()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_cuda_step_module_builds_for_sm90a(decode):
    """The same step with kvtvm's CUDA kernels compiles for sm_90a: the VM's host code imports
    one CUDA module holding the append and attention kernels, and nvcc compiles it with no
    register spills. (Running it needs a GPU: owed.)"""
    from kvtvm import compiler

    mod = _step_module("nhd", decode=decode, cuda=True)
    ex = tvm.compile(mod, target=tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))

    (cuda,) = compiler._cuda_modules(ex.mod)
    source = cuda.inspect_source()
    op = "decode" if decode else "prefill"
    assert f"kvtvm_append_float32_h{H}" in source and f"kvtvm_{op}_float32_h{H}" in source
    fatbin, report = compiler.nvcc_fatbin(source, compiler.FATBIN_ARCHS["sm_90a"],
                                          Path(tempfile.mkdtemp()))
    assert compiler.fatbin_architectures(fatbin) == ["sm_80", "sm_90a"]
    spills = compiler.spill_report(report)
    assert spills and all(v["spill_stores"] == 0 for v in spills.values()), spills


def _run_step(vm, x):
    out, lse = vm["main"](x["q"], x["k"], x["v"], x["k_cache"], x["v_cache"], x["qo_indptr"],
                          x["cache_lengths"], x["lookup_table"], kr.error_flag())
    kr.check_errors()
    return torch.as_tensor(out).numpy(), torch.as_tensor(lse).numpy()


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("opts", [dict(), dict(causal=False, sm_scale=0.3),
                                  dict(sliding_window=5)], ids=["causal", "full", "window"])
def test_append_and_prefill_match_reference(layout, opts):
    rng = np.random.default_rng(hash((layout, str(opts))) % 2**32)
    page_size = 4 if layout == "nhd" else 40
    cached, new = [0, 9, 5, 13], [7, 1, 4, 3]   # a fresh prompt, a decode row, chunked rows
    x = _random_batch(rng, layout, 24 if layout == "nhd" else 6, page_size, cached, new)
    before = x["cache"].clone()
    want_k, want_v = reference_append(x["k_cache"].numpy(), x["v_cache"].numpy(), x["k"].numpy(),
                                      x["v"].numpy(), x["qo_indptr"].numpy(), cached,
                                      x["lookup_table"].numpy(), layout=layout)
    vm = _compile(_step_module(layout, **opts))
    out, lse = _run_step(vm, x)
    # the append wrote the manager-style cache tensor in place, through strided views
    np.testing.assert_array_equal(x["k_cache"].numpy(), want_k)
    np.testing.assert_array_equal(x["v_cache"].numpy(), want_v)
    other = (slice(None), slice(None), 0) if layout == "nhd" else (0,)
    assert torch.equal(x["cache"][other], before[other]), "layer 0 must be untouched"
    assert not torch.equal(x["cache"], before)
    ref_out, ref_lse = reference_prefill(
        x["q"].numpy(), want_k, want_v, x["qo_indptr"].numpy(), cached,
        x["lookup_table"].numpy(), layout=layout, causal=opts.get("causal", True),
        sm_scale=opts.get("sm_scale"), sliding_window=opts.get("sliding_window"))
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_append_and_decode_match_reference(layout, num_splits):
    rng = np.random.default_rng(7 + num_splits)
    page_size = 4 if layout == "nhd" else 40
    cached = [0, 11, 6, 25, 3]
    x = _random_batch(rng, layout, 40 if layout == "nhd" else 8, page_size, cached, [1] * 5)
    want_k, want_v = reference_append(x["k_cache"].numpy(), x["v_cache"].numpy(), x["k"].numpy(),
                                      x["v"].numpy(), x["qo_indptr"].numpy(), cached,
                                      x["lookup_table"].numpy(), layout=layout)
    vm = _compile(_step_module(layout, decode=True, num_splits=num_splits, sm_scale=0.2))
    out, lse = _run_step(vm, x)
    np.testing.assert_array_equal(x["k_cache"].numpy(), want_k)
    np.testing.assert_array_equal(x["v_cache"].numpy(), want_v)
    ref_out, ref_lse = reference_decode(x["q"].numpy(), want_k, want_v, cached,
                                        x["lookup_table"].numpy(), layout=layout, sm_scale=0.2)
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-4, atol=1e-4)
    # and the new token of each sequence is where the table says
    for b, c in enumerate(cached):
        page = int(x["lookup_table"][b, c // page_size])
        row = x["k_cache"][page, c % page_size] if layout == "nhd" \
            else x["k_cache"][page, :, c % page_size]
        assert torch.equal(row, x["k"][b])


def _manager(kind):
    if kind == "paged":
        p = KVCacheParams("float32", n_kv_heads=H, head_dim=D, cache_strategy="paged",
                          page_size=4)
        return PagedKVCacheManager(p, 3, 24, LAYERS)
    if kind == "continuous":
        p = KVCacheParams("float32", n_kv_heads=H, head_dim=D, cache_strategy="continuous")
        return ContinuousBatchingKVCacheManager(p, 3, 24, LAYERS)
    p = KVCacheParams("float32", n_kv_heads=H, head_dim=D, cache_strategy="linear")
    return LinearKVCache(p, 3, 24, LAYERS)


@pytest.mark.parametrize("kind", ["paged", "continuous", "linear"])
def test_kv_input_vars_agree_with_manager(kind):
    mgr = _manager(kind)
    kv = kr.kv_input_vars_for(mgr)
    assert kv.num_layers == LAYERS and len(kv.params()) == 2 * LAYERS + 4
    if hasattr(mgr, "input_symbols"):
        sym = mgr.input_symbols()[0]
        assert [int(d) for d in kv.lookup_table.ty.shape.values[1:]] == \
            [int(d) for d in sym.lookup_table.shape.values[1:]]
        assert str(kv.k_caches[0].ty.dtype) == str(sym.blocks.dtype)
    if kind == "linear":
        mgr.set_active_batch_size(2)
        inp = mgr.step_inputs([3, 1])[0]
    else:
        ids = mgr.claim(2)
        inp = mgr.fetch([BatchItem(ids[0], [1, 2, 3]), BatchItem(ids[1], [4])])[0]
    args = kr.kv_call_args(inp)
    assert kv.layout == inp.layout
    for var, tensor in zip(kv.params(), args):
        dims = var.ty.shape.values
        concrete = [int(d) if not hasattr(d, "name") and not hasattr(d, "a") else None
                    for d in dims]
        assert len(dims) == tensor.dim(), var.name_hint
        for want, got in zip(concrete, tensor.shape):
            assert want is None or want == got, (var.name_hint, dims, tuple(tensor.shape))
    # views are zero-copy: they share the manager's storage
    base = inp.blocks.untyped_storage().data_ptr()
    assert all(a.untyped_storage().data_ptr() == base for a in args[:2 * LAYERS])


def test_relax_step_on_manager_inputs():
    """A Relax function typed from input_symbols runs on a paged manager's fetched inputs."""
    mgr = _manager("paged")
    kv = kr.kv_input_vars_for(mgr)
    n = tir.Var("num_tokens", "int64")
    q = relax.Var("q", relax.TensorType([n, HQ, D], "float32"))
    k = relax.Var("k", relax.TensorType([n, H, D], "float32"))
    v = relax.Var("v", relax.TensorType([n, H, D], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, v, *kv.params()], pure=False):
        outs = []
        for layer in range(LAYERS):
            kc, vc = kr.emit_append_kv(bb, kv.k_caches[layer], kv.v_caches[layer], k, v,
                                       kv.qo_indptr, kv.cache_lengths, kv.lookup_table)
            outs.append(kr.emit_attention(bb, q, kc, vc, kv.qo_indptr, kv.cache_lengths,
                                          kv.lookup_table))
        bb.emit_func_output(relax.Tuple(outs))
    mod = bb.get()
    names = [gv.name_hint for gv in mod.get_global_vars()]
    assert sum(n.startswith("kvtvm_append") for n in names) == 1   # added once per spec
    assert sum(n.startswith("kvtvm_prefill") for n in names) == 1
    vm = _compile(mod)
    ids = mgr.claim(2)
    inp = mgr.fetch([BatchItem(ids[0], list(range(6))), BatchItem(ids[1], [5, 6, 7])])[0]
    torch.manual_seed(3)
    qt, kt, vt = torch.randn(9, HQ, D), torch.randn(9, H, D), torch.randn(9, H, D)
    outs = vm["main"](qt, kt, vt, *kr.kv_call_args(inp))
    coll = inp.collection()
    for layer in range(LAYERS):
        ref, _ = reference_prefill(qt.numpy(), coll.get_key_cache(layer).blocks.numpy(),
                                   coll.get_value_cache(layer).blocks.numpy(),
                                   inp.qo_indptr.numpy(), inp.cache_lengths.numpy(),
                                   inp.lookup_table.numpy())
        np.testing.assert_allclose(torch.as_tensor(outs[layer]).numpy(), ref, rtol=1e-4,
                                   atol=1e-5)
    mgr.step([BatchItem(ids[0], list(range(6))), BatchItem(ids[1], [5, 6, 7])])
    assert mgr.cache_length(ids[0]) == 6


def test_each_specialization_added_once():
    """Causal and non-causal prefill in one module: two kernels with distinct symbols, the
    repeated one reused; each matches the reference."""
    kv = kr.kv_input_vars(1, H, D, "float32")
    n = tir.Var("n", "int64")
    q = relax.Var("q", relax.TensorType([n, HQ, D], "float32"))
    bb = relax.BlockBuilder()
    modes = [True, False, True]
    with bb.function("main", [q, *kv.params()], pure=False):
        outs = [kr.emit_attention(bb, q, kv.k_caches[0], kv.v_caches[0], kv.qo_indptr,
                                  kv.cache_lengths, kv.lookup_table, causal=c) for c in modes]
        bb.emit_func_output(relax.Tuple(outs))
    mod = bb.get()
    kernels = sorted(g.name_hint for g in mod.get_global_vars() if g.name_hint != "main")
    assert len(kernels) == 2 and any("causal0" in k for k in kernels), kernels
    vm = _compile(mod)
    rng = np.random.default_rng(11)
    x = _random_batch(rng, "nhd", 12, 4, [3, 0, 6], [2, 5, 1])
    outs = vm["main"](x["q"], x["k_cache"], x["v_cache"], x["qo_indptr"], x["cache_lengths"],
                      x["lookup_table"], kr.error_flag())
    for out, causal in zip(outs, modes):
        ref, _ = reference_prefill(x["q"].numpy(), x["k_cache"].numpy(), x["v_cache"].numpy(),
                                   x["qo_indptr"].numpy(), x["cache_lengths"].numpy(),
                                   x["lookup_table"].numpy(), causal=causal)
        np.testing.assert_allclose(torch.as_tensor(out).numpy(), ref, rtol=1e-4, atol=1e-5)
    assert not np.allclose(torch.as_tensor(outs[0]).numpy(), torch.as_tensor(outs[1]).numpy())


def test_emit_rejects_bad_shapes():
    kv = kr.kv_input_vars(1, H, D, "float32")
    bb = relax.BlockBuilder()
    q16 = relax.Var("q", relax.TensorType([5, HQ, D], "float16"))
    q_bad_heads = relax.Var("q", relax.TensorType([5, H * G + 1, D], "float32"))
    q_ok = relax.Var("q", relax.TensorType([5, HQ, D], "float32"))
    with bb.function("main", [q16, q_bad_heads, q_ok, *kv.params()], pure=False):
        with pytest.raises(InvalidArgumentError, match="q"):
            kr.emit_attention(bb, q16, kv.k_caches[0], kv.v_caches[0], kv.qo_indptr,
                              kv.cache_lengths, kv.lookup_table)
        with pytest.raises(InvalidArgumentError, match="n_q_heads"):
            kr.emit_attention(bb, q_bad_heads, kv.k_caches[0], kv.v_caches[0], kv.qo_indptr,
                              kv.cache_lengths, kv.lookup_table)
        with pytest.raises(InvalidArgumentError, match="num_splits"):
            kr.emit_decode_attention(bb, q_ok, kv.k_caches[0], kv.v_caches[0],
                                     kv.cache_lengths, kv.lookup_table, num_splits=0)
        bb.emit_func_output(relax.Tuple([]))


# ------------------------------------------------------------------------------------------
# The example
# ------------------------------------------------------------------------------------------


def _example():
    path = Path(__file__).resolve().parents[2] / "examples" / "relax_llama.py"
    spec = importlib.util.spec_from_file_location("relax_llama_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    ex = _example()
    cfg = ex.Config(num_layers=2, hidden=64, intermediate=128, n_heads=4, n_kv_heads=2,
                    head_dim=16, vocab=300, page_size=4, max_seq_len=48, new_tokens=6,
                    system_prompt_len=9,
                    requests=((0, 5, True), (0, 4, False), (0, 11, False), (2, 3, True),
                              (4, 1, False)))
    return ex, cfg, ex.build(cfg)


def test_example_tokens_match_transformers(example):
    ex, cfg, built = example
    requests = ex.make_prompts(cfg)
    got, stats = ex.serve(cfg, built.vm, built.weight_list, built.manager, requests, log=None)
    for r, (_, prompt) in enumerate(requests):
        assert got[r] == ex.hf_generate(built.hf, prompt, cfg.new_tokens), f"request {r}"
    assert stats["prefix_hit_tokens"] >= 8        # the late request reused the system prompt
    assert stats["decode_calls"] > 0 and stats["prefill_calls"] >= 2
    assert built.manager.slots_remaining == set(range(built.manager.max_batch_size))


def test_example_detects_wrong_rope(example):
    """The comparison can fail: flip the rotate_half sign convention in the Relax copy."""
    ex, cfg, built = example
    weights = [(-w if w is built.weights["rope_sin"] else w) for w in built.weight_list]
    requests = ex.make_prompts(cfg)
    got, _ = ex.serve(cfg, built.vm, weights, ex.make_manager(cfg), requests, log=None)
    want = [ex.hf_generate(built.hf, p, cfg.new_tokens) for _, p in requests]
    assert got != want


def test_example_run_reports(example):
    ex, cfg, _ = example
    lines = []
    ok, report = ex.run(cfg, log=lines.append)
    assert ok and report["manager_ok"] and not report["mismatches"]
    assert any(line.startswith("OK: 5/5") for line in lines), lines[-1]


def test_example_run_reports_mismatch(example, monkeypatch):
    """run() says where the tokens differ and returns False (main() then exits 1)."""
    ex, cfg, _ = example
    real = ex.rope_tables

    def wrong_rope(model, c):  # rotate_half with the opposite sign
        cos, sin = real(model, c)
        return cos, -sin

    monkeypatch.setattr(ex, "rope_tables", wrong_rope)
    lines = []
    ok, report = ex.run(cfg, log=lines.append)
    assert not ok and report["mismatches"]
    r, at, got, want = report["mismatches"][0]
    assert got[at] != want[at] and got[:at] == want[:at]
    assert any(line.startswith(f"MISMATCH request {r}") for line in lines)
    assert lines[-1].startswith("FAILED")


_SMALL = dict(num_layers=2, hidden=64, intermediate=128, n_heads=4, n_kv_heads=2, head_dim=16,
              vocab=300, page_size=4, max_seq_len=48, new_tokens=6, system_prompt_len=9,
              requests=[[0, 5, True], [0, 4, False], [0, 11, False], [2, 3, True]])

_LOAD_SCRIPT = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("relax_llama_example", sys.argv[1])
ex = importlib.util.module_from_spec(spec); sys.modules[spec.name] = ex
spec.loader.exec_module(ex)
kw = json.loads(sys.argv[3]); kw["requests"] = tuple(map(tuple, kw["requests"]))
ok, report = ex.run(ex.Config(**kw), log=None, load=sys.argv[2])
assert ok and not report["mismatches"], report
assert "tvm.relax" not in sys.modules, "the load path imported tvm.relax"
print("LOADED-RUN-OK")
"""


def test_example_exported_then_run_with_the_runtime_only(tmp_path):
    """--export then --load: the model compiled ahead of time (llvm here) runs in a process
    that loads it with the TVM runtime alone (no tvm.relax import) and matches transformers."""
    ex = _example()
    cfg = ex.Config(**{**_SMALL, "requests": tuple(map(tuple, _SMALL["requests"]))})
    path = ex.export_relax(cfg, tmp_path / "llama.so")
    assert json.loads(Path(str(path) + ".json").read_text())["params"][0] == \
        "model.embed_tokens.weight"
    import subprocess

    example_path = Path(__file__).resolve().parents[2] / "examples" / "relax_llama.py"
    proc = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT, str(example_path), str(path),
                           json.dumps(_SMALL)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TVM_USE_RUNTIME_LIB": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOADED-RUN-OK" in proc.stdout
    # a different configuration is refused, naming what differs
    other = ex.Config(**{**_SMALL, "requests": (), "page_size": 8})
    with pytest.raises(SystemExit, match="page_size"):
        ex.load_relax(other, path)


def test_example_load_refuses_what_kvtvm_did_not_write(tmp_path):
    """--load runs only the bytes --export wrote, from files no one else can write: a
    modified module and a group-writable one are refused before anything is loaded. (The
    tampered files are copies: a module loaded in this process is never rewritten, which
    would change the mapped library under it.)"""
    import shutil as sh

    from kvtvm.errors import CorruptKernelError, UntrustedKernelError

    ex = _example()
    cfg = ex.Config(**{**_SMALL, "requests": tuple(map(tuple, _SMALL["requests"]))})
    path = ex.export_relax(cfg, tmp_path / "llama.so")
    meta = Path(str(path) + ".json")
    assert oct(meta.stat().st_mode & 0o777) == "0o644"

    def copy(name):
        other = tmp_path / name
        sh.copy(path, other)
        sh.copy(meta, str(other) + ".json")
        return other, Path(str(other) + ".json")

    changed, _ = copy("changed.so")
    good = changed.read_bytes()
    changed.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(CorruptKernelError, match="sha256"):
        ex.load_relax(cfg, changed)
    writable, _ = copy("writable.so")
    writable.chmod(0o666)
    with pytest.raises(UntrustedKernelError, match="writable"):
        ex.load_relax(cfg, writable)
    other_meta, record = copy("record.so")
    record.chmod(0o666)
    with pytest.raises(UntrustedKernelError, match="record"):
        ex.load_relax(cfg, other_meta)
    vm, names = ex.load_relax(cfg, path)         # as exported: loads
    assert names and vm is not None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_example_exports_for_cuda(tmp_path):
    """The whole Relax Llama (TVM's default GPU schedules for the model, kvtvm's kernels for
    the cache) builds for sm_90a into one file holding an nvcc fatbin, with no spills."""
    from kvtvm import compiler

    ex = _example()
    cfg = ex.Config(**{**_SMALL, "requests": tuple(map(tuple, _SMALL["requests"])),
                       "device": "cuda", "arch": "sm_90a"})
    path = ex.export_relax(cfg, tmp_path / "llama_sm90a.so")
    assert compiler.fatbin_architectures(compiler.embedded_fatbin(path)) == ["sm_80", "sm_90a"]
    report = compiler.spill_report(path.with_suffix(".ptxas.txt").read_text())
    kernels = {k.split(":", 1)[1] for k in report}
    assert any(k.startswith("kvtvm_prefill") for k in kernels)
    assert any(k.startswith("kvtvm_decode") for k in kernels)
    assert all(v["spill_stores"] == 0 for v in report.values())


# -- the graph's error flag: what the kernels skip is reported by check_errors ---------------

def _bad_batch(layout, what, decode):
    rng = np.random.default_rng(21)
    page_size = 4 if layout == "nhd" else 40
    cached, new = ([2, 5, 3], [1, 1, 1]) if decode else ([2, 5, 3], [3, 1, 2])
    x = _random_batch(rng, layout, 12 if layout == "nhd" else 6, page_size, cached, new)
    num_pages = x["k_cache"].shape[0]
    if what == "page":         # a page past the pool for the rows of sequence 1
        x["lookup_table"][1, :] = num_pages + 7
        arg = "lookup_table"
    else:                      # a negative length
        x["cache_lengths"][2] = -3
        arg = "cache_lengths"
    return x, arg


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("what", ["page", "length"])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_kernels_in_a_graph_report_skipped_entries(layout, what, decode):
    from kvtvm.errors import KernelIndexError

    kr.check_errors()  # nothing pending from an earlier test
    x, arg = _bad_batch(layout, what, decode)
    before = x["cache"].clone()
    vm = _compile(_step_module(layout, decode=decode))
    _ = vm["main"](x["q"], x["k"], x["v"], x["k_cache"], x["v_cache"], x["qo_indptr"],
                   x["cache_lengths"], x["lookup_table"], kr.error_flag())
    assert int(kr.error_flag().sum()) > 0
    with pytest.raises(KernelIndexError, match=arg):
        kr.check_errors()
    assert not kr.error_flag().any()      # zeroed: a second check is quiet
    kr.check_errors("cpu")
    # the skipped sequence wrote nothing: only the pages (slots) of the others changed
    skipped = 1 if what == "page" else 2
    pages = {int(p) for s in range(3) if s != skipped for p in x["lookup_table"][s]}
    changed = (x["k_cache"] != before_k(before, layout)).flatten(1).any(1)
    assert set(torch.nonzero(changed).flatten().tolist()) <= pages


def before_k(cache, layout):
    """The layer-1 K view ``_random_batch`` hands out, of a copy of its cache tensor."""
    return cache[:, 0, 1] if layout == "nhd" else cache[1, :, 0]


def test_without_the_flag_argument_the_graph_skips_silently_and_a_clean_graph_is_quiet():
    kr.check_errors()
    x, _ = _bad_batch("nhd", "page", False)
    vm = _compile(_step_module("nhd", flag=False))
    vm["main"](x["q"], x["k"], x["v"], x["k_cache"], x["v_cache"], x["qo_indptr"],
               x["cache_lengths"], x["lookup_table"], kr.error_flag())
    kr.check_errors()                      # scratch flag: nothing reported
    rng = np.random.default_rng(5)
    good = _random_batch(rng, "nhd", 12, 4, [2, 5, 3], [3, 1, 2])
    _run_step(_compile(_step_module("nhd")), good)   # runs check_errors: quiet


def test_error_flag_argument_is_checked():
    kv = kr.kv_input_vars(1, H, D, "float32")
    bad = relax.Var("flag", relax.TensorType([3], "int32"))
    n = tir.Var("n", "int64")
    k = relax.Var("k", relax.TensorType([n, H, D], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [k, bad, *kv.params()], pure=False):
        with pytest.raises(InvalidArgumentError, match="error_flag"):
            kr.emit_append_kv(bb, kv.k_caches[0], kv.v_caches[0], k, k, kv.qo_indptr,
                              kv.cache_lengths, kv.lookup_table, error_flag=bad)
        bb.emit_func_output(k)


def test_kv_call_args_refuses_stale_inputs():
    from kvtvm.errors import StaleInputsError

    mgr = _manager("paged")
    a, b = mgr.claim(2)
    (inp,) = mgr.fetch([BatchItem(a, [1, 2])])
    mgr.fetch([BatchItem(b, [3])])
    with pytest.raises(StaleInputsError):
        kr.kv_call_args(inp)


@pytest.mark.parametrize("device", [1, -1, "0", 0.0, None, True])
def test_kv_input_vars_for_names_a_bad_device(device):
    """The paged and continuous managers indexed their symbols with ``device`` unchecked: an
    untyped IndexError / TypeError, and -1 taken as the last device (as the linear cache
    already refused)."""
    from kvtvm.manager import ContinuousBatchingKVCacheManager, LinearKVCache
    for mgr in (PagedKVCacheManager(KVCacheParams("float32", 2, 16, "paged", page_size=4),
                                    2, 32, 1),
                ContinuousBatchingKVCacheManager(KVCacheParams("float32", 2, 16, "continuous"),
                                                 2, 32, 1),
                LinearKVCache(KVCacheParams("float32", 2, 16, "linear"), 2, 32, 1)):
        with pytest.raises(InvalidArgumentError, match="device"):
            kr.kv_input_vars_for(mgr, device=device)
        kr.kv_input_vars_for(mgr, device=0)


def test_a_quantized_cache_is_refused_by_the_relax_calls_too():
    """``kv_call_args`` handed an 8-bit cache's int8 views to a graph built for float views;
    it is the DTypeMismatchError ``kv_input_vars_for`` gives."""
    from kvtvm.errors import DTypeMismatchError
    from kvtvm.integrations.relax_inputs import kv_call_args, kv_input_vars_for

    params = KVCacheParams("float32", H, D, "paged", page_size=4, cache_dtype="int8")
    mgr = PagedKVCacheManager(params, 2, 32, LAYERS)
    (s,) = mgr.claim(1)
    (inp,) = mgr.fetch([BatchItem(s, [1, 2, 3])])
    for call in (lambda: kv_input_vars_for(mgr), lambda: kv_call_args(inp)):
        with pytest.raises(DTypeMismatchError, match="k_cache_dtype"):
            call()
