"""transformers on kvtvm: ``model.generate`` appends and attends through kvtvm's kernels.

Three pieces, all registered with transformers' public extension points:

* :class:`KVTVMCache`, a ``transformers.Cache`` whose layers hold no tensors: one kvtvm sequence
  per batch row, held by a kvtvm manager (paged or continuous). Each layer's ``update`` hands
  its new K/V to the cache; the layer's attention appends them through one
  :class:`kvtvm.plan.StepPlan` per forward (fetched at layer 0) and attends over the cache;
* the attention function ``"kvtvm"`` (``AttentionInterface``) that runs the plan's attention;
* its mask function (``AttentionMaskInterface``), which builds no mask: it hands the attention
  the 2-D padding mask, from which the cache learns each row's real tokens.

    from kvtvm.integrations.hf import KVTVMCache, use_kvtvm
    use_kvtvm(model)                                   # model.config._attn_implementation
    batch = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt")
    out = model.generate(**batch, cache=KVTVMCache(model, max_seq_len=1024),
                         max_new_tokens=32, do_sample=False)

Supported: decoder-only transformers models whose attention runs through ``AttentionInterface``
with ``cache.update`` per layer and plain causal softmax attention (full or windowed), verified
family by family against transformers' own attention (:mod:`~kvtvm.integrations.hf_support`:
``VERIFIED_MODEL_TYPES`` -- Llama, Mistral, Ministral, Mixtral, Qwen2, Qwen3, Qwen3-MoE,
SmolLM3, Gemma, Gemma2 without attention softcap, Gemma3 text, Phi, Phi-3, OLMo, OLMo2,
OLMo3, Granite, StarCoder2, Cohere, Cohere2, Helium, GLM, GLM-4, GPT-NeoX, EXAONE 4), GQA or
multi-head, a ``head_dim`` of its own, greedy or sampled generation, ``num_return_sequences``,
beam search, sliding windows (the window each layer's attention passes, as to transformers'
flash attention: full and windowed layers may mix), the model's own ``scaling`` (passed by its
attention: ``head_dim**-0.5``, Gemma's ``query_pre_attn_scalar**-0.5``, Granite's
``attention_multiplier``), and

* **padding**: a row's pads are never appended -- its sequence holds only its real tokens (a
  ragged prefill), so each row decodes at its own length; the attention output at a pad
  position is zero. Pads may stand anywhere before a row's last new position: left padding,
  and pads between a chat's turns (the cache keeps each row's token mask, ``token_mask``, and
  checks every later mask against it). transformers derives ``position_ids`` by counting the
  mask's tokens, so RoPE and attention match its own path exactly. A row may have no token in
  a forward while it holds none yet (a chunk of its left pads under ``prefill_chunk_size``):
  it is not fetched and its outputs are zero, as sdpa's for queries with no token before them.
* **beam search** and batch re-indexing (``reorder_cache``, ``batch_select_indices``,
  ``batch_repeat_interleave``): a row that takes another row's tokens gets a copy of its
  sequence -- on the paged manager a ``fork`` (pages shared, the partial last page copied on
  write), on the continuous one a copy of its block -- and sequences no row takes are released.
* **crop** (assisted generation with ``assistant_model=``, prompt lookup decoding): ``crop(-n)``
  rolls every row back ``n`` positions as transformers 5 does (``crop(0)``: nothing; positive:
  refused); rows give the tokens back with ``pop``. The assistant keeps its own cache.
* **later turns**: the same cache passed to another ``generate`` with the conversation so far
  plus new tokens; ``reset()`` before a different batch; ``copy.deepcopy(cache)`` (a prompt's
  cache reused) gives a cache with a manager of its own holding copies of the rows.
* **batch growth**: ``max_batch_size`` is where the manager starts; more rows in a first
  forward (a larger batch, beams) rebuild the empty manager.

Refused with :class:`kvtvm.errors.InvalidArgumentError` (nothing changes in the manager): a row
whose new positions end with a pad after a token of the row (right padding), a mask whose
cached part differs from the rows' token masks, a pad after a row's first token when the model
has a sliding window (transformers' window counts pad positions, kvtvm's counts tokens), a
prepared 4-D mask, logit softcap, ALiBi / attention sinks, dropout, ``output_attentions``
(kvtvm forms no weights: eager attention gives them), a backward through the
attention (:mod:`~kvtvm.integrations.hf_autograd`), more tokens than
``max_seq_len`` (:class:`~kvtvm.errors.SequenceTooLongError`), a ``crop`` argument that is
positive, not an int, or past the positions held, bad re-indexing arguments, a forward on kvtvm
attention without a ``KVTVMCache``, a ``KVTVMCache`` called by a model whose attention is not
kvtvm (``use_kvtvm`` forgotten, or another model's cache: that attention would see no history;
the calling module's config is read), a ``model`` that is not a
transformers model; a model kvtvm cannot serve exactly is refused up front by ``use_kvtvm`` and
``KVTVMCache`` with ``UnsupportedModelError`` (an ``InvalidArgumentError``) naming its
``model_type`` and what is unsupported -- attention logit softcap, attention sinks, ALiBi,
chunked attention, KV shared between layers, cross-attention / encoder-decoder, recurrent or
linear-attention layers, MLA / K and V head dims that differ, bidirectional attention, an
attention outside ``AttentionInterface``, a family not verified -- and the model is unchanged;
re-indexing into more rows than the manager's ``max_batch_size`` raises
:class:`kvtvm.errors.KVCacheCapacityError` naming it.

Built and tested against transformers 5.24 (:data:`TESTED_TRANSFORMERS`); another version is
checked at import for the names this module uses.
"""

from __future__ import annotations

import copy
import logging
import sys
import threading

import numpy as np
import torch

from ..errors import InvalidArgumentError, SequenceTooLongError, describe
from ..inputs import BatchItem
from ..manager import ContinuousBatchingKVCacheManager, PagedKVCacheManager
from ..params import KVCacheParams
from ..plan import plan_step
from .hf_autograd import no_backward
from .hf_cb_guard import KVTVM_ATTN  # (installs the generate_batch guard)
from .hf_support import caller_attention, check_model, not_on_kvtvm
from .hf_rows import (NEEDS_KVTVM_CACHE, PaddingMask, check_room, copy_sequences, regather,
                      row_indices, step_rows)

try:
    import transformers
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface
except ImportError as err:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"kvtvm.integrations.hf needs transformers>=5.23 with Cache, CacheLayerMixin, "
        f"AttentionInterface and AttentionMaskInterface ({err}); pip install 'kvtvm[hf]'"
    ) from err

__all__ = ["KVTVMCache", "kvtvm_attention", "use_kvtvm", "ATTN_NAME", "TESTED_TRANSFORMERS"]

ATTN_NAME = KVTVM_ATTN
TESTED_TRANSFORMERS = ("5.23", "5.24")
log = logging.getLogger(__name__)
_active = threading.local()          # .cache: the KVTVMCache of the forward running here
_NO_TOKENS = object()                # the plan of a forward in which every row is pads


def _check_version() -> None:
    major = int(transformers.__version__.split(".")[0])
    if major != 5:
        raise ImportError(f"kvtvm.integrations.hf supports transformers 5.x (tested "
                          f"{', '.join(TESTED_TRANSFORMERS)}), found {transformers.__version__}")
    for cls, names in ((Cache, ("get_seq_length", "get_mask_sizes", "update", "reorder_cache",
                                "batch_repeat_interleave", "batch_select_indices")),
                       (CacheLayerMixin, ("get_mask_sizes", "get_seq_length", "update"))):
        missing = [n for n in names if not hasattr(cls, n)]
        if missing:
            raise ImportError(f"transformers {transformers.__version__}: {cls.__name__} lacks "
                              f"{missing}, which kvtvm.integrations.hf relies on")


_check_version()


class _Layer(CacheLayerMixin):
    """One layer of a :class:`KVTVMCache`: hands its K/V to the cache's step."""

    is_compileable = False
    is_croppable = True             # KVTVMCache.crop rolls every row back exactly

    def __init__(self, owner: "KVTVMCache", index: int):
        super().__init__()
        self.owner, self.index = owner, index
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        self.owner._hand_kv(self.index, key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.owner.max_seq_len

    def reset(self) -> None:
        self.owner.reset()

    def reorder_cache(self, beam_idx) -> None:
        raise InvalidArgumentError("KVTVMCache layers share their sequences: reorder the whole "
                                   "cache (KVTVMCache.reorder_cache), not one layer")


class KVTVMCache(Cache):
    """A ``transformers`` cache held by a kvtvm manager: one sequence per batch row.

    An unsupported model (``UnsupportedModelError``) or bad argument raises
    :class:`~kvtvm.errors.InvalidArgumentError`.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model it serves (its config gives heads, head_dim, layers, dtype, window).
    max_seq_len : int
        Tokens per sequence (a row's real tokens, prompt and new; pads not counted).
    cache : {"paged", "continuous"}
        Which kvtvm manager holds the cache.
    max_batch_size : int
        Rows the manager is built for; a first forward with more rows (``B`` prompts times
        ``num_beams`` or ``num_return_sequences``) rebuilds it, while it holds nothing, for
        that many.
    page_size : int
        Tokens per page (paged).
    cache_dtype, k_cache_dtype, v_cache_dtype : str, optional
        Storage of the cache (:class:`kvtvm.KVCacheParams`): ``"int8"`` or
        ``"float8_e4m3fn"`` stores K and V (or K or V alone) in 8 bits with a float32 scale per
        (token, head) row; default: the model's dtype.
    skip_layers : sequence of int
        Layers kept at full precision (e.g. ``(0, -1)``).

    Attributes
    ----------
    length : int
        Positions of each row so far, left pads included (``get_seq_length``).
    pads : int64 ndarray ``[rows]``
        Pad positions of each row (its sequence holds ``length - pads[b]`` tokens).
    token_mask : bool Tensor ``[rows, length]`` or None
        Which positions of each row are tokens its sequence holds (None: all of them); the
        cached part of every later ``attention_mask`` must equal it.
    seq_ids : list of int
        The manager's sequence of each row.
    windows : list of int or None
        Each layer's window (None: full), as its attention module passes it
        (:func:`kvtvm.engine.runner.attention_windows`: a stray config key is ignored).
    """

    def __init__(self, model, max_seq_len: int, cache: str = "paged", max_batch_size: int = 1,
                 page_size: int = 16, *, cache_dtype: str | None = None,
                 k_cache_dtype: str | None = None, v_cache_dtype: str | None = None,
                 skip_layers=()):
        from ..engine.runner import attention_windows

        config = _text_config(model)
        if cache not in ("paged", "continuous"):
            raise InvalidArgumentError(f"cache: expected 'paged' or 'continuous', got {cache!r}")
        self.config, self.max_seq_len = config, max_seq_len
        self.num_layers = config.num_hidden_layers
        _check_layer_count(model, self.num_layers)
        dtype = next(model.parameters()).dtype
        self._device = next(model.parameters()).device
        self.params = KVCacheParams.from_hf_config(
            config, dtype=dtype, cache_strategy=cache,
            page_size=page_size if cache == "paged" else None, cache_dtype=cache_dtype,
            k_cache_dtype=k_cache_dtype, v_cache_dtype=v_cache_dtype, skip_layers=skip_layers)
        self._manager_cls = PagedKVCacheManager if cache == "paged" \
            else ContinuousBatchingKVCacheManager
        self.mgr = self._new_manager(max_batch_size)
        self.windows = attention_windows(model, config)  # each layer's (None: full)
        self.sliding_window = next((w for w in self.windows if w), None)
        self.scaling = self.params.head_dim ** -0.5  # when the attention passes no scaling
        self.seq_ids: list[int] = []
        self.pads = np.zeros(0, dtype=np.int64)
        self.token_mask = None
        self.length = 0
        self.plan = None                # (window, scale) -> StepPlan of this forward
        self._inputs = None             # this forward's fetched inputs (the plans')
        self._rows = None               # flat positions of this forward's real tokens (None: all)
        self._kv: dict = {}             # layer -> (k, v) handed by update, appended by attention
        self._caller = None             # attention implementation of the model calling update
        self._pending = None            # the batch fetched but not yet committed
        self._layers_done = 0           # layers of the pending batch appended and attended
        self._undo = None               # (pads, token_mask) before the pending batch
        super().__init__(layers=[_Layer(self, i) for i in range(self.num_layers)])

    def _new_manager(self, max_batch_size: int):
        return self._manager_cls(self.params, max_batch_size, self.max_seq_len, self.num_layers,
                                 devices=(self._device,))

    # ------------------------------------------------------------------------------------
    # One forward: update (every layer) -> attention (every layer; layer 0 fetches)
    # ------------------------------------------------------------------------------------

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) \
                or not 0 <= layer_idx < self.num_layers:  # (was a bare IndexError)
            raise InvalidArgumentError(
                f"KVTVMCache: layer {layer_idx!r} of a model with more layers than the "
                f"{self.num_layers} this cache was built for: a KVTVMCache serves the model "
                "it was made with")
        self._caller = caller_attention(sys._getframe(1))  # (the model calling, if known)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _hand_kv(self, layer: int, k, v) -> None:
        impl = self._caller or getattr(self.config, "_attn_implementation", None)
        untaken = [i for i in self._kv if i < layer]  # (a caller's attention that is not kvtvm)
        if (isinstance(impl, str) and impl != ATTN_NAME) or untaken:
            self._kv.clear()            # (nothing left behind for a later forward)
            raise not_on_kvtvm(impl, untaken)
        _active.cache = self
        self._kv[layer] = (k, v)

    def _begin_step(self, batch: int, new: int, mask) -> None:
        """Fetch this forward's tokens: validate everything, commit the previous forward, claim
        the rows' sequences (growing an empty, small manager), fetch and plan. A previous forward
        that stopped midway is rolled back first (the rows are checked against what they hold)."""
        self._roll_back_unfinished()
        n_held = len(self.seq_ids)
        if n_held and n_held != batch:
            raise InvalidArgumentError(
                f"KVTVMCache: batch of {batch} rows, the cache holds {n_held} sequences (a cache "
                "serves one generate; call reset() before another batch)")
        real = self.length - self.pads if n_held else np.zeros(batch, dtype=np.int64)
        marks, counts, rows = step_rows(None if mask is None else mask.mask, self.length,
                                        self.token_mask if n_held else None, batch, new,
                                        self.sliding_window)
        ends = real + counts
        if int(ends.max()) > self.max_seq_len:
            b = int(np.argmax(ends))
            raise SequenceTooLongError(
                f"KVTVMCache: row {b} would hold {int(ends[b])} tokens, more than max_seq_len="
                f"{self.max_seq_len}: make the cache larger")
        self._settle()
        if not n_held:
            if batch > self.mgr.max_batch_size:
                self.mgr = self._new_manager(batch)
            self.seq_ids = list(self.mgr.claim(batch))
        # a row with no token this forward (pads only) is left out of the fetch: its sequence
        # is unchanged and its outputs are zero; the real positions stay in row order
        self._pending = [BatchItem(s, [0] * int(c)) for s, c in zip(self.seq_ids, counts) if c]
        if self._pending:
            (self._inputs,) = self.mgr.fetch(self._pending)
            self.plan = {}      # one plan per (window, scale) the layers use, made at first use
        else:
            self.plan, self._inputs = _NO_TOKENS, None
        self._undo = (self.pads, self.token_mask)
        self._layers_done = 0
        self.pads = (self.pads if n_held else np.zeros(batch, dtype=np.int64)) + (new - counts)
        self.token_mask, self._rows = marks, rows

    def _commit(self) -> None:
        if self._pending:
            self.mgr.step(self._pending)
        self._pending = None

    def _settle(self) -> None:
        """Commit the previous forward -- or, if it stopped before its last layer, roll it
        back (:meth:`_roll_back_unfinished`)."""
        self._roll_back_unfinished()
        self._commit()

    def _roll_back_unfinished(self) -> None:
        """If the previous forward stopped before its last layer (an exception in the model),
        roll it back: its tokens were appended to some layers only, so they are popped again
        and the rows (pads, token mask) are as before it (a retry recomputes them)."""
        pending = self._pending
        if pending is None or self._layers_done == self.num_layers:
            return
        self._commit()
        for item in pending:
            if len(item.tokens):
                self.mgr.pop(item.seq_id, len(item.tokens))
        self.pads, self.token_mask = self._undo
        if not len(self.pads):  # it was the first forward: the cache held no rows before it
            for s in self.seq_ids:
                self.mgr.release(s)
            self.seq_ids = []
        self.plan, self._rows = None, None
        log.warning("KVTVMCache: the previous forward stopped after %d of %d layers; its "
                    "tokens were rolled back", self._layers_done, self.num_layers)

    def attention(self, layer: int, query, mask, scaling, sliding_window):
        """Append ``layer``'s K/V (from ``update``) and attend: ``(out [B, T, Hq, D], None)``.

        ``query``: ``[B, Hq, T, D]``; ``mask``: what the ``"kvtvm"`` mask function returned
        (a :class:`~kvtvm.integrations.hf_rows.PaddingMask`, or None without a mask).
        Outputs at pad positions are zero.
        """
        if mask is not None and not isinstance(mask, PaddingMask):
            raise InvalidArgumentError(
                f"kvtvm attention: attention_mask must be the 2-D padding mask (transformers "
                f"passes it through the 'kvtvm' mask function), got a prepared "
                f"{type(mask).__name__} of shape {tuple(getattr(mask, 'shape', ()))}")
        B, Hq, T, D = query.shape
        kv = self._kv.pop(layer, None)
        if kv is None:
            raise InvalidArgumentError(f"kvtvm attention: layer {layer} got no K/V from "
                                       "KVTVMCache.update this forward")
        if layer == 0:
            self._begin_step(B, T, mask)
        if self.plan is None:
            raise InvalidArgumentError(f"kvtvm attention: layer {layer} has no step: layer 0 "
                                       "did not run this forward")
        if self.plan is _NO_TOKENS:                     # every row is pads this forward
            out = query.new_zeros(B, T, Hq, D)
            self._layers_done = layer + 1
            self._end_forward(layer, T)
            return out, None
        k, v = (x.transpose(1, 2).reshape(B * T, x.shape[1], D) for x in kv)
        q = query.transpose(1, 2).reshape(B * T, Hq, D)
        rows = self._rows
        if rows is not None:
            k, v, q = k.index_select(0, rows), v.index_select(0, rows), q.index_select(0, rows)
        window = int(sliding_window) if sliding_window else None  # (None: full)
        if window != self.windows[layer]:  # (the mask checks assumed the module's)
            raise InvalidArgumentError(f"kvtvm attention: layer {layer}'s sliding_window "
                                       f"{sliding_window}, its module's {self.windows[layer]}")
        plan = self._plan(window, self.scaling if scaling is None else scaling)
        plan.append_kv(layer, k.contiguous(), v.contiguous())
        out, _ = plan.attention(layer, q.contiguous())
        if rows is not None:
            out = out.new_zeros(B * T, Hq, D).index_copy_(0, rows, out)
        self._layers_done = layer + 1
        self._end_forward(layer, T)
        return out.view(B, T, Hq, D), None

    def _plan(self, window, scale: float):
        """This forward's plan for ``window`` and softmax ``scale`` (the model's ``scaling``),
        made once per forward for each pair the layers use."""
        key = (window, float(scale))
        plan = self.plan.get(key)
        if plan is None:
            plan = self.plan[key] = plan_step(self._inputs, sm_scale=key[1],
                                              sliding_window=window)
        return plan

    def _end_forward(self, layer: int, new: int) -> None:
        if layer == self.num_layers - 1:
            self.length += new
            _active.cache = None        # a later forward without this cache must not find it

    # ------------------------------------------------------------------------------------
    # Cache API
    # ------------------------------------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def reorder_cache(self, beam_idx) -> None:
        """Row ``i`` takes row ``beam_idx[i]``'s tokens (beam search), sharing its pages.

        Parameters
        ----------
        beam_idx : int Tensor ``[rows]``
            For each row, the row it continues, in ``[0, rows)``.
        """
        self._roll_back_unfinished()  # (a failed first forward leaves no rows to index)
        src = row_indices("beam_idx", beam_idx, len(self.seq_ids))
        if len(src) != len(self.seq_ids):
            raise InvalidArgumentError(f"beam_idx: expected {len(self.seq_ids)} entries (one "
                                       f"per row), got {len(src)}")
        self._regather(src)

    def batch_select_indices(self, indices) -> None:
        """Keep the rows ``indices`` (int ``[n]``, in that order); release the others."""
        self._roll_back_unfinished()
        self._regather(row_indices("indices", indices, len(self.seq_ids)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times in place (rows ``b, b, ..., b+1, ...``)."""
        if isinstance(repeats, bool) or not isinstance(repeats, (int, np.integer)) \
                or repeats < 1:
            raise InvalidArgumentError(f"repeats: expected an int >= 1, got {repeats!r}")
        self._roll_back_unfinished()
        if self.seq_ids:
            self._regather(np.repeat(np.arange(len(self.seq_ids)), int(repeats)).tolist())

    def crop(self, tokens_to_remove: int) -> None:
        """Roll the last ``-tokens_to_remove`` positions of every row back (assisted /
        speculative generation, prompt lookup decoding), as transformers 5's
        ``DynamicCache.crop``: ``0`` changes nothing, a positive value is refused.

        Each row's sequence gives back the real tokens among those positions (the managers'
        ``pop``: pages past the new length are freed on the paged manager; the continuous one
        shortens the sequence inside its block).

        Raises
        ------
        InvalidArgumentError
            ``tokens_to_remove`` is not an int, is positive, or removes more than the
            ``length`` positions held (nothing changes).
        """
        if isinstance(tokens_to_remove, bool) or \
                not isinstance(tokens_to_remove, (int, np.integer)) or tokens_to_remove > 0:
            raise InvalidArgumentError(describe(
                "tokens_to_remove", "an int <= 0 (minus the positions to remove, as "
                "transformers' DynamicCache.crop)", repr(tokens_to_remove)))
        n = -int(tokens_to_remove)
        if n:
            self._roll_back_unfinished()
        if n > self.length:
            raise InvalidArgumentError(describe(
                "tokens_to_remove", f"at least -{self.length} (the positions held)",
                int(tokens_to_remove)))
        if n == 0:
            return
        self._settle()
        new_length = self.length - n
        if self.token_mask is None:
            drop = np.full(len(self.seq_ids), n, dtype=np.int64)
        else:
            drop = self.token_mask[:, new_length:].sum(dim=1).cpu().numpy().astype(np.int64)
            self.token_mask = self.token_mask[:, :new_length]
        for seq_id, k in zip(self.seq_ids, drop):
            self.mgr.pop(seq_id, int(k))
        self.length, self.pads = new_length, self.pads - (n - drop)
        self.plan, self._rows = None, None

    def _regather(self, src: list[int]) -> None:
        check_room(self.mgr, len(self.seq_ids), src)
        self._settle()
        self.seq_ids = regather(self.mgr, self.seq_ids, src)
        self.pads = self.pads[src]
        if self.token_mask is not None:
            self.token_mask = self.token_mask[torch.tensor(src, device=self.token_mask.device)]
        self.plan, self._rows = None, None

    def reset(self) -> None:
        """Release every sequence (the cache can serve a new ``generate``)."""
        self._commit()
        for s in self.seq_ids:
            self.mgr.release(s)
        self.seq_ids, self.length, self.plan, self._rows = [], 0, None, None
        self.pads, self.token_mask = np.zeros(0, dtype=np.int64), None
        self._kv.clear()

    def release(self) -> None:
        """Give the sequences back to the manager (same as :meth:`reset`)."""
        self.reset()

    def __deepcopy__(self, memo) -> "KVTVMCache":
        """A cache with a manager of its own holding copies of every row's sequence
        (``copy.deepcopy(prompt_cache)``, transformers' way to reuse a prompt's cache for
        several continuations); this cache keeps its sequences. Costs a second manager's
        memory."""
        self._settle()
        new = copy.copy(self)
        memo[id(self)] = new
        new.mgr = self._new_manager(self.mgr.max_batch_size)
        new.seq_ids = copy_sequences(self.mgr, self.seq_ids, new.mgr)
        new.pads = self.pads.copy()
        new.token_mask = None if self.token_mask is None else self.token_mask.clone()
        new.plan = new._inputs = new._rows = new._pending = new._undo = None
        new._kv, new._layers_done = {}, 0
        new.layers = [_Layer(new, i) for i in range(self.num_layers)]
        return new


def _check_layer_count(model, num_layers: int) -> None:
    """Refuse a model with fewer attention layers than its config says (layers pruned, the
    config left): each forward would end before the cache's last layer and be rolled back as
    a failed one, the prompt forgotten. Counted by the ``layer_idx`` of its modules."""
    ids = {m.layer_idx for m in model.modules() if type(getattr(m, "layer_idx", None)) is int}
    if ids and max(ids) + 1 < num_layers:
        raise InvalidArgumentError(
            f"model: its config says {num_layers} layers (num_hidden_layers), its modules "
            f"have {max(ids) + 1}; make the config agree with the layers it runs")


def kvtvm_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    sliding_window=None, softcap=None, **kwargs):
    """The ``"kvtvm"`` attention of ``AttentionInterface``: kvtvm's decode or prefill kernel
    over the :class:`KVTVMCache` the current forward appended to (``query`` ``[B, Hq, T, D]``
    -> ``([B, T, Hq, D], None)``; ``key``/``value`` come through ``KVTVMCache.update``)."""
    if softcap:
        raise InvalidArgumentError("kvtvm attention: logit softcap is not supported")
    if kwargs.get("alibi_slopes") is not None or kwargs.get("s_aux") is not None:
        raise InvalidArgumentError("kvtvm attention: ALiBi / attention sinks are not supported")
    if dropout:
        raise InvalidArgumentError("kvtvm attention: dropout (training) is not supported")
    cache = getattr(_active, "cache", None)
    if cache is None or module.layer_idx not in cache._kv:
        # no KVTVMCache took this forward's K/V (``_active`` may name the cache of an earlier
        # forward that stopped with an error: it must not be appended to)
        _active.cache = None
        raise InvalidArgumentError(NEEDS_KVTVM_CACHE)
    layers = getattr(getattr(module, "config", None), "num_hidden_layers", None)
    if isinstance(layers, int) and layers != cache.num_layers:  # another model: its forwards
        # would end before the cache's last layer and be taken for failed ones (rolled back)
        _active.cache = None
        cache._kv.clear()
        raise InvalidArgumentError(
            f"past_key_values: a KVTVMCache of a {cache.num_layers}-layer model, used by a "
            f"{layers}-layer one: a KVTVMCache serves the model it was made with")
    try:
        if kwargs.get("output_attentions"):  # (the weights came back as empty tuples)
            raise InvalidArgumentError(
                "kvtvm attention: output_attentions=True needs the attention weights, which "
                "kvtvm's kernels do not form: model.set_attn_implementation('eager') for them")
        out, weights = cache.attention(module.layer_idx, query, attention_mask, scaling,
                                       sliding_window)
        return no_backward(out, query, key, value), weights
    except BaseException:
        # a refused or failed forward leaves nothing a later forward could pick up
        _active.cache = None
        cache._kv.clear()
        raise


def _padding_mask(*args, attention_mask=None, **kwargs):
    """Mask function of ``"kvtvm"``: kvtvm's kernels are causal over each row's own sequence,
    so no mask is built; the 2-D padding mask (if any) goes to the attention, which checks it
    against the rows' pads and appends only each row's real tokens."""
    return None if attention_mask is None else PaddingMask(attention_mask)


AttentionInterface.register(ATTN_NAME, kvtvm_attention)
AttentionMaskInterface.register(ATTN_NAME, _padding_mask)


def _text_config(model):
    """The text config of ``model`` (a transformers model kvtvm's attention can serve:
    :func:`kvtvm.integrations.hf_support.check_model`), or a typed error naming it."""
    return check_model(model)


def use_kvtvm(model):
    """Switch ``model``'s attention to kvtvm (``set_attn_implementation("kvtvm")``).

    Raises :class:`kvtvm.errors.InvalidArgumentError` (``UnsupportedModelError``) naming
    ``model`` if it is not a transformers model kvtvm supports; the model is unchanged then."""
    _text_config(model)
    model.set_attn_implementation(ATTN_NAME)
    return model
