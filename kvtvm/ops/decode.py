"""``decode_attention``: one query token per sequence over its paged KV cache (split-KV).

Validates at the DLPack boundary (:mod:`kvtvm.ops.checks`), picks the number of KV splits,
gives the kernel a split workspace (the caller's :class:`SplitWorkspace`, or one owned by the
launch) and looks up ``kvtvm.kernels.decode``.
"""

from __future__ import annotations

import functools
import math
import numbers

import numpy as np

from .. import runtime
from ..errors import InvalidArgumentError, describe
from .checks import (as_tensor, check_batch_indices, check_cache_pair, check_contiguous,
                     check_dim, check_dtype, check_fetch_layout, check_flag, check_no_alias,
                     check_rank, check_sliding_window, check_sm_scale, check_vector_aligned,
                     common_device, indices_on_host, live_tokens, sync_checked_call)
from .launch import Launch, cache_dtype_names, kernel_for
from .quant import check_quant_target, quant_pair_for

__all__ = ["decode_attention", "prepare_decode_attention", "choose_num_splits", "decode_variant",
           "SplitWorkspace", "split_workspace", "MAX_SPLITS"]

#: CPU: a split holds at least this many KV positions (shorter ones cost more in merging than
#: they win in parallelism).
MIN_SPLIT_TOKENS = 256
#: Upper bound on the number of KV splits.
MAX_SPLITS = 128
#: CUDA split rule, fitted to an H100 sweep of split counts at 1x4K .. 256x1K (docs/PERF.md,
#: tools/gpu_decode_probe.py): about this many KV positions per CTA ...
CUDA_SPLIT_TOKENS = 512
#: ... at least this many CTAs per SM when the batch is small (fewer leave bandwidth unused),
#: splits never shorter than CUDA_MIN_SPLIT_TOKENS ...
CUDA_MIN_CTAS_PER_SM = 2
CUDA_MIN_SPLIT_TOKENS = 128
#: ... and no grid just past one full wave (the second wave would run nearly empty): the
#: tuned attend kernel keeps about this many CTAs resident per SM.
CUDA_RESIDENT_CTAS_PER_SM = 7
#: CUDA over an 8-bit side, where the grid holds at least CUDA_QUANT_LARGE_GRID_CTAS_PER_SM CTAs
#: per SM: splits of about CUDA_QUANT_SPLIT_TOKENS positions instead. An 8-bit split reads its
#: rows in about 60% of the float16 kernel's time, so each split's fixed cost (prologue,
#: epilogue, its share of the merge) weighs more. H100, 2026-11-27
#: (``tools/gpu_decode_layout_probe.py``, docs/PERF.md): e4m3 at 32, 64, 128 and 256 x 4K ran
#: fastest at 4 splits (1-3% ahead of 8), 256 x 1K at 1 (9% ahead of 2); int8 within 3% of
#: its best there. Small grids (16 x 4K, 8 x 4K, 1 x 32K) keep the float16 rule.
CUDA_QUANT_SPLIT_TOKENS = 1024
CUDA_QUANT_LARGE_GRID_CTAS_PER_SM = 12
#: CUDA over an 8-bit side: splits shorter than this run the ``short_splits`` variant (the
#: schedule's defaults): the tuned 8-bit kernels prefetch 2-3 stages of 32-64 rows and, tuned
#: at 16 x 4K (512-position splits), lost a quarter at 1 x 4K (128-position splits; H200,
#: docs/PERF.md 2026-11-27) where the defaults matched float16. 1 x 32K and 64 x 4K (512)
#: were faster tuned. ``tools/gpu_decode_variant_probe.py`` measures where they cross.
CUDA_SHORT_SPLIT_TOKENS = 512
#: On the CPU, a call reading fewer K elements than this (batch x KV length x KV heads x
#: head_dim) runs the serial variant of the kernel: waking TVM's thread pool costs more than
#: the other cores win (measured on 2 cores: serial 15-35% faster below, slower above).
CPU_SERIAL_ELEMENTS = 1 << 17

@functools.lru_cache(maxsize=None)
def _multiprocessors(device) -> int:
    """SMs of a GPU (asked once per device: the query costs microseconds)."""
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def _parallel_units(device) -> int:
    """The device's processors: SMs of a GPU, or the CPU threads kvtvm's kernels run on."""
    if device.type == "cuda":
        return _multiprocessors(device)
    return runtime.cpu_threads()


def choose_num_splits(batch: int, n_kv_heads: int, max_kv_len: int, device,
                      quantized: bool = False) -> int:
    """KV splits per sequence, so that ``batch x kv_heads x splits`` work units fill the device.

    CUDA (one CTA per sequence, KV head and split): splits of about
    :data:`CUDA_SPLIT_TOKENS` positions (a power of two), more when that leaves under
    :data:`CUDA_MIN_CTAS_PER_SM` CTAs per SM, halved when the grid would end just past one
    full wave; over a ``quantized`` (8-bit K or V) cache whose grid that way holds at least
    :data:`CUDA_QUANT_LARGE_GRID_CTAS_PER_SM` CTAs per SM, splits of about
    :data:`CUDA_QUANT_SPLIT_TOKENS` positions (never more splits). CPU (a task holds every KV
    head of a sequence, see ``schedules/cpu_decode.py``): enough splits for one task per core,
    at least :data:`MIN_SPLIT_TOKENS` positions each.
    """
    processors = _parallel_units(device)
    if device.type != "cuda":
        want = -(-processors // max(1, batch))
        cap = max(1, -(-max_kv_len // MIN_SPLIT_TOKENS))
        return int(max(1, min(want, cap, MAX_SPLITS)))
    units = max(1, batch * n_kv_heads)
    cap = max(1, min(MAX_SPLITS, max_kv_len // CUDA_MIN_SPLIT_TOKENS))
    splits = 1 << max(0, round(math.log2(max(1.0, max_kv_len / CUDA_SPLIT_TOKENS))))
    if units * splits < CUDA_MIN_CTAS_PER_SM * processors:
        splits = -(-CUDA_MIN_CTAS_PER_SM * processors // units)
    splits = min(splits, cap)
    wave = CUDA_RESIDENT_CTAS_PER_SM * processors
    if splits > 1 and wave < units * splits <= 1.5 * wave:
        splits //= 2
    if quantized and units * splits >= CUDA_QUANT_LARGE_GRID_CTAS_PER_SM * processors:
        longer = 1 << max(0, round(math.log2(max(1.0, max_kv_len / CUDA_QUANT_SPLIT_TOKENS))))
        splits = min(splits, longer)
    return int(max(1, splits))


def decode_variant(device_type: str, quantized: bool, max_kv_len: int, num_splits: int) -> str:
    """The kernel variant a parallel decode call runs (:mod:`kvtvm.kernels.variants`; a small
    CPU call runs ``"serial"`` instead): on CUDA over an 8-bit side, ``"short_splits"`` when
    its ``num_splits`` splits of ``max_kv_len`` positions are shorter than
    :data:`CUDA_SHORT_SPLIT_TOKENS`; else the tuned default ``""``."""
    if device_type == "cuda" and quantized \
            and max_kv_len < CUDA_SHORT_SPLIT_TOKENS * max(1, num_splits):
        return "short_splits"
    return ""


class SplitWorkspace:
    """Float32 scratch for decode's per-split partial results, owned by its caller.

    A plan or an engine keeps one per step (or per stream) so that every layer's decode, and
    a CUDA graph capturing it, sees the same buffer; it grows to the largest call it has
    served, never beyond ``max_elements``, and is freed with its owner. Without one, each
    decode call allocates its own (torch's caching allocator makes that cheap on CUDA).

    Parameters
    ----------
    device : torch.device or str
    max_elements : int, optional
        Upper bound on its float32 elements (default: no bound beyond memory); a call needing
        more raises :class:`~kvtvm.errors.InvalidArgumentError`.
    """

    def __init__(self, device, max_elements: int | None = None):
        import torch

        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.max_elements = max_elements
        self._buf = None

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return 0 if self._buf is None else self._buf.numel() * 4

    def views(self, num_splits: int, batch: int, n_q_heads: int, head_dim: int):
        """``(o_part [S, batch, Hq, D], lse_part [S, batch, Hq])`` float32 views of the buffer,
        grown first when too small (``S = num_splits``); InvalidArgumentError past
        ``max_elements``."""
        import torch

        n_o = num_splits * batch * n_q_heads * head_dim
        n_l = num_splits * batch * n_q_heads
        if self.max_elements is not None and n_o + n_l > self.max_elements:
            raise InvalidArgumentError(describe(
                "workspace", f"room for {n_o + n_l} float32 elements",
                f"max_elements={self.max_elements}"))
        if self._buf is None or self._buf.numel() < n_o + n_l:
            self._buf = None  # free the old buffer before allocating the larger one
            self._buf = torch.empty(n_o + n_l, dtype=torch.float32, device=self.device)
        buf = self._buf
        return (buf[:n_o].view(num_splits, batch, n_q_heads, head_dim),
                buf[n_o:n_o + n_l].view(num_splits, batch, n_q_heads))


def split_workspace(device, num_splits: int, batch: int, n_q_heads: int, head_dim: int):
    """Fresh float32 ``(o_part [S, batch, Hq, D], lse_part [S, batch, Hq])`` for one call."""
    return SplitWorkspace(device).views(num_splits, batch, n_q_heads, head_dim)


def decode_attention(q, k_cache, v_cache, cache_lengths, lookup_table, *, layout: str = "nhd",
                     sm_scale: float | None = None, sliding_window: int | None = None,
                     num_splits: int | None = None, out=None, lse=None,
                     check_indices: bool | None = None, workspace: SplitWorkspace | None = None):
    """Attention of one new query token per sequence over its cached keys and values.

    Shapes (``B`` sequences, ``Hq`` query heads, ``H`` KV heads): ``q`` ``[B, Hq, D]``;
    ``k_cache`` / ``v_cache`` ``[num_pages, page_size, H, D]`` views (``hnd``: ``[slots, H,
    max_seq_len, D]``); ``cache_lengths`` int32 ``[B]`` (tokens before this step: attends over
    ``cache_lengths[b] + 1``); ``lookup_table`` int32 ``[B, max_pages]``.
    ``prepare_decode_attention(...).run()``: see :func:`prepare_decode_attention` for every
    argument and error; ``run()`` adds :class:`~kvtvm.errors.KernelIndexError` (CPU: an
    out-of-range index was skipped).

    Returns
    -------
    (out, lse)
        ``out`` ``[B, Hq, D]`` in ``q``'s dtype; ``lse`` float32 ``[B, Hq]`` (natural log).
    """
    return prepare_decode_attention(
        q, k_cache, v_cache, cache_lengths, lookup_table, layout=layout, sm_scale=sm_scale,
        sliding_window=sliding_window, num_splits=num_splits, out=out, lse=lse,
        check_indices=check_indices, workspace=workspace).run()


def prepare_decode_attention(q, k_cache, v_cache, cache_lengths, lookup_table, *,
                             layout: str = "nhd", sm_scale: float | None = None,
                             sliding_window: int | None = None, num_splits: int | None = None,
                             out=None, lse=None, check_indices: bool | None = None,
                             workspace: SplitWorkspace | None = None) -> Launch:
    """Check a decode call, choose its splits and look up its kernel; ``.run()`` returns
    ``(out, lse)``.

    The current token's K/V must already be in the cache (``append_kv``), so sequence ``b``
    attends over positions ``[start, cache_lengths[b] + 1)``, ``start = 0`` or, with a sliding
    window ``w``, ``max(0, cache_lengths[b] + 1 - w)``.

    Parameters
    ----------
    q : Tensor
        ``[batch, n_q_heads, head_dim]``, contiguous, the cache's dtype; ``n_q_heads`` is a
        multiple of ``n_kv_heads`` (query head ``i`` reads KV head ``i // group_size``).
    k_cache, v_cache : Tensor
        One layer of the cache, ``[num_pages, page_size, n_kv_heads, head_dim]`` (``"nhd"``:
        PAGED, CONTINUOUS with ``page_size = max_seq_len``) or ``[num_pages, n_kv_heads,
        page_size, head_dim]`` (``"hnd"``: LINEAR); strided views with a contiguous last axis.
    cache_lengths : Tensor
        int32 ``[batch]``, tokens each sequence held before this step.
    lookup_table : Tensor
        int32 ``[batch, max_pages_per_seq]``, each sequence's pages in order.
    layout : {"nhd", "hnd"}
    sm_scale : float, optional
        Score scale; ``1 / sqrt(head_dim)`` by default.
    sliding_window : int, optional
        Attend to the last ``sliding_window`` positions only (compiles the windowed kernel).
    num_splits : int, optional
        KV splits per sequence (merged by log-sum-exp); chosen from ``batch x n_kv_heads``
        against the device's SMs (CPU cores) by default.
    out : Tensor, optional
        ``[batch, n_q_heads, head_dim]`` of q's dtype, written in place.
    lse : Tensor, optional
        float32 ``[batch, n_q_heads]``, natural-log log-sum-exp of the scaled scores.
    check_indices : bool, optional
        Check lengths and page indices on the host before launch; by default only when they
        are in host memory (free).
    workspace : SplitWorkspace, optional
        Scratch for the per-split partial results (on the tensors' device); the launch
        allocates its own when None.

    Returns
    -------
    Launch
        Slots ``q, k_cache, v_cache, cache_lengths, lookup_table, out, lse, o_part, lse_part,
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
        ("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
        ("cache_lengths", cache_lengths), ("lookup_table", lookup_table))}
    if out is not None:
        tensors["out"] = as_tensor("out", out)
    if lse is not None:
        tensors["lse"] = as_tensor("lse", lse)
    qt, kc, vc, lengths, table = (tensors[n] for n in ("q", "k_cache", "v_cache",
                                                       "cache_lengths", "lookup_table"))
    check_fetch_layout(layout, lengths, table)  # before the shapes it would confuse
    quant = quant_pair_for(kc, vc, layout, "q", qt)  # 8-bit cache views
    geo = quant.geometry if quant else check_cache_pair(kc, vc, layout)
    check_rank("q", qt, 3, "[batch, n_q_heads, head_dim]")
    check_dtype("q", qt, geo.dtype)
    check_dim("q", qt, 2, geo.head_dim, "head_dim")
    check_contiguous("q", qt)
    n_q_heads = qt.shape[1]
    if n_q_heads == 0 or n_q_heads % geo.n_kv_heads:
        raise InvalidArgumentError(describe("q.shape[1] (n_q_heads)",
                                            f"a positive multiple of n_kv_heads={geo.n_kv_heads}",
                                            n_q_heads))
    group_size = n_q_heads // geo.n_kv_heads
    for name, t in (("cache_lengths", lengths), ("lookup_table", table)):
        check_dtype(name, t, "int32")
        check_contiguous(name, t)
    check_rank("cache_lengths", lengths, 1, "[batch]")
    batch = qt.shape[0]
    check_dim("cache_lengths", lengths, 0, batch, "batch (q.shape[0])")
    check_rank("lookup_table", table, 2, "[batch, max_pages_per_seq]")
    check_dim("lookup_table", table, 0, batch, "batch (q.shape[0])")
    if "out" in tensors:
        o = tensors["out"]
        check_dtype("out", o, geo.dtype)
        if tuple(o.shape) != tuple(qt.shape):
            raise InvalidArgumentError(describe("out.shape", list(qt.shape), list(o.shape)))
        check_contiguous("out", o)
    if "lse" in tensors:
        ls = tensors["lse"]
        check_dtype("lse", ls, "float32")
        if tuple(ls.shape) != (batch, n_q_heads):
            raise InvalidArgumentError(describe("lse.shape", [batch, n_q_heads],
                                                list(ls.shape)))
        check_contiguous("lse", ls)
    sliding_window = check_sliding_window(sliding_window)
    if num_splits is not None and (isinstance(num_splits, (bool, np.bool_))
                                   or not isinstance(num_splits, numbers.Integral)
                                   or not 1 <= num_splits <= MAX_SPLITS):
        raise InvalidArgumentError(describe("num_splits", f"None or an int in [1, {MAX_SPLITS}]",
                                            repr(num_splits)))
    device = common_device(tensors)
    check_no_alias({n: tensors[n] for n in ("out", "lse") if n in tensors},
                   {n: tensors[n] for n in ("q", "k_cache", "v_cache", "cache_lengths",
                                            "lookup_table")})
    sm_scale = check_sm_scale(sm_scale)
    if device.type == "cuda":  # K/V rows are staged with 16-byte cp.async copies; q is
        check_vector_aligned({"k_cache": kc, "v_cache": vc})  # read and out written in
        check_vector_aligned({n: tensors[n] for n in ("q", "out") if n in tensors},  # up to
                             strides=False)  # 16-byte vectors within their contiguous rows
    tokens = live_tokens({"cache_lengths": lengths, "lookup_table": table},
                         {"k_cache": kc, "v_cache": vc})
    check_indices = check_flag("check_indices", check_indices)
    if check_indices is None:
        check_indices = indices_on_host(lengths, table)
    sync_checked_call(device, check_indices)
    max_kv_len = table.shape[1] * geo.page_size
    if check_indices:
        indptr = torch.arange(batch + 1, dtype=torch.int32)  # one (appended) token each
        check_batch_indices(indptr, lengths, table, geo, batch)
        if batch and lengths.device.type == "cpu":
            max_kv_len = int(lengths.max()) + 1
    if sliding_window is not None:
        max_kv_len = min(max_kv_len, int(sliding_window))
    serial = (device.type == "cpu"
              and batch * max_kv_len * geo.n_kv_heads * geo.head_dim < CPU_SERIAL_ELEMENTS)
    if num_splits is None:
        num_splits = 1 if serial else choose_num_splits(batch, geo.n_kv_heads, max_kv_len,
                                                        device, quantized=bool(quant))
    num_splits = int(num_splits)

    out_t = tensors.get("out")
    if out_t is None:
        out_t = torch.empty(qt.shape, dtype=qt.dtype, device=device)
    lse_t = tensors.get("lse")
    if lse_t is None:
        lse_t = torch.empty((batch, n_q_heads), dtype=torch.float32, device=device)
    given = cache_dtype_names(kc, vc)  # (a float8 cache, before its int8 view)
    if quant:
        check_quant_target(device, quant, "decode")
        kc, vc = quant.k_arg, quant.v_arg
    if workspace is not None and not isinstance(workspace, SplitWorkspace):
        raise InvalidArgumentError(describe("workspace", "None or a SplitWorkspace",
                                            type(workspace).__name__))
    slots = dict(q=qt, k_cache=kc, v_cache=vc, cache_lengths=lengths, lookup_table=table,
                 out=out_t, lse=lse_t)
    if batch == 0:
        return Launch(None, device, slots, outputs=("out", "lse"), tokens=tokens,
                      cache_dtypes=given)
    if workspace is None:
        workspace = SplitWorkspace(device)
    elif workspace.device != device:
        raise InvalidArgumentError(describe("workspace", f"a SplitWorkspace on {device}",
                                            f"one on {workspace.device}"))
    slots["o_part"], slots["lse_part"] = workspace.views(num_splits, batch, n_q_heads,
                                                         geo.head_dim)
    slots["sm_scale"] = 1.0 / math.sqrt(geo.head_dim) if sm_scale is None else float(sm_scale)
    slots["sliding_window"] = int(sliding_window or 0)
    fn = kernel_for(device, **(quant.spec_fields if quant else {}), op="decode", dtype=geo.dtype, head_dim=geo.head_dim,
                    n_kv_heads=geo.n_kv_heads, group_size=group_size, layout=layout,
                    features=("sliding_window",) if sliding_window is not None else (),
                    variant="serial" if serial else decode_variant(device.type, bool(quant),
                                                                  max_kv_len, num_splits))
    return Launch(fn, device, slots, outputs=("out", "lse"), tokens=tokens,
                  parallel=not serial, cache_dtypes=given)
