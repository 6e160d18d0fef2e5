"""``append_kv``: write a ragged batch of new K/V rows into a paged cache."""

from __future__ import annotations

from ..errors import InvalidArgumentError, describe
from .checks import (as_tensor, check_batch_indices, check_batch_tables, check_cache_pair,
                     check_contiguous, check_dim, check_dtype, check_fetch_layout, check_flag,
                     check_no_alias, check_no_self_overlap, check_pages_kept_apart, check_rank,
                     check_vector_aligned, common_device, indices_on_host, live_tokens,
                     pages_apart, sync_checked_call)
from .launch import Launch, cache_dtype_names, kernel_for
from .quant import check_quant_target, quant_pair_for

__all__ = ["append_kv", "prepare_append_kv", "CPU_PARALLEL_APPEND_BYTES", "MAX_APPEND_BATCH"]

#: On the CPU, appends moving fewer K+V bytes than this run on one thread: an append is a
#: memory copy, and below it waking TVM's thread pool costs more than the other cores win
#: (2 cores: serial faster up to 2048 rows of 8 heads x 128 fp16 and 16384 rows of 2 x 32
#: fp32, both about 8 MiB; parallel 2x faster at 5000 rows of 8 x 128).
CPU_PARALLEL_APPEND_BYTES = 8 << 20
#: Most sequences one append may hold: the kernels find a row's sequence by a binary search of
#: ``qo_indptr`` with a fixed number of steps (``kvtvm.kernels.accessor.SEARCH_STEPS + 1``);
#: past it rows of the later sequences would be skipped (KernelIndexError after a partial write).
MAX_APPEND_BATCH = 1 << 17


def append_kv(k_cache, v_cache, k, v, qo_indptr, cache_lengths, lookup_table, *,
              layout: str = "nhd", check_indices: bool | None = None) -> None:
    """Write a ragged batch of new K/V rows into a paged cache, in place.

    Shapes (``nhd``; ``N`` new tokens of ``B`` sequences, ``H`` KV heads): ``k_cache`` /
    ``v_cache`` ``[num_pages, page_size, H, D]`` views (``hnd``: ``[slots, H, max_seq_len,
    D]``), ``k`` / ``v`` ``[N, H, D]``, ``qo_indptr`` int32 ``[B + 1]``, ``cache_lengths``
    int32 ``[B]``, ``lookup_table`` int32 ``[B, max_pages]``. ``prepare_append_kv(...).run()``:
    see :func:`prepare_append_kv` for every argument and error; ``run()`` adds
    :class:`~kvtvm.errors.KernelIndexError` (CPU: an out-of-range index was skipped).
    """
    prepare_append_kv(k_cache, v_cache, k, v, qo_indptr, cache_lengths, lookup_table,
                      layout=layout, check_indices=check_indices).run()


def prepare_append_kv(k_cache, v_cache, k, v, qo_indptr, cache_lengths, lookup_table, *,
                      layout: str = "nhd", check_indices: bool | None = None) -> Launch:
    """Check an append and look up its kernel; ``.run()`` writes the rows.

    Row ``i`` of sequence ``b`` (rows ``qo_indptr[b]:qo_indptr[b+1]``) goes to token
    position ``p = cache_lengths[b] + i - qo_indptr[b]``, i.e. page
    ``lookup_table[b, p // page_size]``, slot ``p % page_size``.

    Parameters
    ----------
    k_cache, v_cache : Tensor
        One layer of the cache, ``[num_pages, page_size, n_kv_heads, head_dim]`` for layout
        ``"nhd"`` (PAGED; CONTINUOUS with ``page_size = max_seq_len``) or
        ``[num_pages, n_kv_heads, page_size, head_dim]`` for ``"hnd"`` (LINEAR). Strided
        views are fine as long as ``head_dim`` is contiguous.
    k, v : Tensor
        New rows, ``[num_tokens, n_kv_heads, head_dim]``, contiguous, the cache's dtype.
    qo_indptr : Tensor
        int32 ``[batch + 1]``, row offsets of each sequence's new tokens; ``batch`` at most
        :data:`MAX_APPEND_BATCH` (131072).
    cache_lengths : Tensor
        int32 ``[batch]``, tokens each sequence already holds.
    lookup_table : Tensor
        int32 ``[batch, max_pages_per_seq]``, the pages of each sequence in order.
    layout : {"nhd", "hnd"}
        Token layout of the cache.
    check_indices : bool, optional
        Check index ranges before launch. Defaults to True when the index tensors are on the
        host (free) and False when they are on a GPU (checking them would synchronize); a
        page index out of range is never written either way.

    Returns
    -------
    Launch
        Slots ``k_cache, v_cache, k, v, qo_indptr, cache_lengths, lookup_table``.

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
    tensors = {name: as_tensor(name, value) for name, value in (
        ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
        ("qo_indptr", qo_indptr), ("cache_lengths", cache_lengths),
        ("lookup_table", lookup_table))}
    kc, vc, kt, vt = (tensors[n] for n in ("k_cache", "v_cache", "k", "v"))
    indptr, lengths, table = (tensors[n] for n in ("qo_indptr", "cache_lengths",
                                                   "lookup_table"))
    check_fetch_layout(layout, indptr, lengths, table)  # before the shapes it would confuse
    quant = quant_pair_for(kc, vc, layout, "k", kt)  # 8-bit cache views
    geo = quant.geometry if quant else check_cache_pair(kc, vc, layout)
    for name, t in (("k", kt), ("v", vt)):
        check_rank(name, t, 3, "[num_tokens, n_kv_heads, head_dim]")
        check_dtype(name, t, geo.dtype)
        check_dim(name, t, 1, geo.n_kv_heads, "n_kv_heads")
        check_dim(name, t, 2, geo.head_dim, "head_dim")
        check_contiguous(name, t)
    if tuple(vt.shape) != tuple(kt.shape):
        raise InvalidArgumentError(describe("v.shape", list(kt.shape), list(vt.shape)))
    batch = check_batch_tables(indptr, lengths, table, "k", kt.shape[0])
    if batch > MAX_APPEND_BATCH:
        raise InvalidArgumentError(describe("cache_lengths.shape[0] (batch)",
                                            f"at most {MAX_APPEND_BATCH} sequences per append "
                                            "(split the batch)", batch))
    device = common_device(tensors)
    tokens = live_tokens({"qo_indptr": indptr, "cache_lengths": lengths,
                          "lookup_table": table}, {"k_cache": kc, "v_cache": vc})
    check_no_alias({"k_cache": kc, "v_cache": vc},
                   {"k": kt, "v": vt, "qo_indptr": indptr, "cache_lengths": lengths,
                    "lookup_table": table}, kv_owned=bool(tokens))
    check_no_self_overlap("k_cache", kc)
    check_no_self_overlap("v_cache", vc)
    apart = 0 if tokens else pages_apart(kc, vc)  # page arrays of one buffer: the table
    if apart and table.device.type == "cpu":      # must keep K and V apart
        check_pages_kept_apart(table, apart)
    if device.type == "cuda":  # rows move as 16-byte vectors
        check_vector_aligned({"k_cache": kc, "v_cache": vc, "k": kt, "v": vt})
    check_indices = check_flag("check_indices", check_indices)
    if check_indices is None:
        check_indices = indices_on_host(indptr, lengths, table)
    sync_checked_call(device, check_indices)
    if check_indices:
        check_batch_indices(indptr, lengths, table, geo, kt.shape[0])
    given = cache_dtype_names(kc, vc)  # (a float8 cache, before its int8 view)
    if quant:
        check_quant_target(device, quant, "append")
        kc, vc = quant.k_arg, quant.v_arg
    slots = dict(k_cache=kc, v_cache=vc, k=kt, v=vt, qo_indptr=indptr, cache_lengths=lengths,
                 lookup_table=table)
    if kt.shape[0] == 0:
        return Launch(None, device, slots, tokens=tokens, cache_dtypes=given)
    moved = 2 * kt.numel() * kt.element_size()  # K and V bytes
    # small appends: waking the thread pool costs more than it saves
    variant = "serial" if device.type == "cpu" and moved < CPU_PARALLEL_APPEND_BYTES else ""
    fn = kernel_for(device, **(quant.spec_fields if quant else {}), op="append", dtype=geo.dtype, head_dim=geo.head_dim,
                    n_kv_heads=geo.n_kv_heads, layout=layout, variant=variant)
    return Launch(fn, device, slots, tokens=tokens, parallel=variant != "serial",
                  cache_dtypes=given)
