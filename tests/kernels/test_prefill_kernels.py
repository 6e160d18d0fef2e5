"""The hand-written prefill kernels (schedules/prefill/{cpu,cuda}.py) against the family's
definition compiled unscheduled for llvm, on fresh random inputs: page sizes, GQA, ragged
batches (empty sequences, tiles spanning sequences), causal or not, sliding windows, both
token layouts. The CUDA kernels are compiled here and checked where a GPU is present."""

import math

import numpy as np
import pytest
import torch

from helpers import unscheduled_kernel as unscheduled
from kvtvm import compiler, runtime

pytestmark = pytest.mark.skipif(not runtime.compiler_available(), reason="needs TVM's compiler")


def make_inputs(rng, spec, counts, starts, page_size):
    """Random q and pages, a shuffled page table; sequence b has ``starts[b]`` cached tokens
    and adds ``counts[b]``."""
    H, G, D = spec.n_kv_heads, spec.group_size, spec.head_dim
    need = [-(-(s + c) // page_size) for s, c in zip(starts, counts)]
    num_pages = sum(need) + 1
    perm = rng.permutation(num_pages)
    table = np.full((len(counts), max(max(need), 1)), -1, np.int32)
    cursor = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[cursor:cursor + n]
        cursor += n
    dtype = getattr(torch, spec.dtype)
    shape = (num_pages, page_size, H, D) if spec.layout == "nhd" else (num_pages, H, page_size, D)
    kv = torch.from_numpy(rng.standard_normal((2, *shape)).astype(np.float32)).to(dtype)
    q = torch.from_numpy(rng.standard_normal((sum(counts), H * G, D)).astype(np.float32))
    return dict(q=q.to(dtype), k=kv[0], v=kv[1],
                indptr=torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32),
                lengths=torch.tensor(starts, dtype=torch.int32), table=torch.from_numpy(table))


def run(fn, inp, causal, window, device="cpu", flags=None):
    q = inp["q"].to(device)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=device)
    err = torch.zeros(4, dtype=torch.int32, device=device)
    fn(q, inp["k"].to(device), inp["v"].to(device), inp["indptr"].to(device),
       inp["lengths"].to(device), inp["table"].to(device), out, lse, int(causal),
       1.0 / math.sqrt(q.shape[2]), window, err)
    if flags is None:
        assert not err.any(), f"error flag set on valid input: {err.tolist()}"
    else:
        flags.append(err.cpu().tolist())
    return out.float().cpu().numpy(), lse.cpu().numpy()


SPECS = [  # dtype, head_dim, n_kv_heads, group_size, layout, features
    ("float32", 16, 2, 1, "nhd", ()),
    ("float32", 32, 1, 3, "hnd", ("sliding_window",)),
    ("float16", 16, 2, 2, "nhd", ("sliding_window",)),
]
CASES = [  # page_size, new tokens per sequence, cached tokens per sequence, causal, window
    (1, [5, 0, 9], [3, 4, 0], True, 4),
    (5, [1, 17, 2, 6], [20, 0, 7, 11], True, 9),
    (16, [12, 3], [33, 1], False, 20),
]


def _spec(dtype, head_dim, heads, group, layout, features, **kw):
    return compiler.KernelSpec(op="prefill", dtype=dtype, head_dim=head_dim, n_kv_heads=heads,
                               group_size=group, layout=layout, features=features, **kw)


@pytest.mark.parametrize("args", SPECS, ids=lambda a: f"{a[0]}-d{a[1]}-h{a[2]}g{a[3]}-{a[4]}")
@pytest.mark.parametrize("knobs", [{}, {"tile_q": 4, "tile_kv": 16, "row_block": 2,
                                        "key_block": 8}, {"tile_q": 0}],
                         ids=["default", "small", "definition"])
def test_cpu_kernel_matches_the_definition(args, knobs):
    spec = _spec(*args, knobs=knobs)
    kernel, reference = compiler.get_kernel(spec), unscheduled(_spec(*args))
    rng = np.random.default_rng(11)
    tol = 1e-2 if spec.dtype == "float16" else 1e-4
    for page_size, counts, starts, causal, window in CASES:
        inp = make_inputs(rng, spec, counts, starts, page_size)
        got_out, got_lse = run(kernel, inp, causal, window)
        ref_out, ref_lse = run(reference, inp, causal, window)
        assert np.isfinite(got_out).all() and np.isfinite(got_lse).all()
        np.testing.assert_allclose(got_out, ref_out, rtol=tol, atol=tol)
        np.testing.assert_allclose(got_lse, ref_lse, rtol=tol, atol=tol)


@pytest.mark.parametrize("kw", [dict(dtype="float16", arch="sm_90a"),
                                dict(dtype="float16", arch="sm_90a", variant="short_query"),
                                dict(dtype="bfloat16", arch="sm_80"),
                                dict(dtype="float32", arch="sm_90a")],
                         ids=["wgmma", "short_query", "mma-sm80", "simt"])
def test_cuda_kernels_compile(kw):
    """Lowered and compiled to CUDA source (nvcc and a GPU are not needed for this)."""
    import tvm

    spec = compiler.KernelSpec(op="prefill", head_dim=64, n_kv_heads=2, group_size=2,
                               target="cuda", **kw)
    with spec.tvm_target():
        built = tvm.compile(compiler.lower(spec), target=spec.tvm_target())
    (cuda,) = [m for m in built.mod.imports if m.kind == "cuda"]
    source = cuda.inspect_source()
    assert "kvtvm_prefill_kernel" in source
    assert ("wgmma." in source) == (kw["arch"] == "sm_90a" and kw["dtype"] != "float32"
                                    and "variant" not in kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", ["", "short_query"])
@pytest.mark.parametrize("args", [("float16", 64, 2, 2, "nhd", ("sliding_window",)),
                                  ("bfloat16", 128, 1, 3, "hnd", ()),
                                  ("float32", 32, 2, 1, "nhd", ())])
def test_cuda_kernels_match_the_definition(args, variant):
    target = compiler.target_for_device(torch.device("cuda"))
    kernel = compiler.get_kernel(_spec(*args, target="cuda", arch=target.arch, variant=variant))
    reference = unscheduled(_spec(*args))
    rng = np.random.default_rng(12)
    for page_size, counts, starts, causal, window in CASES:
        inp = make_inputs(rng, _spec(*args), counts, starts, page_size)
        got_out, got_lse = run(kernel, inp, causal, window, "cuda")
        ref_out, ref_lse = run(reference, inp, causal, window)
        np.testing.assert_allclose(got_out, ref_out, rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(got_lse, ref_lse, rtol=2e-2, atol=2e-2)



@pytest.mark.parametrize("bad", ["page", "negative_page", "length"])
def test_cpu_kernel_flags_bad_indices_like_the_definition(bad):
    """Out-of-range pages and lengths: the hand-written kernel sets the same error-flag
    entries as the definition (and reads nothing outside: no crash on a 2**30 page)."""
    spec = _spec(*SPECS[0])
    kernel, reference = compiler.get_kernel(spec), unscheduled(spec)
    inp = make_inputs(np.random.default_rng(11), spec, [1, 17, 2, 6], [20, 0, 7, 11], 5)
    if bad == "page":
        inp["table"][1, 0] = 2 ** 30
    elif bad == "negative_page":
        inp["table"][0, 0] = -3
    else:
        inp["lengths"][0] = 2 ** 31 - 1
    got, want = [], []
    run(kernel, inp, True, 0, flags=got)
    run(reference, inp, True, 0, flags=want)
    assert got == want and sum(got[0]) == 1, (got, want)
