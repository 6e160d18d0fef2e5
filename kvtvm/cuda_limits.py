"""What the CUDA kernels support: head_dim per family, dtype and storage type.

The CPU (llvm) kernels take any head_dim. The CUDA schedules split a head's row over the lanes
of a warp in 16-byte vectors (decode), or over 16-wide tensor-core fragments (float16 /
bfloat16 prefill), so their head_dim must fit those pieces. This module says so before anything
is built or allocated -- as an :class:`~kvtvm.errors.InvalidArgumentError` naming head_dim and
what is supported -- instead of an IndexError or an assertion deep inside a schedule. It is
plain arithmetic (no TVM), used by :class:`kvtvm.compiler.KernelSpec` for CUDA specs and by
:meth:`kvtvm.params.KVCacheParams.check_cuda` (the managers call it when one of their devices
is CUDA); ``tests/compiler/test_cuda_limits.py`` checks it
against the schedules' own choices.

Rules (``c = 16 // itemsize``: 4 elements for float32, 8 for float16 / bfloat16):

- decode: a score is reduced over ``head_dim / v`` lanes with an xor butterfly inside a warp,
  so that count must be a power of two up to 32. Full precision: ``v`` is 1 to 5 16-byte
  vectors (``c`` to ``5c``) -- float16 / bfloat16 take 8, 16, 24, 32, 40, 48, 64, 80, 96, 128,
  160, 192, 256, 320, 384, 512, 640, 768, 1024; float32 4 to 640 alike. 8-bit K and V: ``v``
  is 1 to 8 int32 words of codes (4, 8, ..., 32), so head_dim is 4 x (1, 3, 5 or 7) x a power
  of two, up to 1024: 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, ...
- decode, one side 8-bit and the other full precision (K-only, V-only): the 8-bit rule, and
  a multiple of ``c`` (the full-precision rows move in 16-byte copies).
- prefill: float16 / bfloat16 need a multiple of 16 (tensor-core fragments); float32 any.
- append: full precision any; quantizing (8-bit K or V) a multiple of 4.
- copy: any.
"""

from __future__ import annotations

from .errors import InvalidArgumentError, describe

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
#: The 8-bit CUDA decode's slices: 1 to 8 whole int32 words of codes per thread.
QUANT_VECTORS = tuple(range(4, 33, 4))


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def decode_vectors(dtype: str, head_dim: int, quantized: bool = False) -> list[int]:
    """The CUDA decode's choices of head_dim elements per thread (empty: unsupported): a score
    is reduced over ``head_dim / v`` lanes with an xor butterfly inside one warp, so that lane
    count must be a power of two of at most 32; ``v`` is a whole number of 16-byte vectors (1 to
    5) at full precision, 1 to 8 int32 words of codes (4, 8, ..., 32) for 8-bit K and V."""
    if quantized:
        sizes = QUANT_VECTORS
    else:
        chunk = 16 // _ITEMSIZE[dtype]
        sizes = tuple(k * chunk for k in range(1, 6))
    return [v for v in sizes
            if head_dim % v == 0 and _power_of_two(head_dim // v) and head_dim // v <= 32]


def _decode_rule(dtype: str, quantized: bool) -> str:
    sizes = QUANT_VECTORS if quantized else tuple(
        16 // _ITEMSIZE[dtype] * k for k in range(1, 6))
    return (f"head_dim = v x (a power of two up to 32) for some v in {list(sizes)} "
            "(the lanes reducing a score)")


def tensor_core_decode(dtype: str, head_dim: int, group_size: int, k_storage: str,
                       v_storage: str) -> bool:
    """Whether the CUDA decode of such a spec runs on the tensor cores
    (``schedules/decode/cuda_quant_mma.py``): float16 or bfloat16 queries, K and V both 8-bit,
    any GQA group (at most 8 query heads in a CTA, the first half of an m16 tile's rows; a
    larger group in "head parts", CTAs of at most 8 over the same rows: the CUDA-core kernel
    ran GQA 16 at 0.59-0.76x the float16 cache on an H200, the parts 1.63-2.20x, 2026-11-28;
    past 16, more parts of the same code, whose GPU run is owed) and head_dim a multiple of
    16 from 32 to 128 (V's operands come 32 columns at a time: 48, 80 and 112 pad the last
    group with zeros, where the CUDA-core kernel ran d48 at 0.75-0.94x the float16 cache; 256
    would not fit the registers); or one side 8-bit (a K-only or V-only cache) at head_dim
    128 (an H100 checked GQA up to 4: 1.06-1.30x the float16 cache where the CUDA-core kernel
    ran 0.82-0.97x, 2026-11-27; an H200 GQA 8 and 16, 1.05-2.48x, 2026-11-28), where some
    head_dim 64 and 32 ones spill: those keep the CUDA cores."""
    if dtype not in ("float16", "bfloat16") or head_dim % 16 or not 32 <= head_dim <= 128:
        return False   # (16: one 4-byte spill on sm_90a; the CUDA cores keep it)
    if k_storage and v_storage:
        return True
    return bool(k_storage or v_storage) and head_dim == 128


def cuda_head_dim_problem(op: str, dtype: str, head_dim: int, k_storage: str = "",
                          v_storage: str = "") -> str | None:
    """Why the CUDA kernel of family ``op`` cannot take ``head_dim`` (None: it can)."""
    quant = bool(k_storage or v_storage)
    if op == "decode":
        if quant and not (k_storage and v_storage):   # one side 8-bit, the other full
            chunk = 16 // _ITEMSIZE[dtype]
            if not decode_vectors(dtype, head_dim, quantized=True) or head_dim % chunk:
                return (f"CUDA decode (one side 8-bit, one {dtype}): "
                        f"{_decode_rule(dtype, True)}; and a multiple of {chunk}")
        elif not decode_vectors(dtype, head_dim, quantized=quant):
            what = "8-bit K and V" if quant else dtype
            return f"CUDA decode ({what}): {_decode_rule(dtype, quant)}"
    elif op == "prefill":
        if dtype in ("float16", "bfloat16") and head_dim % 16:
            return f"CUDA prefill ({dtype}, tensor cores): a multiple of 16"
    elif op == "append":
        if quant and head_dim % 4:
            return "CUDA quantizing append: a multiple of 4"
    return None


def check_cuda_head_dim(op: str, dtype: str, head_dim: int, k_storage: str = "",
                        v_storage: str = "") -> None:
    """Raise :class:`InvalidArgumentError` naming head_dim when the CUDA ``op`` cannot take
    it."""
    why = cuda_head_dim_problem(op, dtype, head_dim, k_storage, v_storage)
    if why:
        raise InvalidArgumentError(describe("head_dim", why + " (the CPU kernels take any)",
                                            head_dim))


def check_params_on_cuda(params) -> None:
    """Raise when a cache with ``params`` (:class:`kvtvm.params.KVCacheParams`) could not run
    append, decode or prefill on CUDA because of its head_dim; managers call it when one of
    their devices is CUDA. 8-bit layers are judged by their K/V storage (both 8-bit, or one
    side 8-bit and the other full precision)."""
    dtype, D = params.dtype, params.head_dim
    k8 = params.k_cache_dtype if params.k_cache_dtype != dtype else ""
    v8 = params.v_cache_dtype if params.v_cache_dtype != dtype else ""
    check_cuda_head_dim("append", dtype, D, k8, v8)
    check_cuda_head_dim("decode", dtype, D, k8, v8)
    if params.skip_layers or not (k8 or v8):   # full-precision layers exist
        check_cuda_head_dim("decode", dtype, D)
        check_cuda_head_dim("prefill", dtype, D)
