"""Helpers shared by tests in several folders (tests/conftest.py puts tests/ on sys.path, so
any test imports them as ``from helpers import ...``)."""

import functools
import subprocess
import sys

import numpy as np


def run_python(code, *args, env=None, timeout=300):
    """``python -c code *args`` in a fresh process; asserts it exited 0 and returns its
    stdout (a fresh process: what it loads is what a runtime-only user would load)."""
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def run_step(mgr, batch, qkv, planned):
    """One model step through ``mgr``: fetch ``batch``, then append + attention for every
    layer (``qkv`` is ``[(q, k, v)]`` per layer), either through the plain ops or through one
    ``kvtvm.plan.plan_step``; then ``step``. Returns ``[(out, lse)]`` per layer."""
    from kvtvm import ops, plan

    (inp,) = mgr.fetch(batch)
    results = []
    p = plan.plan_step(inp) if planned else None
    for layer, (q, k, v) in enumerate(qkv):
        if planned:
            p.append_kv(layer, k, v)
            results.append(p.attention(layer, q))
        else:
            kc, vc = inp.k_cache(layer), inp.v_cache(layer)
            ops.append_kv(kc, vc, k, v, inp.qo_indptr, inp.cache_lengths, inp.lookup_table)
            n = int(inp.qo_indptr_host[-1])
            if n == inp.batch_size:
                results.append(ops.decode_attention(q, kc, vc, inp.cache_lengths,
                                                    inp.lookup_table))
            else:
                results.append(ops.prefill_attention(q, kc, vc, inp.qo_indptr,
                                                     inp.cache_lengths, inp.lookup_table))
    mgr.step(batch)
    return results


#: prefill_attention tolerances against the float64 reference, per dtype
TOL = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 1e-2}


def make_prefill_batch(rng, *, H, G, D, page_size, counts, starts, layout="nhd", dtype="float16",
                       extra_pages=3, num_layers=2, layer=1):
    """Random per-layer K/V views of a manager-shaped cache, handed out in permuted pages, and
    a ragged batch of queries. The cache already holds every sequence's prefix and new tokens
    (append ran before attention)."""
    import torch

    from kvtvm.params import torch_dtype

    tdt = torch_dtype(dtype)
    final = [s + n for s, n in zip(starts, counts)]
    n_pages = [-(-f // page_size) for f in final]
    num_pages = sum(n_pages) + extra_pages
    perm = rng.permutation(num_pages)
    table = np.full((len(final), max(1, max(n_pages))), -1, np.int32)
    cursor = 0
    for b, n in enumerate(n_pages):
        table[b, :n] = perm[cursor:cursor + n]
        cursor += n
    if layout == "nhd":
        cache = torch.randn(num_pages, 2, num_layers, page_size, H, D).to(tdt)
        kc, vc = cache[:, 0, layer], cache[:, 1, layer]
    else:
        cache = torch.randn(num_layers, num_pages, 2, H, page_size, D).to(tdt)
        kc, vc = cache[layer, :, 0], cache[layer, :, 1]
    q = torch.randn(sum(counts), H * G, D).to(tdt)
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32)
    lengths = torch.tensor(starts, dtype=torch.int32)
    return q, kc, vc, indptr, lengths, torch.from_numpy(table)


@functools.lru_cache(maxsize=None)
def unscheduled_kernel(spec):
    """The family definition of ``spec`` as written (no schedule), compiled for llvm: what
    tests/kernels compares the hand-written schedules with."""
    import importlib

    import tvm

    family = importlib.import_module(f"kvtvm.kernels.{spec.op}")
    func = family.define(spec).with_attr("global_symbol", spec.func_name)
    with tvm.target.Target("llvm"):
        built = tvm.compile(tvm.IRModule({spec.func_name: func}), target="llvm")
    return built.mod[spec.func_name]


def on_kvtvm(model, fn):
    """``fn()`` with ``model`` on the ``"kvtvm"`` attention of kvtvm.integrations.hf, sdpa
    again afterwards."""
    from kvtvm.integrations import hf

    hf.use_kvtvm(model)
    try:
        return fn()
    finally:
        model.set_attn_implementation("sdpa")


def run_prompt(mgr, tokens):
    """A new sequence of ``mgr`` holding ``tokens`` (claimed, fetched and stepped); its id."""
    from kvtvm.inputs import BatchItem

    (s,) = mgr.claim(1)
    mgr.fetch([BatchItem(s, tokens)])
    mgr.step([BatchItem(s, tokens)])
    return s


def run_gloo_pair(worker, *args) -> list:
    """Run ``worker(rank, *args, out)`` in two spawned processes joined by a gloo process group
    on 127.0.0.1 (initialised before and destroyed after ``worker``); returns what they put
    on ``out`` (a queue)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_gloo_member, args=(port, worker, args, out), nprocs=2,
                       start_method="spawn", join=True)
    got = []
    while not out.empty():
        got.append(out.get())
    return got


def _gloo_member(rank, port, worker, args, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        worker(rank, *args, out)
    finally:
        dist.destroy_process_group()


def retokened(mgr, header, tokens):
    """Export ``header`` of ``mgr`` renamed to other ``tokens`` of the same length, its
    tokens' checksum and block hashes made to agree (a consistent header of other tokens)."""
    import dataclasses

    from kvtvm.manager.hashing import block_hashes
    from kvtvm.manager.pageformat import tokens_checksum

    hashes = block_hashes(tokens, mgr.page_size, header.hash_bits, mgr._root_chain()[0])
    return dataclasses.replace(header, tokens=tuple(tokens), block_hashes=tuple(hashes),
                               tokens_checksum=tokens_checksum(tokens))


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU (False without torch)."""
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def gpu(test):
    """Mark ``test`` as a GPU test (``-m gpu``) that skips itself without a CUDA GPU."""
    import pytest

    return pytest.mark.gpu(pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")(test))


def random_page_table(rng, lengths, page_size, spare=2, fill=0, extra_columns=0):
    """A page table for sequences of ``lengths`` cached tokens plus the current one, each page
    a distinct random page of a pool with ``spare`` pages left over: returns ``(table
    [len(lengths), max pages + extra_columns] int32, num_pages)``, unused entries ``fill``."""
    need = [-(-(n + 1) // page_size) for n in lengths]
    num_pages = sum(need) + spare
    perm = rng.permutation(num_pages)
    table = np.full((len(lengths), max(need) + extra_columns), fill, np.int32)
    cursor = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[cursor:cursor + n]
        cursor += n
    return table, num_pages


def assert_engine_clean(e):
    """Nothing left in engine ``e``: idle, every slot and page back in its manager's pool."""
    assert e.idle and not e.running
    mgr = e.kv.mgr
    if hasattr(mgr, "check_invariants"):
        mgr.check_invariants()
        assert mgr.stats().pages_used == 0
    if hasattr(mgr, "slots_remaining"):
        assert len(mgr.slots_remaining) == mgr.max_batch_size
    else:
        assert mgr.active_batch_size == 0


def random_prompt(rng, n):
    """``n`` random token ids in [3, 1000) (clear of the toy model's special ids)."""
    return rng.integers(3, 1000, n).tolist()


def runtime_only_get_kernel(error: str = "CorruptKernelError") -> str:
    """A script for :func:`run_python` in a runtime-only process (no TVM compiler): loads the
    float32 append kernel and prints "LOADED", or "ERROR: ..." when it is refused with the
    kvtvm error named ``error``."""
    return f"""
from kvtvm import compiler, runtime
from kvtvm.errors import {error}
assert not runtime.compiler_available()
spec = compiler.KernelSpec(op="append", dtype="float32", head_dim=16, n_kv_heads=2)
try:
    compiler.get_kernel(spec)
except {error} as err:
    print("ERROR:", err)
else:
    print("LOADED")
"""


def numpy_of(view):
    """numpy array of a CPU tensor: float8 through uint8 + ml_dtypes and other types as they are
    (both sharing its memory), bfloat16 as a float32 copy."""
    import torch

    if view.dtype == torch.float8_e4m3fn:
        import ml_dtypes

        return view.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    if view.dtype == torch.bfloat16:
        return view.float().numpy()
    return view.numpy()


def ragged_batch(rng, counts, starts, page_size, spare):
    """Indices of a ragged batch (sequence ``b`` holds ``starts[b]`` tokens and appends
    ``counts[b]``) over pages handed out in a random order, a pool of ``spare`` pages more:
    ``(num_pages, qo_indptr [B + 1], cache_lengths [B], lookup [B, max pages + 1])``, the
    lookup's unused entries -1."""
    import torch

    table, total = random_page_table(rng, [s + c - 1 for s, c in zip(starts, counts)],
                                     page_size, spare, fill=-1, extra_columns=1)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return (total, torch.from_numpy(indptr), torch.tensor(starts, dtype=torch.int32),
            torch.from_numpy(table))


def append_writes_reference_bytes(kc, vc, k, v, indptr, lengths, table, layout="nhd"):
    """``ops.append_kv`` into the CPU views ``kc``/``vc`` and assert they then hold exactly the
    bytes of :func:`kvtvm.kernels.reference.reference_append` (8-bit rows compared as bytes,
    scales and padding included; full-precision rows as values)."""
    import torch

    from kvtvm import ops
    from kvtvm.kernels.reference import reference_append

    want_k, want_v = reference_append(numpy_of(kc), numpy_of(vc), numpy_of(k), numpy_of(v),
                                      indptr.numpy(), lengths.numpy(), table.numpy(),
                                      layout=layout)
    ops.append_kv(kc, vc, k, v, indptr, lengths, table, layout=layout)
    for got, want in ((kc, want_k), (vc, want_v)):
        if got.element_size() == 1:
            np.testing.assert_array_equal(got.view(torch.uint8).numpy(), want.view(np.uint8))
        else:
            np.testing.assert_array_equal(numpy_of(got), want)
