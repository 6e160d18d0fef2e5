"""decode_attention on the CPU (llvm) kernels against the float64 numpy reference: every layout,
page sizes 1/16/128, permuted pages, GQA, head dims, forced splits, sliding window, bad input."""

import math

import numpy as np
import pytest
import torch

from kvtvm import ops
from kvtvm.compiler import KernelSpec, get_kernel
from kvtvm.errors import (DeviceMismatchError, DTypeMismatchError, InvalidArgumentError,
                          SequenceTooLongError)
from kvtvm.kernels.reference import reference_decode
from kvtvm.params import torch_dtype

DTYPES = ["float16", "bfloat16", "float32"]
TOL = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 1e-2}


def make_case(rng, layout, page_size, lengths, H, G, D, dtype, num_layers=2, layer=1,
              spare_pages=3):
    """A manager-shaped cache tensor with random contents, per-layer K/V views, q and a
    permuted lookup table covering ``lengths[b] + 1`` positions of every sequence."""
    tdt = torch_dtype(dtype)
    batch = len(lengths)
    need = [-(-(n + 1) // page_size) for n in lengths]
    max_pages = max(need)
    num_pages = sum(need) + spare_pages
    perm = rng.permutation(num_pages)
    table = np.full((batch, max_pages), -1, np.int32)
    cursor = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[cursor:cursor + n]
        cursor += n
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    if layout == "nhd":  # PAGED / CONTINUOUS: [pages, 2, layers, page_size, H, D]
        cache = torch.randn(num_pages, 2, num_layers, page_size, H, D, generator=gen).to(tdt)
        kv, vv = cache[:, 0, layer], cache[:, 1, layer]
    else:  # LINEAR: [layers, slots, 2, H, max_seq_len, D]
        cache = torch.randn(num_layers, num_pages, 2, H, page_size, D, generator=gen).to(tdt)
        kv, vv = cache[layer, :, 0], cache[layer, :, 1]
    q = torch.randn(batch, H * G, D, generator=gen).to(tdt)
    return q, kv, vv, torch.tensor(lengths, dtype=torch.int32), torch.from_numpy(table)


def check(case, layout, dtype, **kw):
    q, kv, vv, lengths, table = case
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32)
    ref_o, ref_l = reference_decode(q.float().numpy(), kv.float().numpy(), vv.float().numpy(),
                                    lengths.numpy(), table.numpy(), layout=layout,
                                    sm_scale=kw.get("sm_scale"),
                                    sliding_window=kw.get("sliding_window"))
    got_o, got_l = ops.decode_attention(q, kv, vv, lengths, table, layout=layout, out=out,
                                        lse=lse, **kw)
    assert got_o is out and got_l is lse
    o, lo = out.float().numpy(), lse.numpy()
    assert np.isfinite(o).all(), "some output element was not written (or is NaN)"
    assert np.isfinite(lo).all(), "some lse element was not written (or is NaN)"
    tol = TOL[dtype]
    np.testing.assert_allclose(o, ref_o, rtol=tol, atol=tol)
    np.testing.assert_allclose(lo, ref_l, rtol=tol, atol=tol)


def boundary_lengths(page_size):
    """Brand-new sequence (0 cached + the current token), one cached, a length ending exactly
    on a page boundary, one just past it, and a longer one."""
    return [0, 1, 2 * page_size - 1, page_size, 3 * page_size + 5]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_paged_permuted_pages(dtype, page_size):
    rng = np.random.default_rng(page_size)
    lengths = boundary_lengths(page_size) if page_size > 1 else [0, 1, 7, 40]
    case = make_case(rng, "nhd", page_size, lengths, H=2, G=4, D=64, dtype=dtype)
    check(case, "nhd", dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_continuous_layout(dtype):
    """CONTINUOUS: one page of max_seq_len per sequence, lookup_table [batch, 1]."""
    rng = np.random.default_rng(11)
    max_seq_len = 96
    lengths = [0, 95 - 1, 95, 30]  # 95 + 1 = 96 fills the block exactly
    q, kv, vv, lengths_t, _ = make_case(rng, "nhd", max_seq_len, lengths, 2, 4, 64, dtype)
    table = torch.from_numpy(rng.permutation(kv.shape[0])[:len(lengths), None].astype(np.int32))
    check((q, kv, vv, lengths_t, table), "nhd", dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_layout(dtype):
    """LINEAR: head-major [slots, H, max_seq_len, D] per layer, one slot per sequence."""
    rng = np.random.default_rng(12)
    max_seq_len = 64
    q, kv, vv, lengths_t, _ = make_case(rng, "hnd", max_seq_len, [0, 63, 17], 2, 4, 64, dtype)
    table = torch.from_numpy(rng.permutation(kv.shape[0])[:3, None].astype(np.int32))
    check((q, kv, vv, lengths_t, table), "hnd", dtype)


@pytest.mark.parametrize("group_size,head_dim,dtype", [(1, 128, "float16"), (8, 64, "float32"),
                                                       (4, 256, "bfloat16"), (8, 128, "float16")])
def test_gqa_and_head_dims(group_size, head_dim, dtype):
    rng = np.random.default_rng(group_size * head_dim)
    case = make_case(rng, "nhd", 16, [0, 33, 47], H=2, G=group_size, D=head_dim, dtype=dtype)
    check(case, "nhd", dtype)


@pytest.mark.parametrize("num_splits", [2, 3, 16])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_forced_splits(num_splits, layout):
    """More splits than some sequences have tokens: empty splits must merge to nothing."""
    rng = np.random.default_rng(num_splits)
    page_size = 16 if layout == "nhd" else 256
    case = make_case(rng, layout, page_size, [0, 5, 200], H=2, G=4, D=64, dtype="float32")
    check(case, layout, "float32", num_splits=num_splits)


@pytest.mark.parametrize("window,num_splits", [(1, 1), (7, 1), (7, 3), (100, 2), (1000, 1)])
def test_sliding_window(window, num_splits):
    rng = np.random.default_rng(window)
    case = make_case(rng, "nhd", 16, [0, 6, 7, 150], H=2, G=4, D=64, dtype="float16")
    check(case, "nhd", "float16", sliding_window=window, num_splits=num_splits)


def test_sm_scale_and_default_splits():
    rng = np.random.default_rng(5)
    case = make_case(rng, "nhd", 16, [300], H=2, G=2, D=64, dtype="float32")
    check(case, "nhd", "float32", sm_scale=0.3)
    check(case, "nhd", "float32")  # default scale 1/sqrt(D), splits chosen by the op


def test_numpy_inputs_and_allocated_outputs():
    rng = np.random.default_rng(6)
    q, kv, vv, lengths, table = make_case(rng, "nhd", 8, [3, 20], 2, 4, 64, "float32")
    out, lse = ops.decode_attention(q.numpy(), kv.contiguous().numpy(), vv.contiguous().numpy(),
                                    lengths.numpy(), table.numpy())
    ref_o, ref_l = reference_decode(q.numpy(), kv.numpy(), vv.numpy(), lengths.numpy(),
                                    table.numpy())
    np.testing.assert_allclose(out.numpy(), ref_o, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(lse.numpy(), ref_l, rtol=1e-3, atol=1e-3)
    assert math.isclose(float(lse[0, 0]), float(ref_l[0, 0]), rel_tol=1e-3)


@pytest.mark.parametrize("knobs", [{"head_block": 1, "tile_tokens": 8},
                                   {"head_block": 2, "tile_tokens": 64, "vector_bytes": 16},
                                   {"parallel": False}])  # the serial variant of small calls
def test_schedule_knobs(knobs):
    """Knob values the autotuner may pick compute the same thing."""
    rng = np.random.default_rng(7)
    q, kv, vv, lengths, table = make_case(rng, "nhd", 16, [0, 77, 130], 4, 2, 64, "float32")
    spec = KernelSpec(op="decode", dtype="float32", head_dim=64, n_kv_heads=4, group_size=2,
                      knobs=knobs)
    fn = get_kernel(spec)
    for splits in (1, 3):
        out = torch.full(q.shape, float("nan"))
        lse = torch.full(q.shape[:2], float("nan"))
        o_part, lse_part = torch.empty(splits, 3, 8, 64), torch.empty(splits, 3, 8)
        fn(q, kv, vv, lengths, table, out, lse, o_part, lse_part, 0.125, 0,
           torch.zeros(4, dtype=torch.int32))
        ref_o, ref_l = reference_decode(q.numpy(), kv.numpy(), vv.numpy(), lengths.numpy(),
                                        table.numpy(), sm_scale=0.125)
        np.testing.assert_allclose(out.numpy(), ref_o, rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(lse.numpy(), ref_l, rtol=1e-3, atol=1e-3)


def test_unscheduled_definition_matches_reference():
    """The definition itself (serial TIR, no schedule) is right, splits and window included."""
    import tvm

    from kvtvm.kernels import decode

    spec = KernelSpec(op="decode", dtype="float32", head_dim=32, n_kv_heads=2, group_size=2,
                      features=("sliding_window",))
    mod = tvm.IRModule({"main": decode.define(spec).with_attr("global_symbol", "main")})
    fn = tvm.compile(mod, target="llvm").mod["main"]
    rng = np.random.default_rng(8)
    q, kv, vv, lengths, table = make_case(rng, "nhd", 4, [0, 9, 14], 2, 2, 32, "float32")
    for splits, window in ((1, 0), (3, 0), (2, 5)):
        out, lse = torch.full(q.shape, float("nan")), torch.full(q.shape[:2], float("nan"))
        fn(q, kv, vv, lengths, table, out, lse, torch.empty(splits, 3, 4, 32),
           torch.empty(splits, 3, 4), 0.2, window, torch.zeros(4, dtype=torch.int32))
        ref_o, ref_l = reference_decode(q.numpy(), kv.numpy(), vv.numpy(), lengths.numpy(),
                                        table.numpy(), sm_scale=0.2, sliding_window=window)
        np.testing.assert_allclose(out.numpy(), ref_o, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(lse.numpy(), ref_l, rtol=1e-4, atol=1e-4)


# -- bad input: typed errors naming the argument, nothing written ---------------------------


@pytest.fixture
def good():
    rng = np.random.default_rng(9)
    return make_case(rng, "nhd", 16, [5, 20], 2, 4, 64, "float32")


def _call_poisoned(args, **kw):
    q, kv, vv, lengths, table = args
    out = torch.full(q.shape, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"))
    try:
        ops.decode_attention(q, kv, vv, lengths, table, out=out, lse=lse, **kw)
    finally:
        assert torch.isnan(out).all() and torch.isnan(lse).all(), "written despite the error"


def test_bad_dtype(good):
    q, kv, vv, lengths, table = good
    with pytest.raises(DTypeMismatchError, match="q"):
        _call_poisoned((q.half(), kv, vv, lengths, table))
    with pytest.raises(DTypeMismatchError, match="cache_lengths"):
        _call_poisoned((q, kv, vv, lengths.long(), table))
    with pytest.raises(DTypeMismatchError, match="lse"):
        ops.decode_attention(q, kv, vv, lengths, table, lse=torch.zeros(2, 8, dtype=torch.float64))


def test_bad_shapes(good):
    q, kv, vv, lengths, table = good
    with pytest.raises(InvalidArgumentError, match="head_dim"):
        _call_poisoned((q[..., :32].contiguous(), kv, vv, lengths, table))
    with pytest.raises(InvalidArgumentError, match="n_q_heads"):
        _call_poisoned((q[:, :3].contiguous(), kv, vv, lengths, table))
    with pytest.raises(InvalidArgumentError, match="batch"):
        _call_poisoned((q, kv, vv, lengths[:1].contiguous(), table))
    with pytest.raises(InvalidArgumentError, match="out.shape"):
        ops.decode_attention(q, kv, vv, lengths, table, out=torch.empty(2, 8, 32))
    with pytest.raises(InvalidArgumentError, match="sliding_window"):
        _call_poisoned(good, sliding_window=0)
    with pytest.raises(InvalidArgumentError, match="num_splits"):
        _call_poisoned(good, num_splits=0)
    with pytest.raises(InvalidArgumentError, match="layout"):
        _call_poisoned(good, layout="xyz")


@pytest.mark.parametrize("name,value", [
    ("sliding_window", 2**32 + 2),   # used to wrap to a window of 2 in the int32 kernel argument
    ("sliding_window", 2**31), ("sliding_window", [4]), ("sliding_window", "x"),
    ("sliding_window", 2.0), ("num_splits", [2]), ("num_splits", 2.0),
    ("sm_scale", "0.3"), ("sm_scale", torch.tensor(0.3)), ("sm_scale", True),
    ("check_indices", "no")])
def test_bad_scalars_are_typed_errors(good, name, value):
    """Off-grid scalars: a TypeError/ValueError from int() or silently wrong numbers before."""
    with pytest.raises(InvalidArgumentError, match=name):
        _call_poisoned(good, **{name: value})


def test_numpy_scalars_are_accepted(good):
    """sm_scale=np.float32(...) was refused by decode (prefill took it); numpy ints too."""
    check(good, "nhd", "float32", sm_scale=np.float32(0.3), num_splits=np.int64(2),
          sliding_window=np.int32(9))


def test_device_mismatch(good):
    q, kv, vv, lengths, table = good
    with pytest.raises(DeviceMismatchError):
        ops.decode_attention(q.to("meta"), kv, vv, lengths, table, check_indices=False)


def test_out_of_range_table(good):
    q, kv, vv, lengths, table = good
    bad = table.clone()
    bad[1, 1] = kv.shape[0]  # one past the last page
    with pytest.raises(InvalidArgumentError, match=r"lookup_table\[1, 1\]"):
        _call_poisoned((q, kv, vv, lengths, bad))
    bad[1, 1] = -1
    with pytest.raises(InvalidArgumentError, match="lookup_table"):
        _call_poisoned((q, kv, vv, lengths, bad))
    too_long = lengths.clone()
    too_long[0] = table.shape[1] * 16  # + the current token passes the table's capacity
    with pytest.raises(SequenceTooLongError, match="cache_lengths"):
        _call_poisoned((q, kv, vv, too_long, table))
    neg = lengths.clone()
    neg[1] = -2
    with pytest.raises(InvalidArgumentError, match="cache_lengths"):
        _call_poisoned((q, kv, vv, neg, table))


def test_choose_num_splits(monkeypatch):
    """CUDA: ~512 positions a split (a power of two), at least 2 CTAs per SM, never a grid just
    past one full wave, never under 128 positions a split; over an 8-bit cache ~1024 positions
    a split where the grid is large; CPU: one task per core, never under 256 positions a split
    (an 8-bit cache alike)."""
    from kvtvm.ops import decode as _decode_op

    monkeypatch.setattr(_decode_op, "_parallel_units", lambda device: 132)  # H100 SMs
    cuda = torch.device("cuda")
    assert _decode_op.choose_num_splits(64, 8, 4096, cuda) == 8
    assert _decode_op.choose_num_splits(128, 8, 2048, cuda) == 4
    assert _decode_op.choose_num_splits(256, 8, 1024, cuda) == 2
    assert _decode_op.choose_num_splits(1, 8, 32768, cuda) == 64
    assert _decode_op.choose_num_splits(1, 8, 4096, cuda) == 32   # 2 CTAs per SM
    assert _decode_op.choose_num_splits(16, 8, 4096, cuda) == 4   # 8 -> 1024 CTAs: 1.1 waves
    assert _decode_op.choose_num_splits(1, 8, 300, cuda) == 2     # >= 128 positions a split
    assert _decode_op.choose_num_splits(1, 8, 10, cuda) == 1
    assert _decode_op.choose_num_splits(1, 1, 1 << 20, cuda) == _decode_op.MAX_SPLITS
    # an 8-bit cache: ~1024 positions a split where the float16 rule's grid holds >= 12 CTAs
    # per SM (1584 on 132 SMs); smaller grids keep that rule
    for batch, ctx, want in ((64, 4096, 4), (256, 1024, 1), (128, 2048, 2), (16, 4096, 4),
                             (32, 4096, 4), (256, 4096, 4), (8, 4096, 8), (1, 32768, 64),
                             (1, 4096, 32), (1, 10, 1), (512, 1024, 1), (2048, 256, 1)):
        assert _decode_op.choose_num_splits(batch, 8, ctx, cuda, quantized=True) == want, \
            (batch, ctx)
    monkeypatch.setattr(_decode_op, "_parallel_units", lambda device: 8)
    cpu = torch.device("cpu")  # a CPU task holds all KV heads of a sequence
    assert _decode_op.choose_num_splits(1, 8, 4096, cpu) == 8
    assert _decode_op.choose_num_splits(16, 8, 4096, cpu) == 1
    assert _decode_op.choose_num_splits(1, 8, 300, cpu) == 2
    assert _decode_op.choose_num_splits(1, 8, 4096, cpu, quantized=True) == 8


def test_split_workspace_is_owned_reused_and_bounded():
    """A SplitWorkspace grows to the largest call and is reused for smaller ones (a fixed
    pointer for CUDA graphs); its bound is a typed error; decode with and without one agree."""
    from kvtvm.ops import SplitWorkspace

    cpu = torch.device("cpu")
    ws = SplitWorkspace(cpu, max_elements=4 * 8 * 32 * 129)
    o1, l1 = ws.views(4, 8, 32, 128)
    o2, l2 = ws.views(2, 8, 32, 128)  # smaller: same buffer
    assert o1.data_ptr() == o2.data_ptr() and o2.shape == (2, 8, 32, 128)
    assert l2.shape == (2, 8, 32) and l2.data_ptr() == o2.data_ptr() + o2.numel() * 4
    assert ws.nbytes == 4 * 8 * 32 * 129 * 4
    with pytest.raises(InvalidArgumentError, match="workspace"):
        ws.views(8, 8, 32, 128)
    assert ws.nbytes == 4 * 8 * 32 * 129 * 4  # unchanged by the refused call

    rng = np.random.default_rng(3)
    P, H, G, D = 4, 2, 2, 16
    kc = torch.from_numpy(rng.standard_normal((12, P, H, D)).astype(np.float32))
    vc = torch.from_numpy(rng.standard_normal((12, P, H, D)).astype(np.float32))
    q = torch.from_numpy(rng.standard_normal((2, H * G, D)).astype(np.float32))
    lengths = torch.tensor([9, 17], dtype=torch.int32)
    table = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], dtype=torch.int32)
    want = ops.decode_attention(q, kc, vc, lengths, table, num_splits=3)
    own = SplitWorkspace(cpu)
    got = ops.decode_attention(q, kc, vc, lengths, table, num_splits=3, workspace=own)
    assert own.nbytes > 0
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
