"""Helpers shared by the schedules of every family and target."""

from __future__ import annotations

from kvtvm.kernels._tvm import LoopRV, Schedule, get_block, written_names

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def new_schedule(mod, spec) -> Schedule:
    """A schedule over ``mod`` working on the spec's entry function."""
    sch = Schedule(mod)
    sch.work_on(spec.func_name)
    return sch


def vector_lanes(spec, vector_bytes: int) -> int:
    """Elements of ``spec.dtype`` in a ``vector_bytes`` load, capped so it divides head_dim."""
    lanes = max(1, vector_bytes // DTYPE_BYTES[spec.dtype])
    while spec.head_dim % lanes:
        lanes //= 2
    return lanes


def under_locate(sch: Schedule, consumer) -> LoopRV:
    """Move ``consumer`` under the token loop of the ``locate`` block (token -> sequence),
    keep what it locates (``seq_of``, and append's ``page_of``/``slot_of``) in registers, and
    return that token loop."""
    locate = get_block(sch, "locate")
    (token,) = sch.get_loops(locate)
    sch.reverse_compute_at(consumer, token)
    for i, name in enumerate(written_names(sch, locate)):  # seq_of (page_of, slot_of)
        if name.endswith("_of"):
            sch.set_scope(locate, i, "local")
    return token


def replace_function(mod, func, what: str):
    """``mod`` with its one function replaced by the hand-written ``func`` (same name, same
    parameters: the definition's signature is the kernel's ABI)."""
    import tvm

    (name, old), = mod.functions_items()
    assert len(old.params) == len(func.params), f"{what} signature drifted from the definition"
    return tvm.IRModule({name: func.with_attr("global_symbol", name.name_hint)})


_BLOCK_ANY = r"""
__device__ __forceinline__ int kvtvm_block_any(int p) { return __syncthreads_or(p); }
"""


def block_any(pred):
    """CUDA: 1 when ``pred`` is nonzero in any thread of the block, else 0 (a barrier: every
    thread of the block must reach it)."""
    from kvtvm.kernels._tvm import T

    return T.cuda.func_call("kvtvm_block_any", T.Cast("int32", pred), source_code=_BLOCK_ANY,
                            return_type="int32")


def pages_bad_macro(threads: int, any_of=None, hoist: bool = True):
    """CUDA: a macro setting ``bad[0]`` (a local int32 buffer) to 1 in every thread of the block
    when a page of ``lookup[b, first:last + 1]`` lies outside ``[0, num_pages)`` (``threads``
    threads read the entries in turn; a barrier makes the answer uniform, so the caller can
    skip its whole range before staging any of it). Empty when ``last < first``. ``any_of``
    (default: :func:`block_any`) makes the answer uniform; ``"warp"`` with 32 threads checks
    within one warp (a butterfly of shuffles). ``hoist``: bind the range's start and length once (``False``
    recomputes them in the loop; which of the two ptxas allocates without spills depends on
    the kernel around it -- tests/compiler check both users).""" 
    from kvtvm.kernels._tvm import T

    warp = any_of == "warp"
    any_of = block_any if warp or any_of is None else any_of

    @T.macro
    def pages_bad_hoisted(bad, lookup, b, first, last, num_pages, tid):
        p_first: T.int32 = first
        p_count: T.int32 = T.max(last - p_first + 1, 0)
        bad[0] = 0
        for i in range(T.truncdiv(p_count + threads - 1, threads)):
            if i * threads + tid < p_count:
                # one unsigned compare: a negative page wraps past every pool size
                if T.Cast("uint64", T.Cast("int64", lookup[b, p_first + i * threads + tid])) \
                        >= T.Cast("uint64", num_pages):
                    bad[0] = 1
        if warp:
            for sh in T.unroll(5):
                bad[0] = T.max(bad[0], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), bad[0],
                                                              1 << sh, 32, 32))
        else:
            bad[0] = any_of(bad[0])

    @T.macro
    def pages_bad_inline(bad, lookup, b, first, last, num_pages, tid):
        bad[0] = 0
        for i in range(T.truncdiv(T.max(last - first + 1, 0) + threads - 1, threads)):
            if first + i * threads + tid <= last:
                if T.Cast("uint64", T.Cast("int64", lookup[b, first + i * threads + tid])) \
                        >= T.Cast("uint64", num_pages):
                    bad[0] = 1
        if warp:
            for sh in T.unroll(5):
                bad[0] = T.max(bad[0], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), bad[0],
                                                              1 << sh, 32, 32))
        else:
            bad[0] = any_of(bad[0])

    return pages_bad_hoisted if hoist else pages_bad_inline


def prefetch(buf, index, locality: int = 3):
    """CPU: a software prefetch of the cache line holding ``buf[index]`` (an ``llvm.prefetch``
    call: never faults, changes nothing); use as ``T.evaluate(...)``. ``locality`` is LLVM's:
    3 keeps the line in every level (x86 ``prefetcht0``), 2 from L2 outwards (``prefetcht1``),
    1 ``prefetcht2``, 0 non-temporal."""
    from kvtvm.kernels._tvm import T

    return T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(buf[index]),
                              T.int32(0), T.int32(locality), T.int32(1))
