"""The copy ops: move pages or batch slots of a cache tensor.

``copy_pages`` moves rows of axis 0 (PAGED / CONTINUOUS cache tensors, whose axis 0 is the page
or block); ``copy_slots`` moves rows of axis 1 of a LINEAR cache tensor
``[num_layers, max_batch_size, 2, n_kv_heads, max_seq_len, head_dim]`` in every layer. Both run
the ``copy`` kernel (:mod:`kvtvm.kernels.copy`) in place, with sequential semantics: copy ``i``
sees the result of copies ``0 .. i-1``. The kernel runs independent copies per launch, so the
list is split on the host into rounds of independent copies, one launch each: copy-on-write
(fresh destinations) is one round; an order-preserving compaction ``[1, 2, 3] -> [0, 1, 2]``
takes one round per link of its longest chain. Copies with ``src == dst`` are skipped.
"""

from __future__ import annotations

import numpy as np

from ..errors import DeviceMismatchError, InvalidArgumentError, describe
from ..params import DTYPE_SIZES
from .checks import (as_tensor, check_contiguous, check_dtype, check_flag, check_no_alias,
                     check_vector_aligned, host_array)
from .launch import Launch, LaunchSequence, kernel_for

__all__ = ["copy_pages", "copy_slots", "prepare_copy_pages", "prepare_copy_slots",
           "independent_rounds"]


def copy_pages(blocks, src_pages, dst_pages, *, check_indices: bool | None = None) -> None:
    """Copy whole pages of a cache tensor in place: ``blocks[dst[i]] = blocks[src[i]]`` for
    ``i`` in order.

    Parameters
    ----------
    blocks : Tensor
        Contiguous cache tensor whose axis 0 is the page, e.g. PAGED
        ``[num_pages, 2, num_layers, page_size, n_kv_heads, head_dim]``, or a quantized
        cache's uint8 ``[num_pages, page_bytes]`` (moved bit for bit). Every layer and both
        K and V of a page move together.
    src_pages, dst_pages : Tensor
        int32 ``[n]`` page indices, on the host (split into rounds of independent copies,
        then moved to the device) or on the device of ``blocks`` (one launch).
    check_indices : bool, optional
        Check ``0 <= index < num_pages`` before launch; default True for host-resident
        indices. Indices on a GPU are neither checked nor split into rounds (that would
        synchronize): they must then be independent (no ``dst`` repeated or also a ``src``).

    Raises
    ------
    DTypeMismatchError, DeviceMismatchError, InvalidArgumentError
        Before anything is written.
    KernelIndexError
        CPU, unchecked indices: a copy with an index out of range was skipped.
    """
    prepare_copy_pages(blocks, src_pages, dst_pages, check_indices=check_indices).run()


def prepare_copy_pages(blocks, src_pages, dst_pages, *,
                       check_indices: bool | None = None) -> LaunchSequence:
    """Check a page copy and look up its kernel (arguments as :func:`copy_pages`).

    Returns
    -------
    LaunchSequence
        One :class:`~kvtvm.ops.launch.Launch` per round of independent copies (slots
        ``blocks, src, dst``); ``run()`` runs them in order.
    """
    return _prepare_copy_rows(blocks, 0, src_pages, dst_pages, "blocks", check_indices,
                              ("src_pages", "dst_pages"))


def copy_slots(cache, src_slots, dst_slots, *, check_indices: bool | None = None) -> None:
    """Copy whole batch slots of a LINEAR cache in place: ``cache[:, dst[i]] =
    cache[:, src[i]]`` for ``i`` in order (every layer, K and V).

    Parameters
    ----------
    cache : Tensor
        Contiguous ``[num_layers, max_batch_size, 2, n_kv_heads, max_seq_len, head_dim]``,
        or a quantized cache's uint8 ``[1, max_batch_size, slot_bytes]``.
    src_slots, dst_slots : Tensor
        int32 ``[n]`` slot indices, on the host or on the device of ``cache`` (as for
        :func:`copy_pages`).
    check_indices : bool, optional
        As for :func:`copy_pages`.

    Raises
    ------
    DTypeMismatchError, DeviceMismatchError, InvalidArgumentError, KernelIndexError
        As for :func:`copy_pages`.
    """
    prepare_copy_slots(cache, src_slots, dst_slots, check_indices=check_indices).run()


def prepare_copy_slots(cache, src_slots, dst_slots, *,
                       check_indices: bool | None = None) -> LaunchSequence:
    """Check a slot copy and look up its kernel (arguments as :func:`copy_slots`); one
    launch per round of independent copies (slots ``cache, src, dst``)."""
    return _prepare_copy_rows(cache, 1, src_slots, dst_slots, "cache", check_indices,
                              ("src_slots", "dst_slots"))


def _prepare_copy_rows(buf, axis: int, src, dst, name: str, check_indices,
                       index_names: tuple) -> LaunchSequence:
    """The copy of rows ``src`` to rows ``dst`` along ``axis`` of ``buf`` (named ``name``; the
    index tensors named ``index_names`` in errors)."""
    import torch

    sname, dname = index_names
    buf = as_tensor(name, buf)
    src = as_tensor(sname, src)
    dst = as_tensor(dname, dst)
    check_dtype(name, buf, (*DTYPE_SIZES, "uint8"))
    check_contiguous(name, buf)
    if buf.device.type not in ("cpu", "cuda"):
        raise DeviceMismatchError(describe(name, "a tensor on cpu or cuda", buf.device))
    if buf.dim() < axis + 2:
        raise InvalidArgumentError(describe(f"{name} rank", f"at least {axis + 2}",
                                            f"shape {list(buf.shape)}"))
    if buf.dtype == torch.uint8:  # a quantized cache's bytes (kvtvm.params): moved bit for
        # bit as float32 words, 16 bytes to a row of the copy kernel
        if int(buf.shape[-1]) % 16:
            raise InvalidArgumentError(describe(f"{name}.shape[-1]", "a multiple of 16 bytes "
                                                "(a quantized cache's unit)", buf.shape[-1]))
        if buf.storage_offset() % 4:
            raise InvalidArgumentError(describe(
                f"{name}.storage_offset()", "a multiple of 4 bytes (the bytes move as float32 "
                "words)", buf.storage_offset()))
        buf = buf.view(torch.float32).unflatten(-1, (-1, 4))
    for n_, t in ((sname, src), (dname, dst)):
        check_dtype(n_, t, "int32")
        check_contiguous(n_, t)
        if t.dim() != 1:
            raise InvalidArgumentError(describe(f"{n_} rank", "1 ([n])", list(t.shape)))
        if t.device != buf.device and t.device.type != "cpu":
            raise DeviceMismatchError(describe(n_, f"device {buf.device} (as {name}) or cpu",
                                               t.device))
    if src.device != dst.device:
        raise DeviceMismatchError(describe(dname, f"device {src.device} (as {sname})",
                                           dst.device))
    if src.shape[0] != dst.shape[0]:
        raise InvalidArgumentError(describe(f"{dname}.shape[0]", f"{src.shape[0]} (as {sname})",
                                            dst.shape[0]))
    rows = int(buf.shape[axis])
    on_host = src.device.type == "cpu"
    check_indices = check_flag("check_indices", check_indices)
    if check_indices is None:
        check_indices = on_host
    if check_indices:
        for n_, t in ((sname, src), (dname, dst)):
            idx = host_array(t)
            bad = (idx < 0) | (idx >= rows)
            if bad.any():
                i = int(np.argmax(bad))
                raise InvalidArgumentError(describe(f"{n_}[{i}]", f"an index in [0, {rows})",
                                                    int(idx[i])))
    if src.shape[0] == 0 or buf.numel() == 0:  # nothing to move (an empty row: no kernel)
        return LaunchSequence(())
    head_dim = int(buf.shape[-1])
    outer = int(np.prod(buf.shape[:axis], dtype=np.int64)) if axis else 1
    inner = int(np.prod(buf.shape[axis + 1:], dtype=np.int64)) // head_dim
    view = buf.view(outer, rows, inner, head_dim)
    if buf.device.type == "cuda":  # the CUDA schedule moves up-to-16-byte vectors of a row
        lanes = 16 // buf.element_size()
        while head_dim % lanes:
            lanes //= 2
        check_vector_aligned({name: view}, lanes * buf.element_size())
        if outer > CUDA_MAX_OUTER:  # the kernel's grid.y
            raise InvalidArgumentError(describe(
                f"{name}.shape[:{axis}]", f"at most {CUDA_MAX_OUTER} rows in all on CUDA",
                list(buf.shape[:axis])))
    fn = kernel_for(buf.device, op="copy", dtype=str(buf.dtype).replace("torch.", ""),
                    head_dim=head_dim, n_kv_heads=1, layout="nhd")
    if not on_host:  # the kernel reads the indices where they are: not inside the pages
        check_no_alias({name: view}, {"src": src, "dst": dst})
        return LaunchSequence([Launch(fn, buf.device, dict(blocks=view, src=src, dst=dst))])

    def indices(values):
        return torch.tensor(values, dtype=torch.int32, device=buf.device)

    return LaunchSequence(
        Launch(fn, buf.device, dict(blocks=view, src=indices(rs), dst=indices(rd)))
        for rs, rd in independent_rounds(host_array(src).tolist(), host_array(dst).tolist()))


#: Largest product of the axes before the copied one on CUDA (schedules/copy/cuda.py: grid y).
CUDA_MAX_OUTER = 65535


def independent_rounds(src: list[int], dst: list[int]) -> list[tuple[list[int], list[int]]]:
    """Split an ordered copy list into consecutive rounds of independent copies.

    Within a round no slot is written twice and no slot written is also read, so a round can
    run in parallel; running the rounds in order gives the sequential result. ``src == dst``
    copies are dropped.
    """
    rounds = []
    cur_s, cur_d, reads, writes = [], [], set(), set()
    for s, d in zip(src, dst):
        if s == d:
            continue
        if d in reads or d in writes or s in writes:
            rounds.append((cur_s, cur_d))
            cur_s, cur_d, reads, writes = [], [], set(), set()
        cur_s.append(s)
        cur_d.append(d)
        reads.add(s)
        writes.add(d)
    if cur_s:
        rounds.append((cur_s, cur_d))
    return rounds
