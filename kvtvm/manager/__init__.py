"""KV cache managers: the abstract API (seed 002) and the three strategies.

=====================================  ==========  =========================================
manager                                strategy    seeds
=====================================  ==========  =========================================
:class:`ContinuousBatchingKVCacheManager`  CONTINUOUS  000, 001
:class:`PagedKVCacheManager`            PAGED       003 (+ prefix cache, fork, pop)
:class:`LinearKVCache`                  LINEAR      004 (+ evict)
=====================================  ==========  =========================================
"""

from ..inputs import BatchItem, TokenBatch
from .base import KVCacheManager
from .continuous import ContinuousBatchingKVCacheManager
from .linear import LinearCacheConfig, LinearKVCache
from .paged import PagedCacheStats, PagedKVCacheManager

__all__ = ["KVCacheManager", "ContinuousBatchingKVCacheManager", "PagedKVCacheManager",
           "PagedCacheStats", "LinearKVCache", "LinearCacheConfig", "BatchItem",
           "TokenBatch", "manager_for"]


def manager_for(params, max_batch_size, max_seq_len, num_layers, devices=("cpu",), **kwargs):
    """The manager of ``params.cache_strategy``, constructed with the given arguments."""
    from ..params import KVCacheStrategy

    cls = {KVCacheStrategy.CONTINUOUS: ContinuousBatchingKVCacheManager,
           KVCacheStrategy.PAGED: PagedKVCacheManager,
           KVCacheStrategy.LINEAR: LinearKVCache}[params.cache_strategy]
    return cls(params, max_batch_size, max_seq_len, num_layers, devices, **kwargs)
