"""CUDA decode at head shapes off the common grid: heads that are not a power of two (a score is
reduced over a power of two of lanes of 3 or 5 16-byte vectors each, or, 8-bit, of 3, 5 or 7
int32 words of codes: head_dim 112 and 8-bit 48 reduced across row groups before and gave wrong
output on an H100) and the shapes whose layout
``fit_row_groups`` refits (fewer row groups or shorter K/V tiles, to stay within 1024 threads
and 48 KiB of static shared memory); full precision and 8-bit caches, against the numpy
reference over random pages. The kernels come
prebuilt (tools/gpu-kit.sh builds these shapes); the GPU machine has no compiler."""

import numpy as np
import pytest
from helpers import random_page_table

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: (storage, head_dim, group_size): "" is a float16 cache. Keep in step with tools/gpu-kit.sh.
SHAPES = [("", 96, 3), ("", 80, 4), ("", 160, 2), ("", 256, 4), ("", 256, 8), ("", 64, 16),
          ("int8", 64, 16), ("int8", 256, 4), ("int8", 256, 8),
          ("float8_e4m3fn", 64, 16), ("float8_e4m3fn", 256, 8),
          # 8-bit heads of 48, 80, 96, 112 (refused until 2026-11-28; now on the tensor cores,
          # V's last 32-column group zero-padded at 48, 80, 112)
          ("int8", 48, 4), ("float8_e4m3fn", 80, 2), ("int8", 96, 4),
          ("float8_e4m3fn", 96, 8), ("int8", 112, 2),
          # GQA 8 at 112 / 80 / 48 (the CUDA cores' head parts, which an H200 passed here on
          # 2026-11-28 before these moved to the tensor cores), and d16 on the CUDA cores,
          # laid out 128 row groups along threadIdx.z until capped at CUDA's 64
          ("int8", 112, 8), ("float8_e4m3fn", 80, 8), ("int8", 48, 8), ("int8", 16, 1),
          # GQA past 8 on the tensor cores, in two CTAs a KV head (2026-11-28; the CUDA-core
          # kernel ran GQA 16 at 0.59-0.76x the float16 cache): 6 + 6, and 5 + 4 query heads;
          # past 16 in more CTAs (twenty-second session, not yet run on a GPU): 4 x 8, 7 + 7 + 6
          ("int8", 128, 12), ("float8_e4m3fn", 64, 9), ("int8", 128, 32),
          ("float8_e4m3fn", 64, 20)]
H = 2  # KV heads


def _cache(rng, storage, shape):
    from kvtvm.quant import quantize_rows

    x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.1, 4, shape[:1] + (1,) * 3)
    if not storage:
        return torch.from_numpy(x).to(torch.float16).cuda()
    rows = torch.from_numpy(quantize_rows(x, storage).view(np.int8))
    return rows.cuda().view(getattr(torch, storage))


def _host(t, storage):
    if not storage:
        return t.float().cpu().numpy()
    import ml_dtypes

    return t.view(torch.uint8).cpu().numpy().view(
        np.int8 if storage == "int8" else ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize("storage,D,G", SHAPES, ids=lambda v: str(v) or "fp16")
@pytest.mark.parametrize("page_size,num_splits", [(16, 1), (5, 3)])
def test_refitted_decode_layouts_match_the_reference(storage, D, G, page_size, num_splits):
    from kvtvm import ops
    from kvtvm.kernels.reference import reference_decode

    rng = np.random.default_rng(D * 100 + G)
    lengths = [0, 1, 2 * page_size - 1, 333]
    table, num_pages = random_page_table(rng, lengths, page_size, spare=3)
    kc, vc = (_cache(rng, storage, (num_pages, page_size, H, D)) for _ in range(2))
    q = torch.from_numpy(rng.standard_normal((len(lengths), H * G, D), np.float32)).to(
        torch.float16).cuda()
    lens = torch.tensor(lengths, dtype=torch.int32)
    out, lse = ops.decode_attention(q, kc, vc, lens.cuda(), torch.from_numpy(table).cuda(),
                                    num_splits=num_splits)
    want, want_lse = reference_decode(q.float().cpu().numpy(), _host(kc, storage),
                                      _host(vc, storage), lens.numpy(), table)
    # float16 output: half an ulp of the value on top (an output of 16 is rounded by 2**-7;
    # q drawn from torch's unseeded generator once met that under memcheck, 2026-11-28)
    np.testing.assert_allclose(out.float().cpu().numpy(), want, atol=4e-3, rtol=2.0 ** -10)
    np.testing.assert_allclose(lse.cpu().numpy(), want_lse, atol=1e-3, rtol=1e-4)
