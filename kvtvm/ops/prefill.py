"""``prefill_attention``: ragged (chunked) causal attention of new tokens over their cached
prefix and themselves (validation at the DLPack boundary, the kernel variant, lookup)."""

from __future__ import annotations

import math

from ..errors import InvalidArgumentError, describe
from .checks import (as_tensor, check_batch_indices, check_batch_tables, check_cache_pair,
                     check_causal, check_contiguous, check_dim, check_dtype, check_fetch_layout,
                     check_flag, check_no_alias, check_rank, check_sliding_window,
                     check_sm_scale, check_vector_aligned, common_device, indices_on_host,
                     live_tokens, sync_checked_call)
from .launch import Launch, cache_dtype_names, kernel_for
from .quant import check_quant_target, quant_pair_for

__all__ = ["prefill_attention", "prepare_prefill_attention", "CUDA_SHORT_QUERY_TOKENS"]

#: CUDA, fp16/bf16: a call whose sequences add fewer new tokens than this on average runs the
#: ``short_query`` variant of the kernel (small tiles, declared with the prefill family in
#: :mod:`kvtvm.kernels`): the default tile holds 256 query rows, 64 tokens of a GQA-4 model, so short queries would leave
#: most of it to other sequences' segments. Measured on an H100 (fp16, 8 KV heads x 128,
#: GQA 4): with 128 or more new tokens per sequence the default tile is faster (the wgmma
#: kernel: 1.2-2.5x); on the tuning mix (4096, 2048, 1024, 128, 16 and 1 new tokens over
#: 0-8000 cached) the small tile was 7% faster than the mma.sync kernel's 256-row tile, which
#: its short sequences decide -- a per-call average (all the host knows without a device
#: sync) gives that mix the default.
CUDA_SHORT_QUERY_TOKENS = 64


def prefill_attention(q, k_cache, v_cache, qo_indptr, cache_lengths, lookup_table, *,
                      layout: str = "nhd", causal: bool = True, sm_scale: float | None = None,
                      sliding_window: int | None = None, out=None, lse=None,
                      check_indices: bool | None = None):
    """Ragged (chunked) prefill attention over a paged cache: cached prefix + new tokens.

    Shapes (``N`` new tokens of ``B`` sequences): ``q`` ``[N, Hq, D]``; ``k_cache`` /
    ``v_cache`` ``[num_pages, page_size, H, D]`` views (``hnd``: ``[slots, H, max_seq_len,
    D]``); ``qo_indptr`` int32 ``[B + 1]``; ``cache_lengths`` int32 ``[B]`` (tokens before
    this step); ``lookup_table`` int32 ``[B, max_pages]``. Causal by default: new token ``i``
    of sequence ``b`` attends over ``cache_lengths[b] + i + 1`` positions.
    ``prepare_prefill_attention(...).run()``: see :func:`prepare_prefill_attention` for every
    argument and error; ``run()`` adds :class:`~kvtvm.errors.KernelIndexError` (CPU: an
    out-of-range index was skipped).

    Returns
    -------
    (out, lse)
        ``out`` ``[N, Hq, D]`` in ``q``'s dtype; ``lse`` float32 ``[N, Hq]``.
    """
    return prepare_prefill_attention(
        q, k_cache, v_cache, qo_indptr, cache_lengths, lookup_table, layout=layout,
        causal=causal, sm_scale=sm_scale, sliding_window=sliding_window, out=out, lse=lse,
        check_indices=check_indices).run()


def prepare_prefill_attention(q, k_cache, v_cache, qo_indptr, cache_lengths, lookup_table, *,
                              layout: str = "nhd", causal: bool = True,
                              sm_scale: float | None = None, sliding_window: int | None = None,
                              out=None, lse=None, check_indices: bool | None = None) -> Launch:
    """Check a prefill call and look up its kernel; ``.run()`` returns ``(out, lse)``.

    Sequence ``b`` owns query rows ``qo_indptr[b]:qo_indptr[b+1]``; their K/V must already be
    in the cache (``append_kv``), so ``b`` attends over ``kv_len = cache_lengths[b] + n_new``
    positions. With ``causal``, its row ``i`` (position ``p = cache_lengths[b] + i``) sees
    KV positions ``<= p``; with ``sliding_window = w`` only positions ``> p - w`` as well.
    Query head ``h`` reads KV head ``h // (n_q_heads // n_kv_heads)`` (GQA).

    Parameters
    ----------
    q : Tensor
        ``[num_tokens, n_q_heads, head_dim]``, contiguous, the cache's dtype; ``n_q_heads`` a
        multiple of ``n_kv_heads``.
    k_cache, v_cache : Tensor
        One layer of the cache, ``[num_pages, page_size, n_kv_heads, head_dim]`` (``"nhd"``:
        PAGED, CONTINUOUS) or ``[num_pages, n_kv_heads, page_size, head_dim]`` (``"hnd"``:
        LINEAR); strided views are fine as long as ``head_dim`` is contiguous.
    qo_indptr : Tensor
        int32 ``[batch + 1]``, row offsets of each sequence's new tokens.
    cache_lengths : Tensor
        int32 ``[batch]``, tokens each sequence held before this step's new tokens.
    lookup_table : Tensor
        int32 ``[batch, max_pages_per_seq]``, the pages of each sequence in order.
    layout : {"nhd", "hnd"}
    causal : bool
    sm_scale : float, optional
        Score scale; ``1 / sqrt(head_dim)`` by default.
    sliding_window : int, optional
        Window in tokens (>= 1), counting the row's own position.
    out : Tensor, optional
        ``[num_tokens, n_q_heads, head_dim]`` in q's dtype, contiguous; allocated when None.
    lse : Tensor, optional
        float32 ``[num_tokens, n_q_heads]``, contiguous: natural-log sum of exp of the scaled
        scores of each row; allocated when None.
    check_indices : bool, optional
        Check index ranges before launch (default: when the index tensors are on the host).

    Returns
    -------
    Launch
        Slots ``q, k_cache, v_cache, qo_indptr, cache_lengths, lookup_table, out, lse, causal,
        sm_scale, sliding_window``; ``run()`` returns ``(out, lse)``.

    Raises
    ------
    DTypeMismatchError, DeviceMismatchError, InvalidArgumentError, SequenceTooLongError
        Before anything is written.
    StaleInputsError
        The tables come from a superseded ``fetch`` (also checked again by ``run()``).
    CompilerUnavailableError, DeviceUnavailableError, KernelCacheError
        The kernel cannot be loaded or built (these and the other errors of
        :func:`kvtvm.compiler.get_kernel`).
    """
    import torch

    tensors = {name: as_tensor(name, value, written=False) for name, value in (
        ("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("qo_indptr", qo_indptr),
        ("cache_lengths", cache_lengths), ("lookup_table", lookup_table))}
    qt, kc, vc = tensors["q"], tensors["k_cache"], tensors["v_cache"]
    indptr, lengths, table = (tensors[n] for n in ("qo_indptr", "cache_lengths",
                                                   "lookup_table"))
    check_fetch_layout(layout, indptr, lengths, table)  # before the shapes it would confuse
    quant = quant_pair_for(kc, vc, layout, "q", qt)  # 8-bit cache views
    geo = quant.geometry if quant else check_cache_pair(kc, vc, layout)
    check_rank("q", qt, 3, "[num_tokens, n_q_heads, head_dim]")
    check_dtype("q", qt, geo.dtype)
    check_dim("q", qt, 2, geo.head_dim, "head_dim")
    check_contiguous("q", qt)
    num_tokens, n_q_heads = qt.shape[0], qt.shape[1]
    if n_q_heads == 0 or n_q_heads % geo.n_kv_heads:
        raise InvalidArgumentError(describe("q.shape[1] (n_q_heads)",
                                            f"a positive multiple of n_kv_heads "
                                            f"({geo.n_kv_heads})", n_q_heads))
    group_size = n_q_heads // geo.n_kv_heads
    causal = check_causal(causal)
    sm_scale = check_sm_scale(sm_scale)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(geo.head_dim)
    sliding_window = check_sliding_window(sliding_window)
    check_batch_tables(indptr, lengths, table, "q", num_tokens)
    device = common_device(tensors)

    if out is None:
        out = torch.empty_like(qt)
    else:
        out = as_tensor("out", out)
        check_dtype("out", out, geo.dtype)
        if tuple(out.shape) != tuple(qt.shape):
            raise InvalidArgumentError(describe("out.shape", list(qt.shape), list(out.shape)))
        check_contiguous("out", out)
    if lse is None:
        lse = torch.empty((num_tokens, n_q_heads), dtype=torch.float32, device=qt.device)
    else:
        lse = as_tensor("lse", lse)
        check_dtype("lse", lse, "float32")
        if tuple(lse.shape) != (num_tokens, n_q_heads):
            raise InvalidArgumentError(describe("lse.shape", [num_tokens, n_q_heads],
                                                list(lse.shape)))
        check_contiguous("lse", lse)
    common_device(dict(tensors, out=out, lse=lse))
    check_no_alias({"out": out, "lse": lse}, {n: tensors[n] for n in (
        "q", "k_cache", "v_cache", "qo_indptr", "cache_lengths", "lookup_table")})

    if device.type == "cuda":  # the tensor-core kernel moves q, K and V in 16-byte chunks
        check_vector_aligned({"q": qt, "k_cache": kc, "v_cache": vc})
        check_vector_aligned({"out": out}, strides=False)  # vectors within its rows
    tokens = live_tokens({"qo_indptr": indptr, "cache_lengths": lengths,
                          "lookup_table": table}, {"k_cache": kc, "v_cache": vc})
    check_indices = check_flag("check_indices", check_indices)
    if check_indices is None:
        check_indices = indices_on_host(indptr, lengths, table)
    sync_checked_call(device, check_indices)
    if check_indices:
        check_batch_indices(indptr, lengths, table, geo, num_tokens, rows="q")
    given = cache_dtype_names(kc, vc)  # (a float8 cache, before its int8 view)
    if quant:
        check_quant_target(device, quant, "prefill")
        kc, vc = quant.k_arg, quant.v_arg
    slots = dict(q=qt, k_cache=kc, v_cache=vc, qo_indptr=indptr, cache_lengths=lengths,
                 lookup_table=table, out=out, lse=lse, causal=int(bool(causal)),
                 sm_scale=float(sm_scale), sliding_window=int(sliding_window or 0))
    if num_tokens == 0:
        return Launch(None, device, slots, outputs=("out", "lse"), tokens=tokens,
                      cache_dtypes=given)
    short = (device.type == "cuda" and geo.dtype != "float32"
             and num_tokens < CUDA_SHORT_QUERY_TOKENS * (len(indptr) - 1))
    fn = kernel_for(device, **(quant.spec_fields if quant else {}), op="prefill", dtype=geo.dtype, head_dim=geo.head_dim,
                    n_kv_heads=geo.n_kv_heads, group_size=group_size, layout=layout,
                    features=("sliding_window",) if sliding_window is not None else (),
                    variant="short_query" if short else "")
    return Launch(fn, device, slots, outputs=("out", "lse"), tokens=tokens,
                  cache_dtypes=given)
