"""The hand-written decode kernels (schedules/decode/{cpu,cuda}.py) against the family's
definition compiled unscheduled for llvm, on fresh random inputs: page sizes, GQA, ragged
lengths, KV splits, sliding windows, both token layouts. The CUDA kernel is compiled here and
checked where a GPU is present."""

import math

import numpy as np
import pytest
import torch

from helpers import random_page_table
from helpers import unscheduled_kernel as unscheduled
from kvtvm import compiler, runtime

pytestmark = pytest.mark.skipif(not runtime.compiler_available(), reason="needs TVM's compiler")


def make_inputs(rng, spec, lengths, page_size, num_splits):
    """Random q, pages (strided views of one tensor), a shuffled page table."""
    H, G, D = spec.n_kv_heads, spec.group_size, spec.head_dim
    table, num_pages = random_page_table(rng, lengths, page_size, spare=2, fill=-1,
                                         extra_columns=1)
    dtype = getattr(torch, spec.dtype)
    shape = (num_pages, page_size, H, D) if spec.layout == "nhd" else (num_pages, H, page_size, D)
    kv = torch.from_numpy(rng.standard_normal((2, *shape)).astype(np.float32)).to(dtype)
    q = torch.from_numpy(rng.standard_normal((len(lengths), H * G, D)).astype(np.float32)).to(dtype)
    return dict(q=q, k=kv[0], v=kv[1], lengths=torch.tensor(lengths, dtype=torch.int32),
                table=torch.from_numpy(table), splits=num_splits)


def run(fn, inp, window, device="cpu", flags=None):
    q = inp["q"].to(device)
    batch, hq, d = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch, hq), float("nan"), device=device)
    o_part = torch.zeros((inp["splits"], batch, hq, d), device=device)
    lse_part = torch.zeros((inp["splits"], batch, hq), device=device)
    err = torch.zeros(4, dtype=torch.int32, device=device)
    fn(q, inp["k"].to(device), inp["v"].to(device), inp["lengths"].to(device),
       inp["table"].to(device), out, lse, o_part, lse_part, 1.0 / math.sqrt(d), window, err)
    if flags is None:
        assert not err.any(), f"error flag set on valid input: {err.tolist()}"
    else:
        flags.append(err.cpu().tolist())
    return out.float().cpu().numpy(), lse.cpu().numpy()


SPECS = [  # dtype, head_dim, n_kv_heads, group_size, layout, features
    ("float32", 16, 2, 2, "nhd", ()),
    ("float32", 32, 1, 4, "hnd", ("sliding_window",)),
    ("float16", 16, 2, 1, "nhd", ()),
]
CASES = [  # page_size, lengths (cached before this step), num_splits, window
    (1, [0, 5, 17], 1, 0),
    (4, [3, 40, 0, 9], 3, 7),
    (16, [63, 1, 30], 2, 1),
]


def _spec(dtype, head_dim, heads, group, layout, features, **kw):
    return compiler.KernelSpec(op="decode", dtype=dtype, head_dim=head_dim, n_kv_heads=heads,
                               group_size=group, layout=layout, features=features, **kw)


@pytest.mark.parametrize("args", SPECS, ids=lambda a: f"{a[0]}-d{a[1]}-h{a[2]}g{a[3]}-{a[4]}")
@pytest.mark.parametrize("knobs", [{}, {"tile_tokens": 8, "vector_bytes": 16, "head_block": 1},
                                   {"parallel": False}], ids=["default", "small", "serial"])
def test_cpu_kernel_matches_the_definition(args, knobs):
    spec = _spec(*args, knobs=knobs)
    kernel, reference = compiler.get_kernel(spec), unscheduled(_spec(*args))
    rng = np.random.default_rng(7)
    tol = 1e-2 if spec.dtype == "float16" else 1e-4
    for page_size, lengths, splits, window in CASES:
        inp = make_inputs(rng, spec, lengths, page_size, splits)
        got_out, got_lse = run(kernel, inp, window)
        ref_out, ref_lse = run(reference, inp, window)
        assert np.isfinite(got_out).all() and np.isfinite(got_lse).all()
        np.testing.assert_allclose(got_out, ref_out, rtol=tol, atol=tol)
        np.testing.assert_allclose(got_lse, ref_lse, rtol=tol, atol=tol)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_cuda_kernel_compiles(arch):
    """Lowered and compiled to CUDA source (nvcc and a GPU are not needed for this)."""
    import tvm

    spec = _spec("float16", 64, 2, 4, "nhd", ("sliding_window",), target="cuda", arch=arch)
    with spec.tvm_target():
        built = tvm.compile(compiler.lower(spec), target=spec.tvm_target())
    (cuda,) = [m for m in built.mod.imports if m.kind == "cuda"]
    source = cuda.inspect_source()
    assert "kvtvm_decode_kernel" in source and "cp.async" in source


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("args", [("float16", 64, 2, 4, "nhd", ()),
                                  ("bfloat16", 128, 1, 3, "hnd", ("sliding_window",))])
def test_cuda_kernel_matches_the_definition(args):
    target = compiler.target_for_device(torch.device("cuda"))
    kernel = compiler.get_kernel(_spec(*args, target="cuda", arch=target.arch))
    reference = unscheduled(_spec(*args))
    rng = np.random.default_rng(8)
    for page_size, lengths, splits, window in CASES:
        inp = make_inputs(rng, _spec(*args), lengths, page_size, splits)
        got_out, got_lse = run(kernel, inp, window, "cuda")
        ref_out, ref_lse = run(reference, inp, window)
        np.testing.assert_allclose(got_out, ref_out, rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(got_lse, ref_lse, rtol=2e-2, atol=2e-2)



@pytest.mark.parametrize("bad", ["page", "negative_page", "length"])
def test_cpu_kernel_flags_bad_indices_like_the_definition(bad):
    """Out-of-range pages and lengths: the hand-written kernel sets the same error-flag
    entries as the definition (and reads nothing outside: no crash on a 2**30 page)."""
    spec = _spec(*SPECS[0])
    kernel, reference = compiler.get_kernel(spec), unscheduled(spec)
    inp = make_inputs(np.random.default_rng(11), spec, [3, 40, 0, 9], 4, 3)
    if bad == "page":
        inp["table"][1, 0] = 2 ** 30
    elif bad == "negative_page":
        inp["table"][0, 0] = -3
    else:
        inp["lengths"][0] = 2 ** 31 - 1
    got, want = [], []
    run(kernel, inp, 0, flags=got)
    run(reference, inp, 0, flags=want)
    assert got == want and sum(got[0]) == 1, (got, want)
