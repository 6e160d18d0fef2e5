"""Non-finite rows through the CUDA decode (docs/kernels.md, "a NaN/inf input row"): a NaN key
makes the output and lse of every query head that attends to it NaN, an inf value (stored as a
NaN row) their output, whatever the number of KV splits -- a split whose softmax sum is NaN is
kept, not dropped as an empty one -- and every other (sequence, head) equals the reference.
Over the kit's Llama-3-8B layer (8 KV heads x 128, GQA 4, float16 queries): the float16 cache,
int8 and e4m3 (the tensor-core kernel) and int8 K with float16 V (the CUDA-core kernel)."""

import numpy as np
import pytest

from helpers import cuda_available

H, G, D, PAGE = 8, 4, 128, 16
LENGTHS = [700, 45, 300]   # cached tokens of 3 sequences (the current one included below)
BAD_K = (0, 33, 2)         # (sequence, position, KV head) whose K holds a NaN
BAD_V = (1, 40, 5)         # ... whose V holds an inf


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("storage", ["", "int8", "float8_e4m3fn", "int8/"])
@pytest.mark.parametrize("splits", [1, 4])
def test_cuda_decode_keeps_nan_rows_poisoned(storage, splits):
    import ml_dtypes
    import torch

    from kvtvm import ops
    from kvtvm.kernels.reference import reference_decode
    from kvtvm.quant import quant_row_bytes

    rng = np.random.default_rng(5)
    ks, vs = (storage.split("/") + [storage])[:2] if storage else ("", "")
    need = [-(-(n + 1) // PAGE) for n in LENGTHS]
    pages = sum(need) + 1
    table = np.full((3, max(need)), 0, np.int32)
    perm, at = rng.permutation(pages), 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at:at + n]
        at += n

    def cache(st):
        if st:
            return torch.zeros(pages, PAGE, H, quant_row_bytes(D), dtype=torch.int8,
                               device="cuda").view(getattr(torch, st))
        return torch.zeros(pages, PAGE, H, D, dtype=torch.float16, device="cuda")

    kc, vc = cache(ks), cache(vs)
    total = sum(n + 1 for n in LENGTHS)
    k = torch.from_numpy(rng.standard_normal((total, H, D)).astype(np.float32)).half().cuda()
    v = torch.from_numpy(rng.standard_normal((total, H, D)).astype(np.float32)).half().cuda()
    starts = np.concatenate([[0], np.cumsum([n + 1 for n in LENGTHS])])
    k[starts[BAD_K[0]] + BAD_K[1], BAD_K[2], 7] = float("nan")
    v[starts[BAD_V[0]] + BAD_V[1], BAD_V[2], 0] = float("inf")
    indptr = torch.tensor(starts, dtype=torch.int32, device="cuda")
    tab = torch.from_numpy(table).cuda()
    ops.append_kv(kc, vc, k, v, indptr, torch.zeros(3, dtype=torch.int32, device="cuda"), tab)
    q = torch.from_numpy(rng.standard_normal((3, H * G, D)).astype(np.float32)).half().cuda()
    lengths = torch.tensor(LENGTHS, dtype=torch.int32, device="cuda")
    out, lse = ops.decode_attention(q, kc, vc, lengths, tab, num_splits=splits)
    ops.check()

    def host(t):
        if t.element_size() != 1:
            return t.float().cpu().numpy()
        raw = t.view(torch.uint8).cpu().numpy()
        return raw.view(np.int8 if t.dtype == torch.int8 else ml_dtypes.float8_e4m3fn)

    want, want_lse = reference_decode(q.float().cpu().numpy(), host(kc), host(vc),
                                      np.array(LENGTHS), table)
    got, got_lse = out.float().cpu().numpy(), lse.cpu().numpy()
    hk = slice(BAD_K[2] * G, BAD_K[2] * G + G)
    hv = slice(BAD_V[2] * G, BAD_V[2] * G + G)
    # the reference's rule (an 8-bit inf row is a NaN row; a float16 one keeps its inf)
    assert np.isnan(want[BAD_K[0], hk]).all() and np.isnan(want_lse[BAD_K[0], hk]).all()
    assert (~np.isfinite(want[BAD_V[0], hv])).any(axis=-1).all()
    assert np.isfinite(want_lse[BAD_V[0], hv]).all()
    assert np.isfinite(want[2]).all() and np.isfinite(want_lse[2]).all()
    np.testing.assert_array_equal(~np.isfinite(got), ~np.isfinite(want))
    np.testing.assert_array_equal(~np.isfinite(got_lse), ~np.isfinite(want_lse))
    ok = np.isfinite(want)
    np.testing.assert_allclose(got[ok], want[ok], atol=4e-3, rtol=0)
    ok = np.isfinite(want_lse)
    np.testing.assert_allclose(got_lse[ok], want_lse[ok], atol=1e-3, rtol=1e-4)
