"""transformers' continuous batching (``model.generate_batch``) with kvtvm's attention kernels.

transformers 5.23-5.24 runs continuous batching only with ``"paged|eager"``, ``"sdpa"`` or an
attention implementation whose name says "flash" (``switch_to_cb_friendly_attn``); a flash one
is called the way the ``flash-attn`` package is: ``flash_attn_varlen_func`` over the ragged
K/V its paged cache hands back (every request's cached prefix + new tokens, concatenated), or,
on its CUDA decode fast path, ``flash_attn_with_kvcache`` over its page views with a block
table. A Hub kernel (``kernels-community/flash-attn2``) is loaded by transformers'
``load_and_register_attn_kernel``: it registers transformers' ``flash_attention_forward`` under
the kernel's name and caches the kernel's functions in ``lazy_import_flash_attention``.

This module does the same offline for kvtvm: :data:`KVTVM_FLASH` (``"kvtvm_flash"``) is
registered through ``AttentionInterface`` with ``flash_attention_forward`` and its kernel
functions are kvtvm-backed versions of the flash-attn API:

* :func:`flash_attn_varlen_func` -- the ragged K/V viewed as a page-size-1 cache, kvtvm's
  prefill kernel (decode kernel when every request adds one token);
* :func:`flash_attn_with_kvcache` -- kvtvm's ``append_kv`` + decode kernel straight on
  transformers' ``[num_pages, page_size, Hkv, D]`` page views (kvtvm's ``nhd``) with its block
  table (-1 padded, kvtvm's lookup table) and pre-append lengths (kvtvm's ``cache_lengths``);
* :func:`flash_attn_func` -- dense batches of equal length (plain ``generate``).

Supported: ``softmax_scale``, ``causal``, ``window_size=(w - 1, *)`` (a causal sliding window of
``w`` tokens), GQA. Refused with :class:`kvtvm.errors.InvalidArgumentError`: softcap, ALiBi,
attention sinks, dropout, a non-causal window. The one private piece -- seeding transformers'
lazy flash import, which has no public hook for a local kernel -- is checked against the names
it relies on at import (:func:`check_transformers`) and by ``tests/integrations``.

    from kvtvm.integrations.hf_batch import use_kvtvm_batch
    use_kvtvm_batch(model)                   # model.set_attn_implementation("kvtvm_flash")
    out = model.generate_batch(prompts, generation_config=cfg,
                               continuous_batching_config=cb_config(...))
"""

from __future__ import annotations

import torch

from ..errors import InvalidArgumentError, describe
from ..ops import decode_attention, prefill_attention
from ..ops.append import append_kv
from .hf_autograd import no_backward
from .hf_cb_guard import KVTVM_FLASH  # (installs the generate_batch guard)

try:
    import transformers
    from transformers import modeling_flash_attention_utils as _mfa
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.generation.continuous_batching import initialization as _cb_init
    from transformers.modeling_utils import AttentionInterface
except ImportError as err:  # pragma: no cover - depends on the installation
    raise ImportError(f"kvtvm.integrations.hf_batch needs transformers>=5.23 ({err}); "
                      "pip install 'kvtvm[hf]'") from err

__all__ = ["KVTVM_FLASH", "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
           "use_kvtvm_batch", "cb_config", "check_transformers", "KERNEL_CALLS"]


#: The private names of ``transformers.modeling_flash_attention_utils`` the seeding writes.
_LAZY_NAMES = ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn",
               "_flash_with_kvcache_fn", "_pad_fn", "_unpad_fn", "_process_flash_kwargs_fn",
               "_process_with_kvcache_kwargs_fn", "_lazy_define_process_function",
               "lazy_import_flash_attention", "_pad_input", "_unpad_input")
#: ... and of ``transformers.generation.continuous_batching.initialization`` (the decode fast path).
_INIT_NAMES = ("ensure_decode_fast_path_is_available", "ATTN_TYPE_TO_ALLOCATOR",
               "group_layers_by_attn_type")


class _Calls:
    """Counters (and seconds) of the kvtvm kernel calls made through this module."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.varlen = self.kvcache = self.dense = 0


#: How often each entry point ran (tests check the kernels were really used).
KERNEL_CALLS = _Calls()


def check_transformers() -> None:
    """Raise ImportError naming what is missing if this transformers lacks what the adapter
    relies on (the lazy flash import's cache, the continuous-batching name check)."""
    missing = [n for n in _LAZY_NAMES if not hasattr(_mfa, n)]
    missing += [n for n in _INIT_NAMES if not hasattr(_cb_init, n)]
    from transformers.utils.generic import is_flash_attention_requested

    if missing or not is_flash_attention_requested(requested_attention_implementation=KVTVM_FLASH):
        raise ImportError(
            f"transformers {transformers.__version__}: kvtvm.integrations.hf_batch (tested with "
            f"5.23, 5.24) relies on transformers.modeling_flash_attention_utils."
            f"{', '.join(missing) or 'is_flash_attention_requested'}, which changed")


check_transformers()


# -- the flash-attn API on kvtvm ------------------------------------------------------------

def _refuse(softcap=0.0, alibi_slopes=None, dropout_p=0.0, s_aux=None, learnable_sink=None):
    if softcap:
        raise InvalidArgumentError(f"kvtvm attention: softcap={softcap}: kvtvm's kernels have "
                                   "no logit softcap (use sdpa/eager for this model)")
    if alibi_slopes is not None:
        raise InvalidArgumentError("kvtvm attention: ALiBi (alibi_slopes) is not supported")
    if s_aux is not None or learnable_sink is not None:
        raise InvalidArgumentError("kvtvm attention: attention sinks (s_aux) are not supported")
    if dropout_p:
        raise InvalidArgumentError(f"kvtvm attention: dropout_p={dropout_p} (training) is not "
                                   "supported")


def _window(window_size, causal) -> int | None:
    """flash-attn's ``(left, right)`` (-1: unbounded) as kvtvm's ``sliding_window`` (tokens
    counting the row's own position)."""
    if window_size is None:
        return None
    left, right = (int(x) for x in window_size)
    if left < 0:
        return None
    if not causal:
        raise InvalidArgumentError(f"kvtvm attention: window_size={tuple(window_size)} without "
                                   "causal: kvtvm's sliding window is causal only")
    return left + 1


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                           max_seqlen_k=None, dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, s_aux=None, **kwargs):
    """``flash_attn.flash_attn_varlen_func`` on kvtvm's kernels.

    Parameters
    ----------
    q : torch.Tensor
        ``[total_q, n_q_heads, head_dim]``.
    k, v : torch.Tensor
        ``[total_k, n_kv_heads, head_dim]``: sequence ``b``'s keys are rows
        ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``, its last ``q_len_b`` the new tokens'.
    cu_seqlens_q, cu_seqlens_k : torch.Tensor
        int ``[batch + 1]`` row offsets.
    softmax_scale : float, optional
        Default ``1 / sqrt(head_dim)``.
    causal : bool
        Bottom-right aligned, as flash-attn: query row ``i`` of ``b`` sees keys
        ``<= kv_len_b - q_len_b + i``.
    window_size : (int, int)
        ``(left, right)``; ``left >= 0`` keeps keys ``>= position - left`` (causal only).

    Returns
    -------
    torch.Tensor
        ``[total_q, n_q_heads, head_dim]``.
    """
    _refuse(softcap, alibi_slopes, dropout_p, s_aux, kwargs.get("learnable_sink"))
    KERNEL_CALLS.varlen += 1
    window = _window(window_size, causal)
    cu_q = cu_seqlens_q.to("cpu", torch.int64)
    cu_k = cu_seqlens_k.to("cpu", torch.int64)
    q_lens, kv_lens = cu_q.diff(), cu_k.diff()
    batch = q_lens.shape[0]
    cache_lengths = kv_lens - q_lens
    if bool((cache_lengths < 0).any()):
        raise InvalidArgumentError("kvtvm attention: a sequence has more queries than keys "
                                   f"(q lengths {q_lens.tolist()}, k lengths {kv_lens.tolist()})")
    # the ragged K/V as a cache of one-token pages: page j of sequence b is row cu_k[b] + j
    width = max(int(kv_lens.max()) if batch else 1, 1)
    table = cu_k[:-1, None] + torch.arange(width)[None, :]
    table = torch.where(table < cu_k[1:, None], table, -1)
    dev = q.device
    for name, t in (("k", k), ("v", v)):  # (named as the caller's, not the cache views')
        if isinstance(t, torch.Tensor) and t.dim() and t.stride(-1) != 1:
            raise InvalidArgumentError(describe(f"{name}.stride(-1)", 1, t.stride(-1)))
    kc, vc = k.unsqueeze(1), v.unsqueeze(1)             # [total_k, 1, Hkv, D]
    q = q.contiguous()
    lookup, lengths = _int32(table).to(dev), _int32(cache_lengths).to(dev)
    if causal and batch and bool((q_lens == 1).all()):
        out, _ = decode_attention(q, kc, vc, lengths, lookup, sm_scale=softmax_scale,
                                  sliding_window=window)
    else:
        out, _ = prefill_attention(q, kc, vc, _int32(cu_q).to(dev), lengths, lookup,
                                   causal=bool(causal), sm_scale=softmax_scale,
                                   sliding_window=window)
    return out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, s_aux=None, **kwargs):
    """``flash_attn.flash_attn_func`` (dense ``[batch, seqlen, heads, head_dim]``, every row of
    the batch the same length) on kvtvm's kernels."""
    B, Tq, Hq, D = q.shape
    Tk = k.shape[1]
    KERNEL_CALLS.dense += 1
    cu_q = torch.arange(0, (B + 1) * Tq, Tq, dtype=torch.int32)
    cu_k = torch.arange(0, (B + 1) * Tk, Tk, dtype=torch.int32)
    out = flash_attn_varlen_func(q.reshape(B * Tq, Hq, D), k.reshape(B * Tk, *k.shape[2:]),
                                 v.reshape(B * Tk, *v.shape[2:]), cu_q, cu_k, Tq, Tk, dropout_p,
                                 softmax_scale, causal, window_size, softcap, alibi_slopes,
                                 s_aux=s_aux, **kwargs)
    KERNEL_CALLS.varlen -= 1
    return out.view(B, Tq, Hq, D)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, s_aux=None, **kwargs):
    """``flash_attn.flash_attn_with_kvcache`` (paged, one new token per sequence) on kvtvm:
    ``append_kv`` of ``k``/``v`` at ``cache_seqlens`` then the decode kernel.

    Parameters
    ----------
    q : torch.Tensor
        ``[batch, 1, n_q_heads, head_dim]``.
    k_cache, v_cache : torch.Tensor
        ``[num_pages, page_size, n_kv_heads, head_dim]`` page views (strided views allowed).
    k, v : torch.Tensor, optional
        ``[batch, 1, n_kv_heads, head_dim]`` new rows, appended first.
    cache_seqlens : torch.Tensor
        int ``[batch]``, tokens each sequence held before ``k``/``v``.
    block_table : torch.Tensor
        int32 ``[batch, max_pages]``, -1 (or anything) past a sequence's pages.
    softmax_scale, causal, window_size, softcap, alibi_slopes
        As for :func:`flash_attn_varlen_func`.

    Returns
    -------
    torch.Tensor
        ``[batch, 1, n_q_heads, head_dim]``.
    """
    _refuse(softcap, alibi_slopes, 0.0, s_aux, kwargs.get("learnable_sink"))
    for name, val in (("rotary_cos", rotary_cos), ("cache_batch_idx", cache_batch_idx),
                      ("cache_leftpad", cache_leftpad)):
        if val is not None:
            raise InvalidArgumentError(f"kvtvm flash_attn_with_kvcache: {name} is not supported")
    if block_table is None or cache_seqlens is None:
        raise InvalidArgumentError("kvtvm flash_attn_with_kvcache needs block_table (paged "
                                   "cache) and cache_seqlens")
    B, Tq, Hq, D = q.shape
    if Tq != 1:
        raise InvalidArgumentError(f"kvtvm flash_attn_with_kvcache: {Tq} query tokens per "
                                   "sequence, the decode kernel takes 1")
    KERNEL_CALLS.kvcache += 1
    dev = q.device
    lengths = _int32(cache_seqlens)
    table = _int32(block_table)
    if k is not None:
        indptr = torch.arange(B + 1, dtype=torch.int32, device=dev)
        append_kv(k_cache, v_cache, k.reshape(B, *k.shape[2:]).contiguous(),
                  v.reshape(B, *v.shape[2:]).contiguous(), indptr, lengths, table)
    else:
        lengths = lengths - 1        # the query's own row is already in the cache
    out, _ = decode_attention(q.reshape(B, Hq, D).contiguous(), k_cache, v_cache, lengths, table,
                              sm_scale=softmax_scale, sliding_window=_window(window_size, True))
    return out.view(B, 1, Hq, D)


# -- registration ---------------------------------------------------------------------------

def _seed_lazy_import() -> None:
    """Make ``lazy_import_flash_attention(KVTVM_FLASH)`` return kvtvm's functions (what a
    successful Hub kernel load leaves behind)."""
    if _mfa._loaded_implementation == KVTVM_FLASH:
        return
    _mfa._flash_fn, _mfa._flash_varlen_fn = flash_attn_func, flash_attn_varlen_func
    _mfa._flash_with_kvcache_fn = flash_attn_with_kvcache
    _mfa._pad_fn, _mfa._unpad_fn = _mfa._pad_input, _mfa._unpad_input
    _mfa._process_flash_kwargs_fn = _mfa._lazy_define_process_function(flash_attn_varlen_func)
    _mfa._process_with_kvcache_kwargs_fn = _mfa._lazy_define_process_function(
        flash_attn_with_kvcache)
    _mfa._loaded_implementation = KVTVM_FLASH


def kvtvm_flash_attention(module, query, key, value, attention_mask, **kwargs):
    """The ``"kvtvm_flash"`` attention: transformers' ``flash_attention_forward`` with kvtvm's
    flash-attn functions behind it (re-seeded if another flash implementation was loaded
    since)."""
    _seed_lazy_import()
    out, weights = flash_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return no_backward(out, query, key, value), weights


AttentionInterface.register(KVTVM_FLASH, kvtvm_flash_attention)


def _ensure_decode_fast_path(config, cb_config, user_requested):
    """transformers' check of its block-table decode path, kvtvm-aware: it turns the path off
    unless flash-attn runs on CUDA or XPU, but kvtvm's :func:`flash_attn_with_kvcache` runs on
    every device kvtvm has kernels for. With ``"kvtvm_flash"`` the path stays on (when every
    layer's cache allocator supports block tables): decode steps append and attend in place on
    transformers' pages instead of reading every request's whole cache back (``index_select``)
    into a ragged copy each step."""
    if getattr(config, "_attn_implementation", None) != KVTVM_FLASH:
        return _ensure_decode_fast_path.original(config, cb_config, user_requested)
    allocators = _cb_init.ATTN_TYPE_TO_ALLOCATOR
    if not all(allocators[t].supports_block_table
               for t in _cb_init.group_layers_by_attn_type(config)):
        cb_config.max_blocks_per_request = 0
    return None


if not hasattr(_cb_init.ensure_decode_fast_path_is_available, "original"):
    _ensure_decode_fast_path.original = _cb_init.ensure_decode_fast_path_is_available
    _cb_init.ensure_decode_fast_path_is_available = _ensure_decode_fast_path
AttentionMaskInterface.register(KVTVM_FLASH, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])


def use_kvtvm_batch(model):
    """Switch ``model`` to kvtvm's flash-style attention (``"kvtvm_flash"``), which
    ``generate_batch`` accepts (and plain ``generate`` too).

    Raises :class:`kvtvm.errors.InvalidArgumentError` (``UnsupportedModelError``) naming
    ``model`` if it is not a transformers model kvtvm supports (as
    :func:`kvtvm.integrations.hf.use_kvtvm`); the model is unchanged then."""
    from .hf import _text_config

    _text_config(model)
    _seed_lazy_import()
    model.set_attn_implementation(KVTVM_FLASH)
    return model


def cb_config(max_prompt_len: int, max_new_tokens: int, num_requests: int,
              page_size: int = 16, max_batch_tokens: int | None = None):
    """A ``ContinuousBatchingConfig`` whose paged cache holds exactly ``num_requests``
    sequences of ``max_prompt_len + max_new_tokens`` tokens (transformers' default sizes the
    cache from free memory -- on a CPU most of the host's RAM, which costs seconds of page
    faults before the first token).

    Parameters
    ----------
    max_prompt_len, max_new_tokens, num_requests : int
    page_size : int
        Tokens per page of transformers' cache (transformers takes 4 or more).
    max_batch_tokens : int, optional
        Tokens one forward pass takes at most; default every prompt at once (capped at 8192).

    Raises
    ------
    InvalidArgumentError
        Naming the argument: a size that is not a positive int (``max_new_tokens`` may be 0),
        a ``page_size`` below transformers' least (4).
    """
    from transformers import ContinuousBatchingConfig

    from ..manager.args import check_positive_int

    for name, value in (("max_prompt_len", max_prompt_len), ("num_requests", num_requests),
                        ("page_size", page_size)):
        check_positive_int(name, value)
    least = _cb_init.BOUNDS["page_size"][0] if hasattr(_cb_init, "BOUNDS") else 4
    if page_size < least:       # transformers refuses it only when generate_batch starts
        raise InvalidArgumentError(describe(
            "page_size", f"at least {least} (transformers' continuous batching)", page_size))
    check_positive_int("max_new_tokens", max_new_tokens, allow_zero=True)
    if max_batch_tokens is not None:
        check_positive_int("max_batch_tokens", max_batch_tokens)
    per_seq = -(-(max_prompt_len + max_new_tokens) // page_size) + 1
    tokens = max_batch_tokens or min(8192, num_requests * max_prompt_len)
    # the block table's width is left to generate_batch's workload hints (the longest request):
    # setting it here would make transformers warn on its sdpa path, which has no block table
    return ContinuousBatchingConfig(page_size=page_size, num_blocks=num_requests * per_seq,
                                    max_batch_tokens=tokens,
                                    max_requests_per_batch=num_requests)
