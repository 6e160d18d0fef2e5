"""kvtvm.relax off our grid: the emit_* calls name bad rows, tables and scalar arguments (as
kvtvm.ops does), and a graph with odd shapes (bfloat16, head_dim 40, 3 KV heads x GQA 3, pages
of 5, an empty sequence in the batch) equals the numpy references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

tvm = pytest.importorskip("tvm")
from tvm import relax  # noqa: E402

import kvtvm.relax as kr  # noqa: E402
from kvtvm.errors import InvalidArgumentError  # noqa: E402
from kvtvm.kernels._tvm import tir  # noqa: E402
from kvtvm.kernels.reference import reference_append, reference_prefill  # noqa: E402

H, G = 2, 3
HQ = H * G


def _compile(mod):
    ex = tvm.compile(mod, target=kr.llvm_target())
    return relax.VirtualMachine(ex, tvm.cpu())


@pytest.mark.parametrize("what,call,kwargs", [
    ("sliding_window", "attn", dict(sliding_window=0)),       # was: silently no window
    ("sliding_window", "decode", dict(sliding_window=-3)),
    ("sliding_window", "attn", dict(sliding_window=2**40)),   # was: a TVM ValueError
    ("sm_scale", "attn", dict(sm_scale=float("nan"))),
    ("sm_scale", "decode", dict(sm_scale="x")),                # was: a bare ValueError
    ("causal", "attn", dict(causal="no")),
    ("layout", "attn", dict(layout="xyz")),
    ("num_splits", "decode", dict(num_splits=True)),
    ("num_splits", "decode", dict(num_splits=129)),
    ("k", "append_d", {}), ("k", "append_h", {}), ("k", "append_f16", {}),
    ("q", "attn_q_d", {}), ("qo_indptr", "append_i64", {}),
    ("cache_lengths", "attn_len_i64", {}), ("lookup_table", "decode_tab_rank3", {}),
    # not Relax tensors of known shape (were bare AttributeErrors), and a v_cache unlike
    # k_cache (failed late inside tvm.compile)
    ("q", "attn_torch_q", {}), ("lookup_table", "attn_no_table", {}),
    ("qo_indptr", "attn_tuple_indptr", {}), ("q", "attn_q_no_shape", {}),
    ("k_cache", "append_no_cache", {}), ("v_cache", "append_v_wide", {}),
])
def test_emit_names_bad_rows_tables_and_scalars(what, call, kwargs):
    """Each emit_* checks the new rows, the tables and its scalar arguments as kvtvm.ops
    does (they were passed to the kernel unchecked: a wrong head_dim, an int64 table, a
    window of 0 compiled or ran without a word)."""
    D_ = 40
    kv = kr.kv_input_vars(1, H, D_, "float32")
    ty = {"q": [5, HQ, D_], "q_d": [5, HQ, D_ + 1], "k": [5, H, D_], "k_d": [5, H, D_ + 8],
          "k_h": [5, H + 1, D_]}
    var = {n: relax.Var(n, relax.TensorType(s, "float32")) for n, s in ty.items()}
    var["k16"] = relax.Var("k16", relax.TensorType([5, H, D_], "float16"))
    var["i64"] = relax.Var("i64", relax.TensorType([3], "int64"))
    var["t3"] = relax.Var("t3", relax.TensorType([2, 4, 1], "int32"))
    var["tup"] = relax.Var("tup", relax.TupleType([relax.TensorType([3], "int32")]))
    var["q_any"] = relax.Var("q_any", relax.TensorType(None, "float32", ndim=3))
    wide = kr.kv_input_vars(1, H, 2 * D_, "float32").v_caches[0]
    kc, vc, tabs = kv.k_caches[0], kv.v_caches[0], (kv.qo_indptr, kv.cache_lengths,
                                                     kv.lookup_table)
    calls = {
        "attn": lambda bb: kr.emit_attention(bb, var["q"], kc, vc, *tabs, **kwargs),
        "decode": lambda bb: kr.emit_decode_attention(bb, var["q"], kc, vc, *tabs[1:],
                                                      **kwargs),
        "append_d": lambda bb: kr.emit_append_kv(bb, kc, vc, var["k_d"], var["k_d"], *tabs),
        "append_h": lambda bb: kr.emit_append_kv(bb, kc, vc, var["k_h"], var["k_h"], *tabs),
        "append_f16": lambda bb: kr.emit_append_kv(bb, kc, vc, var["k16"], var["k16"], *tabs),
        "attn_q_d": lambda bb: kr.emit_attention(bb, var["q_d"], kc, vc, *tabs),
        "append_i64": lambda bb: kr.emit_append_kv(bb, kc, vc, var["k"], var["k"], var["i64"],
                                                   *tabs[1:]),
        "attn_len_i64": lambda bb: kr.emit_attention(bb, var["q"], kc, vc, tabs[0],
                                                     var["i64"], tabs[2]),
        "decode_tab_rank3": lambda bb: kr.emit_decode_attention(bb, var["q"], kc, vc, tabs[1],
                                                                var["t3"]),
        "attn_torch_q": lambda bb: kr.emit_attention(bb, torch.zeros(5, HQ, D_), kc, vc, *tabs),
        "attn_no_table": lambda bb: kr.emit_attention(bb, var["q"], kc, vc, *tabs[:2], None),
        "attn_tuple_indptr": lambda bb: kr.emit_attention(bb, var["q"], kc, vc, var["tup"],
                                                          *tabs[1:]),
        "attn_q_no_shape": lambda bb: kr.emit_attention(bb, var["q_any"], kc, vc, *tabs),
        "append_no_cache": lambda bb: kr.emit_append_kv(bb, None, vc, var["k"], var["k"],
                                                        *tabs),
        "append_v_wide": lambda bb: kr.emit_append_kv(bb, kc, wide, var["k"], var["k"], *tabs),
    }
    bb = relax.BlockBuilder()
    with bb.function("main", [*var.values(), *kv.params()], pure=False):
        with pytest.raises(InvalidArgumentError, match=what):
            calls[call](bb)
        bb.emit_func_output(relax.Tuple([]))
    with pytest.raises(InvalidArgumentError, match="head_dim"):
        kr.kv_input_vars(1, H, 0, "float32")


def test_off_grid_shapes_in_a_graph_match_reference():
    """bfloat16, head_dim 40, 3 KV heads x GQA 3, pages of 5, an empty sequence beside a
    one-token and a longer one: append + prefill through the Relax VM equal the references."""
    import ml_dtypes

    h, g, d, ps, dt = 3, 3, 40, 5, "bfloat16"
    kv = kr.kv_input_vars(1, h, d, dt)
    n = tir.Var("n", "int64")
    q, k, v = (relax.Var(nm, relax.TensorType([n, hh, d], dt))
               for nm, hh in (("q", h * g), ("k", h), ("v", h)))
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, v, *kv.params()], pure=False):
        kc, vc = kr.emit_append_kv(bb, kv.k_caches[0], kv.v_caches[0], k, v, kv.qo_indptr,
                                   kv.cache_lengths, kv.lookup_table)
        out = kr.emit_attention(bb, q, kc, vc, kv.qo_indptr, kv.cache_lengths,
                                kv.lookup_table, return_lse=True)
        bb.emit_func_output(relax.Tuple(list(out)))
    vm = _compile(bb.get())
    rng = np.random.default_rng(5)
    cached, new = [0, 3, 12], [0, 1, 8]
    table = torch.tensor([[9, 8, 7, 6], [5, 4, 3, 2], [1, 0, 10, 11]], dtype=torch.int32)
    caches = [torch.randn(12, ps, h, d).to(torch.bfloat16) for _ in range(2)]
    rows = [torch.randn(9, hh, d).to(torch.bfloat16) for hh in (h * g, h, h)]
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(new)]), dtype=torch.int32)
    lengths = torch.tensor(cached, dtype=torch.int32)
    f = [t.float().numpy().astype(ml_dtypes.bfloat16) for t in caches + rows]
    want_k, want_v = reference_append(f[0], f[1], f[3], f[4], indptr.numpy(), cached,
                                      table.numpy())
    out, lse = vm["main"](*rows, *caches, indptr, lengths, table, kr.error_flag())
    kr.check_errors()
    np.testing.assert_array_equal(caches[0].float().numpy(), want_k.astype(np.float32))
    np.testing.assert_array_equal(caches[1].float().numpy(), want_v.astype(np.float32))
    ref, ref_lse = reference_prefill(f[2], want_k, want_v, indptr.numpy(), cached,
                                     table.numpy())
    np.testing.assert_allclose(torch.as_tensor(out).float().numpy(), ref, rtol=2**-7,
                               atol=1e-2)
    np.testing.assert_allclose(torch.as_tensor(lse).numpy(), ref_lse, rtol=1e-4, atol=1e-3)


def test_two_scales_alike_to_six_digits_get_two_kernels():
    """The kernel's name held sm_scale as "{:g}" (6 digits): 0.0883883 and 128**-0.5 got one
    global symbol, and tvm.compile failed on the duplicate."""
    D_ = 16
    kv = kr.kv_input_vars(1, H, D_, "float32")
    n = tir.Var("n", "int64")
    q = relax.Var("q", relax.TensorType([n, HQ, D_], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [q, *kv.params()], pure=False):
        args = (kv.k_caches[0], kv.v_caches[0], kv.qo_indptr, kv.cache_lengths,
                kv.lookup_table)
        a = kr.emit_attention(bb, q, *args, sm_scale=0.0883883)
        b = kr.emit_attention(bb, q, *args, sm_scale=128 ** -0.5)
        bb.emit_func_output(relax.Tuple([a, b]))
    mod = bb.get()
    names = [gv.name_hint for gv in mod.functions if gv.name_hint.startswith("kvtvm")]
    assert len(set(names)) == 2, names
    _compile(mod)


def test_misuse_of_the_input_helpers_is_typed_and_names_the_argument():
    """Natural mistakes raised bare AttributeErrors, TVM InternalErrors, or made a flag on a
    meta device that broke every later check_errors(); ``cpu:0`` made a second CPU flag the
    no-argument check still reads but a graph given the other never reported to."""
    from kvtvm import KVCacheParams
    from kvtvm.errors import DTypeMismatchError
    from kvtvm.manager import BatchItem, LinearKVCache, PagedKVCacheManager

    params = KVCacheParams("float32", 2, 16, "paged", page_size=4)
    mgr = PagedKVCacheManager(params, 2, 16, 1)
    (s,) = mgr.claim(1)
    fetched = mgr.fetch([BatchItem(s, [1, 2, 3])])
    with pytest.raises(InvalidArgumentError, match=r"inputs: .*fetch\(batch\)\[0\]"):
        kr.kv_call_args(fetched)
    assert len(kr.kv_call_args(fetched[0])) == 2 + 4
    for bad in (params, None):
        with pytest.raises(InvalidArgumentError, match="manager"):
            kr.kv_input_vars_for(bad)
    lin = LinearKVCache(KVCacheParams("float32", 2, 16, "linear"), 2, 8, 1)
    with pytest.raises(InvalidArgumentError, match="manager.*kv_input_vars_for"):
        kr.input_symbols_for(lin)
    assert kr.kv_input_vars_for(lin).layout == "hnd"
    for kw, name in ((dict(num_pages=-1), "num_pages"), (dict(page_size=0), "page_size"),
                     (dict(page_size=2.5), "page_size"), (dict(width="x"), "width"),
                     (dict(batch=True), "batch")):
        with pytest.raises(InvalidArgumentError, match=name):
            kr.kv_input_types(1, 2, 16, **kw)
    assert "k_cache_1" in kr.kv_input_types(np.int64(2), 2, 16, num_pages=np.int32(3))
    n = tir.Var("n", "int64")  # TVM's ints and expressions of vars are kept
    types = kr.kv_input_types(1, 2, 16, num_pages=tir.IntImm("int64", 8), width=n * 2)
    assert int(types["k_cache_0"].shape.values[0]) == 8
    for alias in ("fp8", "e4m3"):
        with pytest.raises(DTypeMismatchError, match="quantized"):
            kr.kv_input_types(1, 2, 16, alias)
    with pytest.raises(DTypeMismatchError, match="dtype name") as err:
        kr.kv_input_types(1, 2, 16, "fp16")
    assert "quantized" not in str(err.value)
    with pytest.raises(DTypeMismatchError, match="quantized"):
        kr.kv_input_types(1, 2, 16, "int8")
    for device in ("meta", "tpu", 3, ("cpu", "cpu")):
        with pytest.raises(InvalidArgumentError, match="device"):
            kr.error_flag(device)
    assert kr.error_flag("cpu:0") is kr.error_flag("cpu") is kr.error_flag(None)
    kr.check_errors()  # no flag of a bad device was kept
    kr.check_errors("cpu:0")


def test_error_flags_of_threads_report_apart():
    """Two threads running graphs over independent managers: one thread's kernel error is
    raised by that thread's ``check_errors``, not by the other's (which used to read and
    clear the one process-wide CPU flag)."""
    import threading

    from kvtvm.errors import KernelIndexError

    got, set_, checked = {}, threading.Event(), threading.Event()

    def failing():
        kr.error_flag("cpu")[0] = 1          # what a kernel writes on a skipped entry
        set_.set()
        checked.wait(10)
        with pytest.raises(KernelIndexError):
            kr.check_errors("cpu")
        got["failing"] = True

    def clean():
        set_.wait(10)
        try:
            kr.check_errors()                # the calling thread's flags: nothing to report
            kr.check_errors("cpu")
            got["clean"] = kr.error_flag("cpu") is not kr.error_flag(torch.device("cpu"))
        finally:
            checked.set()

    threads = [threading.Thread(target=failing), threading.Thread(target=clean)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert got == {"failing": True, "clean": False}
