"""prefill_attention on the CPU (llvm) kernels against the float64 numpy reference."""

import math

import numpy as np
import pytest
import torch

from kvtvm import compiler, ops
from kvtvm.errors import (DeviceMismatchError, DTypeMismatchError, InvalidArgumentError,
                          SequenceTooLongError)
from kvtvm.kernels.reference import reference_prefill
from helpers import TOL, make_prefill_batch as make_batch

def check(args, *, layout="nhd", causal=True, sm_scale=None, sliding_window=None, knobs=None):
    q, kc, vc, indptr, lengths, table = args
    dtype = str(q.dtype).replace("torch.", "")
    ref_out, ref_lse = reference_prefill(q.float().numpy(), kc.float().numpy(),
                                         vc.float().numpy(), indptr.numpy(), lengths.numpy(),
                                         table.numpy(), layout, causal, sm_scale,
                                         sliding_window)
    out = torch.full_like(q, float("nan"))  # poison: every element must be written
    lse = torch.full((q.shape[0], q.shape[1]), float("nan"))
    if knobs is None:
        res = ops.prefill_attention(q, kc, vc, indptr, lengths, table, layout=layout,
                                    causal=causal, sm_scale=sm_scale,
                                    sliding_window=sliding_window, out=out, lse=lse)
        assert res[0] is out and res[1] is lse
    else:  # a specific schedule variant, launched directly
        spec = compiler.KernelSpec(
            op="prefill", dtype=dtype, head_dim=q.shape[2], n_kv_heads=kc.shape[2 if layout
                                                                                == "nhd" else 1],
            group_size=q.shape[1] // kc.shape[2 if layout == "nhd" else 1], layout=layout,
            features=("sliding_window",) if sliding_window else (), knobs=knobs)
        scale = 1 / math.sqrt(q.shape[2]) if sm_scale is None else sm_scale
        compiler.get_kernel(spec)(q, kc, vc, indptr, lengths, table, out, lse, int(causal),
                                  float(scale), int(sliding_window or 0),
                                  torch.zeros(4, dtype=torch.int32))
    got_out, got_lse = out.float().numpy(), lse.numpy()
    assert np.isfinite(got_out).all(), "output not fully written (NaN poison left)"
    assert np.isfinite(got_lse).all(), "lse not fully written (NaN poison left)"
    tol = TOL[dtype]
    np.testing.assert_allclose(got_out, ref_out, rtol=tol, atol=tol, equal_nan=False)
    np.testing.assert_allclose(got_lse, ref_lse, rtol=tol, atol=tol, equal_nan=False)


# ragged batch: a 0-token sequence, a 1-token one (decode step), chunked prefill over a cached
# prefix, a fresh prompt, and lengths ending exactly on a page boundary
def ragged(page_size):
    counts = [5, 0, 1, 37, 2 * page_size, 3]
    starts = [3, 9, 40, page_size + 1, 0, 2 * page_size - 3]  # last ends on a page boundary
    return counts, starts


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_paged_permuted_pages(dtype, page_size):
    rng = np.random.default_rng(page_size)
    counts, starts = ragged(page_size if page_size > 1 else 8)
    args = make_batch(rng, H=2, G=4, D=64, page_size=page_size, counts=counts, starts=starts,
                      dtype=dtype)
    check(args)


@pytest.mark.parametrize("group_size", [1, 3, 4, 8])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_gqa_and_layouts(group_size, layout):
    """nhd paged, and hnd LINEAR (one slot of max_seq_len per sequence)."""
    rng = np.random.default_rng(group_size)
    counts, starts = [7, 0, 1, 30], [0, 12, 20, 33]
    page_size = 16 if layout == "nhd" else 64
    args = make_batch(rng, H=2, G=group_size, D=64, page_size=page_size, counts=counts,
                      starts=starts, layout=layout, dtype="float16")
    check(args, layout=layout)


def test_continuous_layout():
    """CONTINUOUS: one block of max_seq_len per sequence (lookup_table [batch, 1])."""
    rng = np.random.default_rng(11)
    args = make_batch(rng, H=2, G=4, D=64, page_size=96, counts=[9, 1, 40], starts=[0, 60, 56],
                      dtype="float32")
    assert args[-1].shape == (3, 1)
    check(args)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_head_dims(head_dim):
    rng = np.random.default_rng(head_dim)
    args = make_batch(rng, H=1, G=2, D=head_dim, page_size=16, counts=[20, 3], starts=[5, 16],
                      dtype="bfloat16")
    check(args)


@pytest.mark.parametrize("window", [1, 5, 24])
def test_sliding_window(window):
    rng = np.random.default_rng(window)
    args = make_batch(rng, H=2, G=2, D=64, page_size=16, counts=[30, 1, 0, 12],
                      starts=[10, 40, 3, 0], dtype="float32")
    check(args, sliding_window=window)


def test_non_causal_and_scale():
    rng = np.random.default_rng(5)
    args = make_batch(rng, H=2, G=4, D=64, page_size=16, counts=[9, 1, 17], starts=[4, 30, 0],
                      dtype="float32")
    check(args, causal=False, sm_scale=0.3)


@pytest.mark.parametrize("knobs", [
    {"tile_q": 0},  # the definition itself, one (token, head) row per iteration
    {"tile_q": 4, "tile_kv": 16, "row_block": 2},
    {"tile_q": 32, "tile_kv": 64, "row_block": 8},
    {"tile_q": 8, "tile_kv": 32, "row_block": 4, "key_block": 8},
    {"tile_q": 16, "tile_kv": 16, "row_block": 2, "key_block": 2},
])
def test_schedule_variants(knobs):
    """Tiles that span several sequences, partial KV tiles, all row blockings."""
    rng = np.random.default_rng(7)
    counts = [3, 1, 0, 1, 45, 2, 70, 1]
    starts = [0, 17, 5, 31, 8, 64, 3, 15]
    args = make_batch(rng, H=2, G=4, D=64, page_size=16, counts=counts, starts=starts,
                      dtype="float16")
    check(args, knobs=knobs)
    check(args, knobs=knobs, sliding_window=9)


def test_many_decode_like_rows():
    """A batch of 1- and 2-token sequences: every tile spans many sequences."""
    rng = np.random.default_rng(8)
    batch = 50
    counts = rng.integers(0, 3, batch).tolist()
    starts = rng.integers(0, 40, batch).tolist()
    args = make_batch(rng, H=2, G=4, D=64, page_size=16, counts=counts, starts=starts,
                      dtype="float16")
    check(args)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_key_far_below_the_max_weighs_nothing(dtype):
    """A visible key scoring ~205 (log2 units) below its row's max has weight ~2**-205, not
    the 2**-125 floor the exponential once had: a finite V of 1e37 on it left the output at
    1.24 instead of 1. Both kernels agree with the reference, lse too."""
    D, H, G = 40, 3, 2
    torch.manual_seed(5)
    kc, vc = torch.randn(1, 5, H, D) * 0.01, torch.randn(1, 5, H, D) * 0.01
    q = torch.zeros(1, H * G, D)
    q[..., 0] = 30.0
    kc[0, 0, :, 0], kc[0, 1, :, 0] = 30.0, 0.0  # scores 142 and ~0 (natural units)
    vc[0, 0], vc[0, 1] = 1.0, 1e37
    q, kc, vc = (t.to(getattr(torch, dtype)) for t in (q, kc, vc))
    table = torch.zeros(1, 1, dtype=torch.int32)
    lengths = torch.tensor([1], dtype=torch.int32)  # 1 cached + 1 new position
    ip = torch.tensor([0, 1], dtype=torch.int32)
    out, lse = ops.prefill_attention(q, kc, vc, ip, lengths, table)
    dout, dlse = ops.decode_attention(q, kc, vc, lengths, table)
    assert torch.allclose(out.float(), torch.ones_like(out.float()), atol=1e-2), out[0, :, :2]
    assert torch.allclose(dout.float(), out.float(), atol=1e-2)
    assert torch.allclose(lse, dlse, rtol=1e-5)


def test_numpy_inputs_and_default_outputs():
    rng = np.random.default_rng(9)
    q, kc, vc, indptr, lengths, table = make_batch(rng, H=1, G=2, D=64, page_size=8,
                                                   counts=[4, 6], starts=[2, 0],
                                                   dtype="float32")
    args = [t.contiguous().numpy() for t in (q, kc, vc, indptr, lengths, table)]
    out, lse = ops.prefill_attention(*args)
    ref_out, ref_lse = reference_prefill(*args)
    assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[1])
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=1e-3, atol=1e-3)


def test_empty_batch_tokens():
    rng = np.random.default_rng(10)
    args = make_batch(rng, H=1, G=2, D=64, page_size=8, counts=[0, 0], starts=[3, 0],
                      dtype="float32")
    out, lse = ops.prefill_attention(*args)
    assert out.shape == (0, 2, 64) and lse.shape == (0, 2)


# -- bad input: typed errors naming the argument; nothing written ---------------------------

@pytest.fixture
def good():
    rng = np.random.default_rng(12)
    return make_batch(rng, H=2, G=2, D=64, page_size=8, counts=[3, 5], starts=[4, 0],
                      dtype="float16")


def _call_untouched(args, exc, match, **kw):
    out = torch.full_like(args[0], 7.0)
    lse = torch.full((args[0].shape[0], args[0].shape[1]), 7.0)
    kw.setdefault("out", out)
    kw.setdefault("lse", lse)
    with pytest.raises(exc, match=match):
        ops.prefill_attention(*args, **kw)
    assert (out == 7).all() and (lse == 7).all()


def test_bad_q_dtype(good):
    args = list(good)
    args[0] = args[0].float()
    with pytest.raises(DTypeMismatchError, match="q"):
        ops.prefill_attention(*args)


def test_bad_q_heads(good):
    args = list(good)
    args[0] = args[0][:, :3].contiguous()
    _call_untouched(args, InvalidArgumentError, "n_q_heads", out=None, lse=None)


def test_bad_head_dim(good):
    args = list(good)
    args[0] = args[0][..., :32].contiguous()
    _call_untouched(args, InvalidArgumentError, "head_dim", out=None, lse=None)


def test_bad_out_shape_and_dtype(good):
    q = good[0]
    _call_untouched(good, InvalidArgumentError, "out.shape",
                    out=torch.empty(q.shape[0] + 1, q.shape[1], q.shape[2], dtype=q.dtype))
    _call_untouched(good, DTypeMismatchError, "lse", lse=torch.empty(q.shape[0], q.shape[1],
                                                                    dtype=torch.float16))
    _call_untouched(good, InvalidArgumentError, "lse.shape",
                    lse=torch.empty(q.shape[0], q.shape[1] + 1))


def test_bad_indices(good):
    q, kc, vc, indptr, lengths, table = good
    bad = table.clone()
    bad[0, 0] = kc.shape[0]
    _call_untouched((q, kc, vc, indptr, lengths, bad), InvalidArgumentError, "lookup_table")
    long = lengths.clone()
    long[1] = 1000
    _call_untouched((q, kc, vc, indptr, long, table), SequenceTooLongError, "cache_lengths")
    short = indptr.clone()
    short[-1] -= 1
    _call_untouched((q, kc, vc, short, lengths, table), InvalidArgumentError, "qo_indptr")


def test_bad_scalars(good):
    _call_untouched(good, InvalidArgumentError, "sliding_window", sliding_window=0)
    _call_untouched(good, InvalidArgumentError, "sm_scale", sm_scale=float("nan"))
    _call_untouched(good, InvalidArgumentError, "layout", layout="xyz")
    # a window past the int32 kernel argument, causal other than a bool or 0/1
    _call_untouched(good, InvalidArgumentError, r"sliding_window.*2\*\*31",
                    sliding_window=2**32 + 2)
    _call_untouched(good, InvalidArgumentError, "causal", causal=5)
    _call_untouched(good, InvalidArgumentError, "check_indices", check_indices="no")


def test_bad_device_or_strides(good):
    q, kc, vc, indptr, lengths, table = good
    _call_untouched((q, kc, vc, indptr.long(), lengths, table), DTypeMismatchError,
                    "qo_indptr")
    _call_untouched((q.transpose(0, 1).contiguous().transpose(0, 1), kc, vc, indptr, lengths,
                     table), InvalidArgumentError, "q")
    if torch.cuda.is_available():
        _call_untouched((q, kc, vc, indptr.cuda(), lengths, table), DeviceMismatchError, "")
