"""Non-finite rows through the CUDA decode (docs/kernels.md, "a NaN/inf input row"): a NaN key
makes the output and lse of every query head that attends to it NaN, an inf value (stored as a
NaN row) their output, whatever the number of KV splits -- a split whose softmax sum is NaN is
kept, not dropped as an empty one -- and every other (sequence, head) equals the reference.
Over the kit's Llama-3-8B layer (8 KV heads x 128, GQA 4, float16 queries): the float16 cache,
int8 and e4m3 (the tensor-core kernel) and int8 K with float16 V (the CUDA-core kernel). A
query whose every score is -inf (a full-precision key holding -inf) gets NaN out and lse, in the
decode and in the prefill, as on the CPU and in the reference."""

import numpy as np
import pytest

from helpers import gpu, random_page_table

H, G, D, PAGE = 8, 4, 128, 16
LENGTHS = [700, 45, 300]   # cached tokens of 3 sequences (the current one included below)
BAD_K = (0, 33, 2)         # (sequence, position, KV head) whose K holds a NaN
BAD_V = (1, 40, 5)         # ... whose V holds an inf


def _decode(storage, splits, lengths, edit, positive_q=False):
    """Append random float16 rows for ``lengths`` (+1: the current token) into a cache of
    ``storage`` ("" float16, "int8", "int8/": K int8 and V float16, "/x": V only), after
    ``edit(k, v, starts)`` (global row indices); decode; return (got, got_lse, want, want_lse)."""
    import ml_dtypes
    import torch

    from kvtvm import ops
    from kvtvm.kernels.reference import reference_decode
    from kvtvm.quant import quant_row_bytes

    rng = np.random.default_rng(5)
    ks, vs = (storage.split("/") + [storage])[:2] if storage else ("", "")
    table, pages = random_page_table(rng, lengths, PAGE, spare=1)

    def cache(st):
        if st:
            return torch.zeros(pages, PAGE, H, quant_row_bytes(D), dtype=torch.int8,
                               device="cuda").view(getattr(torch, st))
        return torch.zeros(pages, PAGE, H, D, dtype=torch.float16, device="cuda")

    kc, vc = cache(ks), cache(vs)
    total = sum(n + 1 for n in lengths)
    k = torch.from_numpy(rng.standard_normal((total, H, D)).astype(np.float32)).half().cuda()
    v = torch.from_numpy(rng.standard_normal((total, H, D)).astype(np.float32)).half().cuda()
    starts = np.concatenate([[0], np.cumsum([n + 1 for n in lengths])])
    edit(k, v, starts)
    indptr = torch.tensor(starts, dtype=torch.int32, device="cuda")
    tab = torch.from_numpy(table).cuda()
    zero = torch.zeros(len(lengths), dtype=torch.int32, device="cuda")
    ops.append_kv(kc, vc, k, v, indptr, zero, tab)
    q = rng.standard_normal((len(lengths), H * G, D)).astype(np.float32)
    q = torch.from_numpy(np.abs(q) if positive_q else q).half().cuda()
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = ops.decode_attention(q, kc, vc, lens, tab, num_splits=splits)
    ops.check()

    def host(t):
        if t.element_size() != 1:
            return t.float().cpu().numpy()
        raw = t.view(torch.uint8).cpu().numpy()
        return raw.view(np.int8 if t.dtype == torch.int8 else ml_dtypes.float8_e4m3fn)

    with np.errstate(all="ignore"):
        want, want_lse = reference_decode(q.float().cpu().numpy(), host(kc), host(vc),
                                          np.array(lengths), table)
    return out.float().cpu().numpy(), lse.cpu().numpy(), want, want_lse


def _same(got, got_lse, want, want_lse, tol=4e-3):
    """Equal NaN and non-finite masks; finite values within ``tol`` (float16's by default)."""
    np.testing.assert_array_equal(~np.isfinite(got), ~np.isfinite(want))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isnan(got_lse), np.isnan(want_lse))
    np.testing.assert_array_equal(~np.isfinite(got_lse), ~np.isfinite(want_lse))
    ok = np.isfinite(want)
    np.testing.assert_allclose(got[ok], want[ok], atol=tol, rtol=0)
    ok = np.isfinite(want_lse)
    np.testing.assert_allclose(got_lse[ok], want_lse[ok], atol=1e-3, rtol=1e-4)


@gpu
@pytest.mark.parametrize("storage", ["", "int8", "float8_e4m3fn", "int8/"])
@pytest.mark.parametrize("splits", [1, 4])
def test_cuda_decode_keeps_nan_rows_poisoned(storage, splits):
    def edit(k, v, starts):
        k[starts[BAD_K[0]] + BAD_K[1], BAD_K[2], 7] = float("nan")
        v[starts[BAD_V[0]] + BAD_V[1], BAD_V[2], 0] = float("inf")

    got, got_lse, want, want_lse = _decode(storage, splits, LENGTHS, edit)
    hk = slice(BAD_K[2] * G, BAD_K[2] * G + G)
    hv = slice(BAD_V[2] * G, BAD_V[2] * G + G)
    # the reference's rule (an 8-bit inf row is a NaN row; a float16 one keeps its inf)
    assert np.isnan(want[BAD_K[0], hk]).all() and np.isnan(want_lse[BAD_K[0], hk]).all()
    assert (~np.isfinite(want[BAD_V[0], hv])).any(axis=-1).all()
    assert np.isfinite(want_lse[BAD_V[0], hv]).all()
    assert np.isfinite(want[2]).all() and np.isfinite(want_lse[2]).all()
    if storage.endswith("/"):
        # a float16 V holding inf: the reference's inf may come out NaN where the tensor-core
        # decode weighs it by P's float16 high part plus its rounding error (a negative or
        # zero low part times inf): non-finite either way, never finite (docs/kernels.md)
        bad = (BAD_V[0], hv, 0)  # the inf sits in channel 0
        assert (~np.isfinite(got[bad])).all()
        got, want = got.copy(), want.copy()
        got[bad] = want[bad] = np.inf
    _same(got, got_lse, want, want_lse)


@gpu
@pytest.mark.parametrize("storage", ["", "/float8_e4m3fn"])
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_cuda_decode_whose_every_score_is_minus_inf_is_nan(storage, splits):
    """A float16 key holding -inf, with positive queries, scores -inf. Sequence 0 sees only that
    key (length 0): NaN out and lse for its KV head's queries, at any split count (the CUDA
    kernels gave lse -inf with one split and 0 with several: an all -inf split was merged as an
    empty one). Sequence 1 sees it beside 200 finite scores: weight 0, a finite result."""
    def edit(k, v, starts):
        k[starts[0], 3, 0] = -float("inf")
        k[starts[1] + 17, 6, 5] = -float("inf")

    got, got_lse, want, want_lse = _decode(storage, splits, [0, 200, 45], edit, positive_q=True)
    assert np.isnan(want[0, 3 * G:4 * G]).all() and np.isnan(want_lse[0, 3 * G:4 * G]).all()
    assert np.isfinite(np.delete(want_lse, np.s_[3 * G:4 * G], axis=1)[0]).all()
    assert np.isfinite(want[1:]).all() and np.isfinite(want_lse[1:]).all()
    _same(got, got_lse, want, want_lse)


@gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])   # the tensor-core and simt kernels
def test_cuda_prefill_whose_every_score_is_minus_inf_is_nan(dtype):
    """Prefill over a cache (2 KV heads x 128, GQA 4, page 16) whose key 0 holds -inf at KV head
    1, positive queries: the first new token of sequence 0 sees only that key, so its head 1
    queries get NaN out and lse (the CUDA prefills gave lse -inf); its later tokens, and
    sequence 1 (a -inf key among 40), are finite and equal the reference -- except the KV head 0
    queries of sequence 1, which see a NaN key: NaN out and lse."""
    import torch

    from kvtvm import ops
    from kvtvm.kernels.reference import reference_prefill

    rng = np.random.default_rng(8)
    h, g = 2, 4
    cached, new = [0, 35], [3, 5]
    table, pages = random_page_table(rng, [c + n - 1 for c, n in zip(cached, new)], PAGE)
    kc = rng.standard_normal((pages, PAGE, h, D)).astype(np.float32)
    vc = rng.standard_normal((pages, PAGE, h, D)).astype(np.float32)
    kc[table[0, 0], 0, 1, 9] = -np.inf
    kc[table[1, 0], 4, 1, 2] = -np.inf
    kc[table[1, 1], 3, 0, 5] = np.nan                      # sequence 1, position 19, KV head 0
    q = np.abs(rng.standard_normal((sum(new), h * g, D))).astype(np.float32)
    torch_dtype = getattr(torch, dtype)
    kc_, vc_, q_ = (torch.from_numpy(a).to(torch_dtype) for a in (kc, vc, q))
    indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    with np.errstate(all="ignore"):
        want, want_lse = reference_prefill(q_.float().numpy(), kc_.float().numpy(),
                                           vc_.float().numpy(), indptr,
                                           np.array(cached, np.int32), table)
    out, lse = ops.prefill_attention(q_.cuda(), kc_.cuda(), vc_.cuda(),
                                     torch.from_numpy(indptr).cuda(),
                                     torch.tensor(cached, dtype=torch.int32, device="cuda"),
                                     torch.from_numpy(table).cuda())
    ops.check()
    assert np.isnan(want[0, g:2 * g]).all() and np.isnan(want_lse[0, g:2 * g]).all()
    assert np.isnan(want[3:, :g]).all() and np.isnan(want_lse[3:, :g]).all()
    assert np.isfinite(want_lse[1:3]).all() and np.isfinite(want_lse[3:, g:]).all()
    assert np.isfinite(want_lse[0, :g]).all()
    tol = 4e-3 if dtype == "float16" else 1e-4
    _same(out.float().cpu().numpy(), lse.cpu().numpy(), want, want_lse, tol)
