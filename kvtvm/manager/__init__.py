"""KV cache managers: the abstract API (seed 002) and the three strategies.

=====================================  ==========  =========================================
manager                                strategy    seeds
=====================================  ==========  =========================================
:class:`ContinuousBatchingKVCacheManager`  CONTINUOUS  000, 001
:class:`PagedKVCacheManager`            PAGED       003 (+ prefix cache, fork, pop)
:class:`LinearKVCache`                  LINEAR      004 (+ evict)
=====================================  ==========  =========================================

Managers are pure Python + numpy (torch for the tensors they allocate): no kernels, no TVM.
What they need from above is handed in: the page/slot copier (:mod:`.copier`) and the builder
of graph types for :meth:`KVCacheManager.input_symbols` (:mod:`.symbols`); :mod:`kvtvm`
registers the defaults. The names below load on first use, so importing this package (as
:mod:`kvtvm` does, to register those defaults) costs nothing.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "KVCacheManager": ".base",
    "ContinuousBatchingKVCacheManager": ".continuous",
    "PagedKVCacheManager": ".paged",
    "PagedCacheStats": ".paged",
    "LinearKVCache": ".linear",
    "LinearCacheConfig": ".linear",
    "PageCopier": ".copier",
    "set_default_copiers": ".copier",
    "TensorSymbol": ".symbols",
    "BatchItem": "..inputs",
    "TokenBatch": "..inputs",
    # seed 002's members of max.nn.kv_cache.manager
    "KVCacheInputs": "..inputs",
    "RaggedKVCacheInputs": "..inputs",
    "PaddedKVCacheInputs": "..inputs",
    "KVCacheInputsSequence": "..inputs",
    "KVCacheInputSymbols": "..inputs",
    "RaggedKVCacheInputSymbols": "..inputs",
    "ContinuousBatchingKVCacheInputSymbols": "..inputs",
}

__all__ = ["KVCacheManager", "ContinuousBatchingKVCacheManager", "PagedKVCacheManager",
           "PagedCacheStats", "LinearKVCache", "LinearCacheConfig", "BatchItem",
           "TokenBatch", "PageCopier", "set_default_copiers", "TensorSymbol", "manager_for",
           "KVCacheInputs", "RaggedKVCacheInputs", "PaddedKVCacheInputs",
           "KVCacheInputsSequence", "KVCacheInputSymbols", "RaggedKVCacheInputSymbols",
           "ContinuousBatchingKVCacheInputSymbols"]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


def manager_for(params, max_batch_size, max_seq_len, num_layers, devices=("cpu",), **kwargs):
    """The manager of ``params.cache_strategy``, constructed with the given arguments
    (``kwargs`` go to that manager, e.g. ``num_pages`` or ``page_copier`` for PAGED)."""
    from ..params import KVCacheStrategy
    from .continuous import ContinuousBatchingKVCacheManager
    from .linear import LinearKVCache
    from .paged import PagedKVCacheManager

    cls = {KVCacheStrategy.CONTINUOUS: ContinuousBatchingKVCacheManager,
           KVCacheStrategy.PAGED: PagedKVCacheManager,
           KVCacheStrategy.LINEAR: LinearKVCache}[params.cache_strategy]
    return cls(params, max_batch_size, max_seq_len, num_layers, devices, **kwargs)
