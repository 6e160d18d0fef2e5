"""The CPU decode over 8-bit and 16-bit caches (schedules/decode/cpu.py with software prefetch
of the next tile's K rows and the tile's V rows, per side) against the numpy reference over the reference-dequantized cache,
on fresh random inputs (the seed is in the failure message), for the knob values that change
its loops (tile, lanes, head block, prefetch off or into L1), ragged lengths that end mid-tile and
at the end of the next tile's prefetch, sliding windows, splits, GQA 1-8, page sizes 1/16/48,
and a page outside the cache (left out, flagged, the other sequences untouched)."""

import math

import numpy as np
import pytest
import torch

from kvtvm import compiler, runtime
from kvtvm.kernels.reference import reference_decode
from kvtvm.quant import quantize_rows
from helpers import numpy_of as _np

pytestmark = pytest.mark.skipif(not runtime.compiler_available(), reason="needs TVM's compiler")

# (k storage, v storage, dtype, layout, H, G, D, knobs)
CASES = [
    ("int8", "int8", "float32", "nhd", 2, 4, 128, {}),
    ("float8_e4m3fn", "float8_e4m3fn", "float16", "hnd", 1, 8, 64, {"tile_tokens": 64}),
    ("int8", "float8_e4m3fn", "float32", "nhd", 2, 1, 64,
     {"tile_tokens": 16, "vector_bytes": 32, "head_block": 1}),
    ("int8", "", "bfloat16", "hnd", 2, 2, 128, {"tile_tokens": 8}),  # K-only: both prefetched
    ("int8", "int8", "float16", "nhd", 2, 4, 64, {"prefetch": False}),
    ("", "int8", "float32", "nhd", 2, 4, 128, {"prefetch_locality": 3}),  # V's rows only
    # full precision: float16 / bfloat16 rows are prefetched too (float32 rows are not)
    ("", "", "float16", "nhd", 4, 2, 128, {}),
    ("", "", "bfloat16", "hnd", 2, 4, 64, {"tile_tokens": 16, "prefetch_locality": 3}),
]
TOL = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}
#: plus the rounding of the output to its dtype (values up to ~10 here)
RTOL = {"float32": 0, "float16": 1e-3, "bfloat16": 8e-3}


def _side(rng, storage, dtype, shape):
    x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.05, 4, shape[:-1] + (1,))
    if not storage:
        return torch.from_numpy(x).to(getattr(torch, dtype))
    return torch.from_numpy(quantize_rows(x, storage).view(np.int8)).view(getattr(torch, storage))


def _int8(t):
    return t.view(torch.int8) if t.element_size() == 1 else t


@pytest.mark.parametrize("ks,vs,dtype,layout,H,G,D,knobs", CASES,
                         ids=lambda c: str(c) if not isinstance(c, dict) else "-".join(f"{k}{v}" for k, v in c.items()))
def test_tiled_quantized_decode_equals_the_reference(ks, vs, dtype, layout, H, G, D, knobs):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    spec = compiler.KernelSpec("decode", dtype, D, H, G, layout, features=("sliding_window",),
                               knobs=knobs, k_storage=ks, v_storage=vs)
    kernel = compiler.get_kernel(spec)
    page_size = int(rng.choice([1, 16, 48]))
    lengths = [0, 15, 16, 17, 95, int(rng.integers(100, 300))]  # cached before this step
    need = [-(-(n + 1) // page_size) for n in lengths]
    pages = sum(need) + 2
    perm, table, cur = rng.permutation(pages), np.full((len(lengths), max(need) + 1), -1,
                                                        np.int32), 0
    for b, n in enumerate(need):
        table[b, :n], cur = perm[cur:cur + n], cur + n
    shape = (pages, page_size, H) if layout == "nhd" else (pages, H, page_size)
    kc, vc = _side(rng, ks, dtype, shape + (D,)), _side(rng, vs, dtype, shape + (D,))
    q = torch.from_numpy(rng.standard_normal((len(lengths), H * G, D)).astype(np.float32)).to(
        getattr(torch, dtype))
    lengths_t = torch.tensor(lengths, dtype=torch.int32)
    for splits, window in ((1, 0), (3, 0), (1, 40), (2, 7)):
        want, want_lse = reference_decode(_np(q), _np(kc), _np(vc), lengths, table,
                                          layout=layout, sliding_window=window)
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:2], float("nan"))
        o_part, lse_part = torch.zeros((splits,) + q.shape), torch.zeros((splits,) + q.shape[:2])
        err = torch.zeros(4, dtype=torch.int32)
        kernel(q, _int8(kc), _int8(vc), lengths_t, torch.from_numpy(table), out, lse, o_part,
               lse_part, 1.0 / math.sqrt(D), window, err)
        assert not err.any(), (seed, err.tolist())
        np.testing.assert_allclose(out.float().numpy(), want, atol=TOL[dtype], rtol=RTOL[dtype],
                                   err_msg=f"seed {seed} splits {splits} window {window}")
        np.testing.assert_allclose(lse.numpy(), want_lse, atol=1e-4, rtol=1e-5,
                                   err_msg=f"seed {seed}")
    # a page outside the cache in sequence 4: its tokens are left out and flagged; the other
    # sequences are untouched
    bad = table.copy()
    bad[4, 1] = pages + 5
    out, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:2], float("nan"))
    err = torch.zeros(4, dtype=torch.int32)
    kernel(q, _int8(kc), _int8(vc), lengths_t, torch.from_numpy(bad), out, lse,
           torch.zeros((1,) + q.shape), torch.zeros((1,) + q.shape[:2]), 1.0 / math.sqrt(D), 0,
           err)
    assert err.any(), seed
    want, _ = reference_decode(_np(q), _np(kc), _np(vc), lengths, table, layout=layout)
    keep = [0, 1, 2, 3, 5]
    np.testing.assert_allclose(out.float().numpy()[keep], want[keep], atol=TOL[dtype], rtol=RTOL[dtype],
                               err_msg=f"seed {seed}")
    # sequence 4 equals attention over the tokens of its other pages (keys are unordered in
    # decode: its pages but page 1, in order, hold them)
    n4 = sum(1 for p in range(lengths[4] + 1) if p // page_size != 1)
    sub = np.full((1, table.shape[1]), -1, np.int32)
    kept = [table[4, j] for j in range(need[4]) if j != 1]
    sub[0, :len(kept)] = kept
    want4, _ = reference_decode(_np(q)[4:5], _np(kc), _np(vc), [n4 - 1], sub, layout=layout)
    np.testing.assert_allclose(out.float().numpy()[4:5], want4, atol=TOL[dtype], rtol=RTOL[dtype],
                               err_msg=f"seed {seed}")


@pytest.mark.parametrize("locality", [4, -1, True, "2"])
def test_a_prefetch_locality_llvm_has_not_is_refused(locality):
    spec = compiler.KernelSpec("decode", "float16", 64, 2, 2, "nhd",
                               knobs={"prefetch_locality": locality})
    from kvtvm.errors import InvalidArgumentError  # (typed: it was a bare ValueError)

    with pytest.raises(InvalidArgumentError, match="prefetch_locality"):
        compiler.lower(spec)
