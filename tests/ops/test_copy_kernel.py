"""The copy kernel (kvtvm.kernels.copy) through ops.copy_pages / ops.copy_slots, against the
numpy reference."""

import shutil

import numpy as np
import pytest
import torch

from kvtvm import compiler, ops
from kvtvm.ops.copy import independent_rounds
from kvtvm.errors import DTypeMismatchError, InvalidArgumentError
from kvtvm.kernels.reference import reference_copy_pages

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def as_numpy(t):
    """Bit-exact numpy view (bfloat16 as uint16)."""
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def i32(xs):
    return torch.tensor(xs, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_copy_pages_matches_reference(dtype, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    blocks = torch.randn(12, 2, 3, 5, 2, head_dim, generator=g).to(dtype)
    src, dst = [3, 7, 0, 11], [1, 2, 9, 4]
    want = reference_copy_pages(as_numpy(blocks), src, dst)
    ops.copy_pages(blocks, i32(src), i32(dst))
    assert np.array_equal(as_numpy(blocks), want)


@pytest.mark.parametrize("src,dst", [
    ([1, 2, 3], [0, 1, 2]),        # compaction chain: sequential semantics
    ([2, 4, 5, 7], [0, 1, 2, 3]),
    ([0, 1], [1, 0]),              # a swap done in order: both end as page 0's old content
    ([3, 3, 3], [0, 1, 2]),        # one source, many destinations
    ([5, 6], [5, 1]),              # a no-op copy is skipped
])
def test_copy_sequential_semantics(src, dst):
    blocks = torch.randn(8, 2, 1, 4, 1, 16)
    want = reference_copy_pages(blocks.numpy(), src, dst)
    ops.copy_pages(blocks, i32(src), i32(dst))
    assert np.array_equal(blocks.numpy(), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_slots_of_linear_cache(dtype):
    cache = torch.randn(3, 6, 2, 2, 7, 32).to(dtype)  # [L, B, 2, H, S, D]
    src, dst = [2, 4, 5], [0, 1, 2]
    want = reference_copy_pages(as_numpy(cache), src, dst, axis=1)
    ops.copy_slots(cache, i32(src), i32(dst))
    assert np.array_equal(as_numpy(cache), want)


def test_copy_unaligned_view_and_numpy_input():
    base = torch.randn(1 + 6 * 2 * 2 * 3 * 8).to(torch.float16)
    blocks = base[1:].view(6, 2, 2, 3, 8)  # starts 2 bytes past torch's 64-byte alignment
    assert blocks.data_ptr() % 64 != 0
    want = reference_copy_pages(blocks.numpy(), [0, 5], [3, 4])
    for _ in range(5):
        ops.copy_pages(blocks, i32([0, 5]), i32([3, 4]))
    assert np.array_equal(blocks.numpy(), want)
    arr = np.random.default_rng(0).standard_normal((4, 3, 16)).astype(np.float32)
    want = reference_copy_pages(arr, [2], [0])
    ops.copy_pages(arr, np.array([2], dtype=np.int32), np.array([0], dtype=np.int32))
    assert np.array_equal(arr, want)


def test_copy_slots_errors_name_its_arguments():
    """Errors name the arguments as documented (``src_slots`` / ``dst_slots``; were ``src`` /
    ``dst``) and write nothing."""
    cache = torch.randn(2, 3, 2, 1, 4, 8)  # [num_layers, max_batch_size, 2, heads, len, dim]
    before = cache.clone()
    with pytest.raises(InvalidArgumentError, match=r"dst_slots\[0\]: expected an index in \[0, 3\)"):
        ops.copy_slots(cache, i32([0]), i32([3]))
    with pytest.raises(InvalidArgumentError, match=r"src_slots rank"):
        ops.copy_slots(cache, i32([[0]]), i32([1]))
    assert torch.equal(cache, before)


def test_empty_copy_is_a_no_op():
    blocks = torch.randn(4, 8)
    before = blocks.clone()
    ops.copy_pages(blocks, i32([]), i32([]))
    assert torch.equal(blocks, before)


def test_copy_errors_write_nothing():
    blocks = torch.randn(4, 2, 8)
    before = blocks.clone()
    with pytest.raises(InvalidArgumentError, match=r"dst_pages\[1\]: expected an index in \[0, 4\)"):
        ops.copy_pages(blocks, i32([0, 1]), i32([2, 4]))
    with pytest.raises(InvalidArgumentError, match=r"src_pages\[0\]"):
        ops.copy_pages(blocks, i32([-1]), i32([2]))
    with pytest.raises(DTypeMismatchError, match="int32"):
        ops.copy_pages(blocks, torch.tensor([0]), torch.tensor([1]))
    with pytest.raises(InvalidArgumentError, match=r"dst_pages.shape\[0\]: expected 2 \(as src_pages\)"):
        ops.copy_pages(blocks, i32([0, 1]), i32([2]))
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        ops.copy_pages(blocks.transpose(0, 1), i32([0]), i32([1]))
    with pytest.raises(DTypeMismatchError):
        ops.copy_pages(blocks.to(torch.int32), i32([0]), i32([1]))
    with pytest.raises(InvalidArgumentError, match="rank"):
        ops.copy_pages(blocks, i32([[0]]), i32([[1]]))
    with pytest.raises(InvalidArgumentError, match="torch.Tensor or numpy"):
        ops.copy_pages([1, 2], i32([0]), i32([1]))
    assert torch.equal(blocks, before)


def test_independent_rounds():
    assert independent_rounds([3, 4], [0, 1]) == [([3, 4], [0, 1])]
    assert independent_rounds([1, 2, 3], [0, 1, 2]) == [([1], [0]), ([2], [1]), ([3], [2])]
    assert independent_rounds([2, 4, 5], [0, 1, 2]) == [([2, 4], [0, 1]), ([5], [2])]
    assert independent_rounds([1, 1], [1, 2]) == [([1], [2])]
    assert independent_rounds([0, 1], [2, 2]) == [([0], [2]), ([1], [2])]
    rng = np.random.default_rng(0)
    for _ in range(50):  # rounds applied in order == sequential copies
        n = int(rng.integers(1, 8))
        src, dst = rng.integers(0, 6, n).tolist(), rng.integers(0, 6, n).tolist()
        buf = np.arange(6)
        for rs, rd in independent_rounds(src, dst):
            assert not set(rd) & set(rs) and len(set(rd)) == len(rd)
            buf[rd] = buf[rs]
        assert np.array_equal(buf, reference_copy_pages(np.arange(6), src, dst))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_cuda_schedule_lowers(arch):
    import tvm

    spec = compiler.KernelSpec(op="copy", dtype="float16", head_dim=128, n_kv_heads=1,
                               target="cuda", arch=arch)
    mod = compiler.lower(spec)
    ex = tvm.compile(mod, target=spec.tvm_target())
    (cuda,) = [m for m in ex.mod.imports if m.kind == "cuda"]
    src = cuda.inspect_source()
    assert "kvtvm_copy_kernel" in src and "uint4" in src  # 16-byte vector accesses


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_binary_has_no_spills(tmp_path):
    spec = compiler.KernelSpec(op="copy", dtype="bfloat16", head_dim=128, n_kv_heads=1,
                               target="cuda", arch="sm_90a")
    path = compiler.build_spec(spec, tmp_path)
    assert compiler.fatbin_architectures(compiler.embedded_fatbin(path)) == ["sm_80", "sm_90a"]
    report = compiler.spill_report(path.with_suffix(".ptxas.txt").read_text())
    assert report
    for kernel, usage in report.items():
        assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, (kernel, usage)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_on_gpu_matches_reference(dtype):
    blocks = torch.randn(64, 2, 4, 16, 8, 128).to(dtype)
    src, dst = [1, 2, 3, 40], [0, 1, 2, 63]
    want = reference_copy_pages(as_numpy(blocks), src, dst)
    gpu = blocks.cuda()
    ops.copy_pages(gpu, i32(src), i32(dst))  # host indices: split into rounds
    assert np.array_equal(as_numpy(gpu.cpu()), want)
    cache = torch.randn(4, 8, 2, 8, 64, 128).to(dtype)
    want = reference_copy_pages(as_numpy(cache), [5, 7], [0, 1], axis=1)
    gpu = cache.cuda()
    ops.copy_slots(gpu, i32([5, 7]).cuda(), i32([0, 1]).cuda())  # device indices: one launch
    assert np.array_equal(as_numpy(gpu.cpu()), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_copy_on_gpu_rejects_unaligned_view():
    base = torch.zeros(1 + 4 * 2 * 64, dtype=torch.float16, device="cuda")
    blocks = base[1:].view(4, 2, 64)
    with pytest.raises(InvalidArgumentError, match="16-byte aligned"):
        ops.copy_pages(blocks, i32([0]), i32([1]))


def test_copy_moves_a_quantized_cache_bit_for_bit():
    """The uint8 tensor of a quantized cache (as the managers allocate it) is copied as is:
    pages (PAGED) and batch slots (LINEAR), every byte, NaN-looking words included."""
    from kvtvm import KVCacheParams

    gen = torch.Generator().manual_seed(5)
    for strategy, copy, shape_args in (("paged", ops.copy_pages, dict(num_pages=6)),
                                       ("linear", ops.copy_slots, {})):
        params = KVCacheParams("float16", 2, 64, strategy, cache_dtype="int8",
                               page_size=4 if strategy == "paged" else None)
        shape = params.cache_shape(3, 4, 8, **shape_args)
        buf = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        want = buf.numpy().copy()
        src, dst = [0, 2], [3, 1]
        axis = 0 if strategy == "paged" else 1
        for s, d in zip(src, dst):
            idx_d = [slice(None)] * want.ndim
            idx_s = [slice(None)] * want.ndim
            idx_d[axis], idx_s[axis] = d, s
            want[tuple(idx_d)] = want[tuple(idx_s)]
        copy(buf, torch.tensor(src, dtype=torch.int32), torch.tensor(dst, dtype=torch.int32))
        assert np.array_equal(buf.numpy(), want), strategy


def test_copy_refuses_a_byte_tensor_that_is_not_a_cache():
    buf = torch.zeros(4, 10, dtype=torch.uint8)
    with pytest.raises(InvalidArgumentError, match=r"blocks\.shape\[-1\]"):
        ops.copy_pages(buf, torch.tensor([0], dtype=torch.int32),
                       torch.tensor([1], dtype=torch.int32))
    assert not buf.any()
