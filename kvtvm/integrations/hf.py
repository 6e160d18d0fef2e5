"""transformers on kvtvm: ``model.generate`` appends and attends through kvtvm's kernels.

Two pieces, both registered with transformers' public extension points:

* :class:`KVTVMCache`, a ``transformers.Cache`` whose layers hold no tensors: each forward's
  first layer claims (once) and fetches the batch's sequences from a kvtvm manager, each layer's
  ``update`` appends its K/V into kvtvm's cache through one :class:`kvtvm.plan.StepPlan`;
* the attention function ``"kvtvm"`` (``AttentionInterface``; no mask: kvtvm's kernels are
  causal over the cache) that runs the plan's attention for the layer.

    from kvtvm.integrations.hf import KVTVMCache, use_kvtvm
    use_kvtvm(model)                                   # model.config._attn_implementation
    out = model.generate(ids, past_key_values=KVTVMCache(model, max_seq_len=1024),
                         max_new_tokens=32, do_sample=False)

Supported: Llama-family decoders (:func:`kvtvm.engine.runner.check_supported`), greedy or
sampled generation over a batch whose rows have no padding (equal prompt lengths), a sliding
window (from the config), the model's ``scaling``. Not supported, with an error saying so:
logit softcap, ALiBi, padded batches, beam search (cache reordering). Built and tested against
transformers 5.24 (:data:`TESTED_TRANSFORMERS`); another version is checked at import for the
names this module uses.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ..inputs import BatchItem
from ..manager import ContinuousBatchingKVCacheManager, PagedKVCacheManager
from ..params import KVCacheParams
from ..plan import plan_step

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

ATTN_NAME = "kvtvm"
TESTED_TRANSFORMERS = ("5.23", "5.24")
_active = threading.local()          # .cache: the KVTVMCache of the forward running here


def _check_version() -> None:
    major = int(transformers.__version__.split(".")[0])
    if major != 5:
        raise ImportError(f"kvtvm.integrations.hf supports transformers 5.x (tested "
                          f"{', '.join(TESTED_TRANSFORMERS)}), found {transformers.__version__}")
    for cls, names in ((Cache, ("get_seq_length", "get_mask_sizes", "update")),
                       (CacheLayerMixin, ("get_mask_sizes", "get_seq_length", "update"))):
        missing = [n for n in names if not hasattr(cls, n)]
        if missing:
            raise ImportError(f"transformers {transformers.__version__}: {cls.__name__} lacks "
                              f"{missing}, which kvtvm.integrations.hf relies on")


_check_version()


class _Layer(CacheLayerMixin):
    """One layer of a :class:`KVTVMCache`: appends through the shared step plan."""

    is_compileable = False

    def __init__(self, owner: "KVTVMCache", index: int):
        super().__init__()
        self.owner, self.index = owner, index
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        self.owner._append(self.index, key_states, value_states)
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
        raise InvalidArgumentError("KVTVMCache does not support beam search (cache reordering)")


class KVTVMCache(Cache):
    """A ``transformers`` cache held by a kvtvm manager.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model it serves (its config gives heads, head_dim, layers, dtype, window).
    max_seq_len : int
        Tokens per sequence (prompt + new tokens).
    cache : {"paged", "continuous"}
        Which kvtvm manager holds the cache.
    max_batch_size : int
        Rows of the batch ``generate`` runs.
    page_size : int
        Tokens per page (paged).
    """

    def __init__(self, model, max_seq_len: int, cache: str = "paged", max_batch_size: int = 1,
                 page_size: int = 16):
        from ..engine.runner import check_supported, sliding_window_of

        config = model.config.get_text_config()
        check_supported(config)
        self.config, self.max_seq_len = config, max_seq_len
        self.num_layers = config.num_hidden_layers
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        self.params = KVCacheParams.from_hf_config(
            config, dtype=dtype, cache_strategy=cache,
            page_size=page_size if cache == "paged" else None)
        cls = PagedKVCacheManager if cache == "paged" else ContinuousBatchingKVCacheManager
        self.mgr = cls(self.params, max_batch_size, max_seq_len, self.num_layers,
                       devices=(device,))
        self.sliding_window = sliding_window_of(config)
        self.scaling = self.params.head_dim ** -0.5
        self.seq_ids: list[int] = []
        self.length = 0
        self.plan = None
        self._pending = None            # the batch fetched but not yet committed
        super().__init__(layers=[_Layer(self, i) for i in range(self.num_layers)])

    def _append(self, layer: int, k, v) -> None:
        B, H, T, D = k.shape
        if layer == 0:
            self._commit()
            if not self.seq_ids:
                self.seq_ids = list(self.mgr.claim(B))
            elif len(self.seq_ids) != B:
                raise InvalidArgumentError(f"KVTVMCache: batch of {B} rows, the cache holds "
                                           f"{len(self.seq_ids)} sequences (no beam search)")
            if self.length + T > self.max_seq_len:
                raise InvalidArgumentError(
                    f"KVTVMCache: {self.length + T} tokens, more than max_seq_len="
                    f"{self.max_seq_len}: make the cache larger")
            self._pending = [BatchItem(s, [0] * T) for s in self.seq_ids]
            (inputs,) = self.mgr.fetch(self._pending)
            self.plan = plan_step(inputs, sm_scale=self.scaling,
                                  sliding_window=self.sliding_window)
            self._tokens = T
        _active.cache = self
        self.plan.append_kv(layer, k.transpose(1, 2).reshape(B * T, H, D).contiguous(),
                            v.transpose(1, 2).reshape(B * T, H, D).contiguous())
        if layer == self.num_layers - 1:
            self.length += T

    def _commit(self) -> None:
        if self._pending is not None:
            self.mgr.step(self._pending)
            self._pending = None

    def attention(self, layer: int, query, scaling, sliding_window):
        """``(out [B, T, Hq, D], None)`` of the plan's attention for ``layer``."""
        if scaling is not None and not math.isclose(scaling, self.scaling, rel_tol=1e-6):
            raise InvalidArgumentError(f"kvtvm attention: scaling {scaling} differs from the "
                                       f"cache's {self.scaling} (1/sqrt(head_dim))")
        if sliding_window is not None and sliding_window != self.sliding_window:
            raise InvalidArgumentError(f"kvtvm attention: sliding_window {sliding_window} "
                                       f"differs from the config's {self.sliding_window}")
        B, Hq, T, D = query.shape
        q = query.transpose(1, 2).reshape(B * T, Hq, D).contiguous()
        out, _ = self.plan.attention(layer, q)
        return out.view(B, T, Hq, D), None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def reset(self) -> None:
        """Release every sequence (the cache can serve a new ``generate``)."""
        self._commit()
        for s in self.seq_ids:
            self.mgr.release(s)
        self.seq_ids, self.length, self.plan = [], 0, None

    def release(self) -> None:
        """Give the sequences back to the manager (same as :meth:`reset`)."""
        self.reset()


def kvtvm_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    sliding_window=None, softcap=None, **kwargs):
    """The ``"kvtvm"`` attention of ``AttentionInterface``: kvtvm's decode or prefill kernel
    over the :class:`KVTVMCache` the current forward appended to."""
    if softcap:
        raise InvalidArgumentError("kvtvm attention: logit softcap is not supported")
    if kwargs.get("alibi_slopes") is not None or kwargs.get("s_aux") is not None:
        raise InvalidArgumentError("kvtvm attention: ALiBi / attention sinks are not supported")
    if dropout:
        raise InvalidArgumentError("kvtvm attention: dropout (training) is not supported")
    cache = getattr(_active, "cache", None)
    if cache is None:
        raise InvalidArgumentError("kvtvm attention needs past_key_values=KVTVMCache(...)")
    return cache.attention(module.layer_idx, query, scaling, sliding_window)


def _no_mask(*args, attention_mask=None, **kwargs):
    """Mask function of ``"kvtvm"``: kvtvm's kernels are causal over the cache; a padded row
    cannot be expressed, so it is refused."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise InvalidArgumentError("kvtvm attention: padded batches are not supported (give "
                                   "rows of equal length, or one request at a time)")
    return None


AttentionInterface.register(ATTN_NAME, kvtvm_attention)
AttentionMaskInterface.register(ATTN_NAME, _no_mask)


def use_kvtvm(model):
    """Switch ``model``'s attention to kvtvm (``set_attn_implementation("kvtvm")``)."""
    model.set_attn_implementation(ATTN_NAME)
    return model
