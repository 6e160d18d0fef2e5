"""Continuous-batching manager (seeds 000/001): one block of ``max_seq_len`` tokens per sequence.

Cache tensor per device: ``[max_batch_size, 2, num_layers, max_seq_len, n_kv_heads, head_dim]``.
Block ``b`` belongs to ``seq_id == b`` for the life of the sequence, so ``fetch`` never runs out
of memory (only of ``max_seq_len``); ``lookup_table`` is ``[batch, 1]`` holding each sequence's
block. A per-layer K view ``blocks[:, 0, layer]`` is ``[num_blocks, max_seq_len, H, D]``: a
paged cache with one page of ``max_seq_len`` per sequence, which is what the kernels take.
"""

from __future__ import annotations

from ..params import KVCacheParams, KVCacheStrategy
from .args import INT32_MAX, check_size_kwargs, check_sizes, pop_length
from .base import KVCacheManager, check_positive_int, parse_devices
from .tables import StepTables, table_elems

__all__ = ["ContinuousBatchingKVCacheManager"]


class ContinuousBatchingKVCacheManager(KVCacheManager):
    """Batch-split KV cache: each claimed sequence owns one block of ``max_seq_len`` tokens.

    Parameters
    ----------
    params : KVCacheParams
        ``cache_strategy`` must be CONTINUOUS.
    max_batch_size, max_seq_len, num_layers : int
        Blocks (= sequences at once), tokens per block, decoder layers.
    devices : sequence of str
        The KV heads are split evenly across them.

    Examples
    --------
    >>> params = KVCacheParams("float16", 8, 128, "continuous")
    >>> mgr = ContinuousBatchingKVCacheManager(params, 4, 1024, 2)
    >>> (sid,) = mgr.claim(1)
    >>> inputs = mgr.fetch([BatchItem(sid, [1, 2, 3])])[0]
    >>> mgr.step([BatchItem(sid, [1, 2, 3])])
    """

    strategy = KVCacheStrategy.CONTINUOUS

    def __init__(self, params: KVCacheParams, max_batch_size: int, max_seq_len: int,
                 num_layers: int, devices=("cpu",)):
        super().__init__(params, max_batch_size, max_seq_len, num_layers, devices)
        shape = self.params.cache_shape(self.num_layers, self.max_batch_size, self.max_seq_len,
                                        n_devices=self.n_devices)
        self._blocks = self._allocate_blocks(shape)
        self._tables = StepTables(self.max_batch_size, 1, self.devices)

    @property
    def num_blocks(self) -> int:
        """Blocks of ``max_seq_len`` tokens in the cache: one per sequence slot."""
        return self.max_batch_size

    @classmethod
    def estimated_memory_size(cls, params, max_batch_size, max_seq_len, num_layers,
                              available_cache_memory=None, devices=("cpu",), **kwargs) -> int:
        """Bytes allocated on each device: the cache tensor plus the per-step int32 tables.

        ``available_cache_memory`` is not used (the cache size is fixed by the batch size).
        """
        check_sizes(params, cls.strategy, max_batch_size=max_batch_size,
                    max_seq_len=max_seq_len, num_layers=num_layers)
        check_size_kwargs("estimated_memory_size", kwargs, (), available_cache_memory)
        n = len(parse_devices(devices))
        return (params.cache_bytes(num_layers, max_batch_size, max_seq_len, n_devices=n)
                + 4 * table_elems(max_batch_size, 1))

    @classmethod
    def infer_optimal_batch_size(cls, params, max_seq_len, num_layers, available_cache_memory,
                                 devices=("cpu",), **kwargs) -> int:
        """Most blocks of ``max_seq_len`` tokens (with their tables) that fit in
        ``available_cache_memory`` bytes per device; at least 1, at most ``2**31 - 1``."""
        check_sizes(params, cls.strategy, max_seq_len=max_seq_len, num_layers=num_layers)
        check_size_kwargs("infer_optimal_batch_size", kwargs)
        available_cache_memory = check_positive_int("available_cache_memory",
                                                    available_cache_memory)
        n = len(parse_devices(devices))
        per_seq = params.bytes_per_token(num_layers, n) * max_seq_len + 4 * 3
        return max(1, min(INT32_MAX, (available_cache_memory - 4) // per_seq))

    def pop(self, seq_id: int, n: int) -> None:
        """Roll back the last ``n`` committed tokens of ``seq_id`` (speculative decoding).

        The sequence keeps its block; the next fetch writes from the new length (the rolled
        back K/V stay in the block until overwritten, never read: attention reads
        ``cache_lengths`` tokens).

        Raises
        ------
        UnknownSequenceError
            ``seq_id`` is not claimed.
        SequenceStateError
            ``seq_id`` has a fetch in flight.
        InvalidArgumentError
            ``n`` is negative or more than the sequence's length.
        """
        with self._lock:
            sid = self._check_settled(seq_id, "pop")
            new_len = pop_length(sid, n, int(self._lengths[sid]))
            self._lengths[sid] = new_len

    def _fetch_plan_apply(self, tokens, ids, counts, num_steps, lengths, total):
        self._tables.lookup[:ids.size, 0] = ids
        return lengths, None
