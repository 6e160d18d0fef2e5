"""In-kernel bounds checks on the GPU (tools/gpu-check.sh and tools/gpu-memcheck.sh run these,
the latter under compute-sanitizer memcheck): unchecked calls with out-of-range indices return
without synchronizing, touch nothing outside their tensors, and the next ``kvtvm.ops.check()``
(or checked call) reports them once."""

import pytest
import torch

from kvtvm import ops
from kvtvm.errors import KernelIndexError

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

P, PS, H, D, GUARD = 8, 16, 8, 128, 2


def _guarded(dtype=torch.float16):
    whole = torch.randn(P + 2 * GUARD, 2, PS, H, D, device="cuda").to(dtype)
    return whole, whole[GUARD:GUARD + P]


def _i32(x):
    return torch.tensor(x, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("op", ["append", "decode", "prefill", "copy"])
@pytest.mark.parametrize("bad", ["page", "length"])
def test_unchecked_gpu_calls_skip_flag_and_report_at_check(op, bad):
    ops.check()  # nothing pending from earlier tests
    whole, cache = _guarded()
    before = whole.clone()
    kc, vc = cache[:, 0], cache[:, 1]
    table = _i32([[1, 2], [3, 4]])
    lengths = _i32([3, 5])
    if bad == "page":
        table[1, 1] = 2 ** 30
        lengths = _i32([3, 20])
    else:
        lengths = _i32([3, 2 ** 31 - 1])
    if op == "append":
        k = torch.randn(4, H, D, device="cuda").half()
        ops.append_kv(kc, vc, k, k, _i32([0, 2, 4]), lengths, table, check_indices=False)
    elif op == "decode":
        ops.decode_attention(torch.randn(2, 4 * H, D, device="cuda").half(), kc, vc, lengths,
                             table, check_indices=False)
    elif op == "prefill":
        ops.prefill_attention(torch.randn(3, 4 * H, D, device="cuda").half(), kc, vc,
                              _i32([0, 1, 3]), lengths, table, check_indices=False)
    else:
        ops.copy_pages(cache, _i32([1]), _i32([2 ** 30 if bad == "page" else -1]),
                       check_indices=False)
    with pytest.raises(KernelIndexError):
        ops.check()
    ops.check()  # reported once: the flag was cleared
    torch.cuda.synchronize()
    assert torch.equal(whole[:GUARD], before[:GUARD])
    assert torch.equal(whole[-GUARD:], before[-GUARD:])
