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


@pytest.mark.parametrize("op", ["decode", "prefill"])
@pytest.mark.parametrize("which", ["q", "out"])
def test_misaligned_q_or_out_is_refused_before_a_vector_access(op, which):
    """A contiguous q or out one element past an aligned address: the kernels read q and write
    out in up to 16-byte vectors, a misaligned-address fault that poisons the CUDA context
    (found by reading the generated source, 2026-11-28); refused by name, nothing written."""
    from kvtvm.errors import InvalidArgumentError

    _, cache = _guarded()
    kc, vc = cache[:, 0], cache[:, 1]
    table, lengths = _i32([[1, 2], [3, 4]]), _i32([3, 5])
    rows = 2 if op == "decode" else 3

    def shifted(shape):
        flat = torch.zeros(int(torch.tensor(shape).prod()) + 1, device="cuda").half()
        return flat[1:].view(*shape)
    q = torch.randn(rows, 4 * H, D, device="cuda").half()
    kw = {}
    if which == "q":
        q = shifted(q.shape).copy_(q)
    else:
        kw["out"] = shifted(q.shape)
    with pytest.raises(InvalidArgumentError, match=which):
        if op == "decode":
            ops.decode_attention(q, kc, vc, lengths, table, **kw)
        else:
            ops.prefill_attention(q, kc, vc, _i32([0, 1, 3]), lengths, table, **kw)
    torch.cuda.synchronize()
