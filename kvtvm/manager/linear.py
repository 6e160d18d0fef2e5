"""Linear KV cache (seed 004): every batch slot holds one sequence up to ``max_seq_len``.

Cache tensor per device: ``[num_layers, max_batch_size, 2, n_kv_heads, max_seq_len, head_dim]``
(head-major inside a slot). All sequences of the active batch run prefill or decode together;
batch slot ``b`` is sequence ``b``. State is the active batch size and one length per slot.

Choices written down here:

- ``commit_sequence_length(tensor)`` *adds* the given per-sequence token counts to the lengths
  (a prefill of ``n[b]`` new tokens); ``commit_sequence_length(int)`` adds the same count to
  every active sequence (decode). Both refuse a length past ``max_seq_len`` and change nothing
  then.
- ``set_active_batch_size(n)`` accepts ``0 <= n <= max_batch_size``; slots that become active
  start empty (length 0). ``evict(keep)`` is the batch-eviction verb: it moves the kept
  sequences to the front in their batch order with the copy kernel, then shrinks the batch.
- The length tensor handed out by ``kv_cache_lengths`` is a view of a preallocated device
  buffer updated in place (one host-to-device copy per change).
- ``step_inputs`` carries a :class:`~kvtvm.inputs.FetchToken` (stamped on its table tensors)
  with the managers' semantics: the inputs die at the next ``step_inputs`` (which overwrites
  the shared ``qo_indptr``) and at any change of the lengths or the batch
  (``commit_sequence_length``, ``reset_for_new_sequences``, ``set_active_batch_size``,
  ``evict``); an op or plan given the inputs of a dead token raises
  :class:`~kvtvm.errors.StaleInputsError` and writes nothing.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError, KVCacheError, SequenceTooLongError, describe
from ..inputs import (FetchToken, RaggedKVCacheInputs, TokenSlot, as_int64, host_int_array,
                      stamp)
from ..collection import layer_views_by_signature
from .uncopyable import Uncopyable
from ..params import KVCacheParams, KVCacheStrategy
from .args import (INT32_MAX, allocate, check_batch_slots, check_positive_int, check_size,
                   check_size_kwargs, check_sizes, parse_devices)
from .copier import PageCopier, copy_view, resolve_copier

__all__ = ["LinearKVCache", "LinearCacheConfig"]


@dataclass(frozen=True)
class LinearCacheConfig:
    """Configuration of a :class:`LinearKVCache` (seed 004's ``CacheConfig``)."""

    num_layers: int
    max_batch_size: int
    max_seq_len: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    devices: tuple


class LinearKVCache(Uncopyable):
    """Static linear KV cache for synchronous batches (seed 004), snake_case.

    Parameters
    ----------
    params : KVCacheParams
        ``cache_strategy`` LINEAR.
    max_batch_size, max_seq_len, num_layers : int
        Slots, tokens per slot, decoder layers. Memory is allocated once.
    devices : sequence of str
        The KV heads are split evenly across them.
    slot_copier : PageCopier, optional
        ``slot_copier(cache, src, dst)`` copies whole batch slots (axis 1) of one device's
        cache tensor, ``src`` and ``dst`` int32 ``[n]`` host tensors, in order (see
        :mod:`kvtvm.manager.copier`); used by :meth:`evict`. Default: the copier registered by
        :mod:`kvtvm` (:func:`kvtvm.ops.copy_slots`).
    """

    strategy = KVCacheStrategy.LINEAR

    def __init__(self, params: KVCacheParams, max_batch_size: int, max_seq_len: int,
                 num_layers: int, devices=("cpu",), slot_copier: PageCopier | None = None):
        import torch

        if not isinstance(params, KVCacheParams) or params.cache_strategy is not self.strategy:
            raise InvalidArgumentError(describe(
                "params", "KVCacheParams with cache_strategy LINEAR",
                getattr(params, "cache_strategy", type(params).__name__)))
        self.params = params
        #: Moves batch slots on :meth:`evict`: ``slot_copier(cache, src, dst)``.
        self.slot_copier = resolve_copier(slot_copier, "slot", "slot_copier")
        self.max_batch_size = check_batch_slots(max_batch_size)
        self.max_seq_len = check_size("max_seq_len", max_seq_len)
        self.num_layers = check_size("num_layers", num_layers)
        params.resolve_skip_layers(self.num_layers)
        self.devices = parse_devices(devices, params)
        self.n_devices = len(self.devices)
        self.device_params = dataclasses.replace(
            params, n_kv_heads=params.heads_per_device(self.n_devices))
        shape = params.cache_shape(self.num_layers, self.max_batch_size, self.max_seq_len,
                                   n_devices=self.n_devices)
        dtype = getattr(torch, params.tensor_dtype)  # uint8 for a quantized cache
        self._cache = [allocate("cache", shape, dtype, d) for d in self.devices]
        # the per-layer views the ops take with this cache's step inputs
        self._views_by_signature = layer_views_by_signature(self._cache, self.device_params,
                                                            self.num_layers)
        self._lock = threading.RLock()
        mb = self.max_batch_size
        self._active = 0
        self._lengths = np.zeros(mb, dtype=np.int64)
        # host staging (int32): lengths[mb] | qo_indptr[mb + 1] | slots[mb]
        self._host = allocate("step tables", (3 * mb + 1,), torch.int32, "cpu",
                              pin_memory=any(d.type == "cuda" for d in self.devices))
        self._host_np = self._host.numpy()
        self._host_np[2 * mb + 1:] = np.arange(mb)
        self._dev = [self._host if d.type == "cpu" else
                     allocate("step tables", (3 * mb + 1,), torch.int32, d)
                     for d in self.devices]
        self._event = None
        self._token_slot = TokenSlot()  # the latest step_inputs' token, killed with the memory
        self._upload()

    # ------------------------------------------------------------------------------------
    # Sizes
    # ------------------------------------------------------------------------------------

    @classmethod
    def estimated_memory_size(cls, params, max_batch_size, max_seq_len, num_layers,
                              available_cache_memory=None, devices=("cpu",), **kwargs) -> int:
        """Bytes allocated on each device: the cache tensor plus the int32 length / slot
        buffer (``available_cache_memory`` is not used)."""
        check_sizes(params, cls.strategy, max_batch_size=max_batch_size,
                    max_seq_len=max_seq_len, num_layers=num_layers)
        check_size_kwargs("estimated_memory_size", kwargs, ("slot_copier",),
                          available_cache_memory)
        n = len(parse_devices(devices))
        return (params.cache_bytes(num_layers, max_batch_size, max_seq_len, n_devices=n)
                + 4 * (3 * max_batch_size + 1))

    @classmethod
    def infer_optimal_batch_size(cls, params, max_seq_len, num_layers, available_cache_memory,
                                 devices=("cpu",), **kwargs) -> int:
        """Most slots of ``max_seq_len`` tokens that fit ``available_cache_memory`` bytes per
        device; at least 1, at most ``2**31 - 1``."""
        check_sizes(params, cls.strategy, max_seq_len=max_seq_len, num_layers=num_layers)
        check_size_kwargs("infer_optimal_batch_size", kwargs, ("slot_copier",))
        available_cache_memory = check_positive_int("available_cache_memory",
                                                    available_cache_memory)
        n = len(parse_devices(devices))
        per_slot = params.bytes_per_token(num_layers, n) * max_seq_len + 12
        return max(1, min(INT32_MAX, (available_cache_memory - 4) // per_slot))

    def device_nbytes(self) -> int:
        """Bytes this cache allocated on each device."""
        c = self._cache[0]
        return c.numel() * c.element_size() + 4 * (3 * self.max_batch_size + 1)

    # ------------------------------------------------------------------------------------
    # Seed 004 verbs
    # ------------------------------------------------------------------------------------

    @property
    def config(self) -> LinearCacheConfig:
        """The cache's configuration."""
        return LinearCacheConfig(self.num_layers, self.max_batch_size, self.max_seq_len,
                                 self.params.n_kv_heads, self.params.head_dim,
                                 self.params.dtype, tuple(str(d) for d in self.devices))

    def _device_index(self, device) -> int:
        if not isinstance(device, (int, np.integer)) or isinstance(device, bool) \
                or not 0 <= device < self.n_devices:
            raise InvalidArgumentError(describe("device", f"an int in [0, {self.n_devices})",
                                                repr(device)))
        return int(device)

    def get_kv_cache_buffer(self, device: int = 0):
        """The whole cache tensor of device ``device`` (not a copy): ``[num_layers,
        max_batch_size, 2, n_kv_heads, max_seq_len, head_dim]`` with this device's
        ``n_kv_heads`` (a quantized cache: uint8 ``[1, max_batch_size, slot_bytes]``).
        InvalidArgumentError unless ``device`` is an int in ``[0, n_devices)``."""
        return self._cache[self._device_index(device)]

    def get_kv_cache_for_decoder_layer(self, decoder_layer_idx: int, device: int = 0):
        """Layer ``decoder_layer_idx``'s cache, ``[max_batch_size, 2, n_kv_heads, max_seq_len,
        head_dim]`` (a view; ``[:, 0]`` is K and ``[:, 1]`` is V, each the ``hnd`` layout
        append_kv takes).

        Raises
        ------
        InvalidArgumentError
            ``decoder_layer_idx`` or ``device`` out of range, or the cache is quantized (one
            byte tensor: take ``step_inputs(...)[d].k_cache(layer)`` / ``v_cache(layer)``).
        """
        layer = decoder_layer_idx
        if not isinstance(layer, (int, np.integer)) or isinstance(layer, bool) \
                or not 0 <= layer < self.num_layers:
            raise InvalidArgumentError(describe("decoder_layer_idx",
                                                f"an int in [0, {self.num_layers})", repr(layer)))
        device = self._device_index(device)
        if self.params.quantized:
            raise InvalidArgumentError(describe(
                "get_kv_cache_for_decoder_layer", "a full-precision cache (a quantized cache "
                "is one byte tensor: take step_inputs(...)[d].k_cache(layer) / v_cache(layer))",
                f"k_cache_dtype={self.params.k_cache_dtype}, "
                f"v_cache_dtype={self.params.v_cache_dtype}"))
        return self._cache[device][layer]

    def __repr__(self) -> str:
        with self._lock:
            active = self._active
        devices = ", ".join(str(d) for d in self.devices)
        return (f"LinearKVCache({self.params.summary()}, layers={self.num_layers}, "
                f"max_batch_size={self.max_batch_size}, max_seq_len={self.max_seq_len}, "
                f"devices=[{devices}], active_batch_size={active})")

    @property
    def active_batch_size(self) -> int:
        """Sequences in the active batch (slots ``0 .. active_batch_size - 1``)."""
        with self._lock:
            return self._active

    @property
    def kv_cache_lengths(self):
        """int32 ``[active_batch_size]`` lengths on the first device (a view of a
        preallocated buffer)."""
        with self._lock:
            return self._dev[0][:self._active]

    def kv_cache_lengths_of(self, device: int = 0):
        """int32 ``[active_batch_size]`` lengths on device ``device``."""
        device = self._device_index(device)
        with self._lock:
            return self._dev[device][:self._active]

    @property
    def host_lengths(self) -> np.ndarray:
        """A host copy of the active lengths."""
        with self._lock:
            return self._lengths[:self._active].copy()

    @property
    def kv_cache_all_empty(self) -> bool:
        """True if every active sequence has length 0."""
        with self._lock:
            return not self._lengths[:self._active].any()

    # seed 004's getters, as methods (the properties above are the Pythonic spelling)
    def get_kv_cache_lengths(self):
        """:attr:`kv_cache_lengths` (seed 004's ``getKVCacheLengths``)."""
        return self.kv_cache_lengths

    def get_config(self) -> LinearCacheConfig:
        """:attr:`config` (seed 004's ``getConfig``)."""
        return self.config

    def get_active_batch_size(self) -> int:
        """:attr:`active_batch_size` (seed 004's ``getActiveBatchSize``)."""
        return self.active_batch_size

    def get_kv_cache_all_empty(self) -> bool:
        """:attr:`kv_cache_all_empty` (seed 004's ``getKVCacheAllEmpty``)."""
        return self.kv_cache_all_empty

    def _on(self, stream):
        """The context of seed 004's ``stream`` argument: the uploads of the lengths run on
        ``stream`` (a ``torch.cuda.Stream``), or on the current stream (None)."""
        import contextlib

        import torch

        if stream is None:
            return contextlib.nullcontext()
        if not isinstance(stream, torch.cuda.Stream):
            raise InvalidArgumentError(describe("stream", "a torch.cuda.Stream or None",
                                                type(stream).__name__))
        return torch.cuda.stream(stream)

    def reset_for_new_sequences(self, host_reuse_kv_cache_lengths, stream=None) -> None:
        """Start a new batch: one sequence per entry of ``host_reuse_kv_cache_lengths``.

        Parameters
        ----------
        host_reuse_kv_cache_lengths : sequence of int, numpy array or host tensor
            ``[batch]`` tokens already in each slot (precomputed K/V to reuse; 0 for none).
        stream : torch.cuda.Stream, optional
            Where the lengths' upload to a GPU runs (default: the current stream).

        Raises
        ------
        InvalidArgumentError
            Not a 1-D sequence of ints, more than ``max_batch_size`` entries, or a negative
            length.
        SequenceTooLongError
            A length passes ``max_seq_len``.
        """
        name = "host_reuse_kv_cache_lengths"
        lengths = self._host_ints(name, host_reuse_kv_cache_lengths)
        if lengths.size > self.max_batch_size:
            raise InvalidArgumentError(describe(name, f"at most max_batch_size="
                                                f"{self.max_batch_size} entries", lengths.size))
        self._check_range(name, lengths)
        with self._lock, self._on(stream):
            self._lengths[:] = 0
            self._lengths[:lengths.size] = lengths
            self._active = int(lengths.size)
            self._upload()

    def commit_sequence_length(self, new_context_lengths=None, stream=None, *,
                               increment=None) -> None:
        """Add this step's tokens to the active lengths.

        Parameters
        ----------
        new_context_lengths : int or tensor
            An int (seed 004's ``increment``, also taken by that name: exactly one of the
            two): every active sequence grew by it (decode). A
            tensor / array / list of ``[active_batch_size]`` ints: sequence ``b`` grew by
            ``new_context_lengths[b]`` (prefill; added, as TensorRT-Edge-LLM's
            ``incrementLengthTensor``; a GPU tensor is read on the host: a sync).
        stream : torch.cuda.Stream, optional
            Where the lengths' upload to a GPU runs (default: the current stream).

        Raises
        ------
        InvalidArgumentError
            A negative count, or not ``active_batch_size`` of them (nothing changes).
        SequenceTooLongError
            A length would pass ``max_seq_len`` (nothing changes).
        """
        if (new_context_lengths is None) == (increment is None):
            raise InvalidArgumentError(describe(
                "new_context_lengths / increment", "exactly one of them",
                "both" if increment is not None else "neither"))
        name = "new_context_lengths" if increment is None else "increment"
        if increment is not None:
            new_context_lengths = increment
        with self._lock, self._on(stream):
            inc = self._step_counts(name, new_context_lengths)
            total = self._lengths[:self._active] + inc
            self._check_range("committed length", total)
            self._lengths[:self._active] = total
            self._upload()

    def set_active_batch_size(self, new_active_batch_size: int) -> None:
        """Set the active batch size (batch eviction: the first ``new_active_batch_size``
        slots stay); slots that become active start empty (a slot left out loses its
        length). InvalidArgumentError unless ``0 <= new_active_batch_size <=
        max_batch_size``."""
        name = "new_active_batch_size"
        n = check_positive_int(name, new_active_batch_size, allow_zero=True)
        if n > self.max_batch_size:
            raise InvalidArgumentError(describe(name, f"at most max_batch_size="
                                                f"{self.max_batch_size}", n))
        with self._lock:
            if n > self._active:
                self._lengths[self._active:n] = 0
            else:
                self._lengths[n:] = 0
            self._active = n
            self._upload()

    def evict(self, keep) -> None:
        """Keep only the sequences at batch indices ``keep``; move them to the front.

        The kept sequences keep their relative batch order: the ``j``-th smallest index of
        ``keep`` becomes batch index ``j``. Their K/V move through the slot copier
        (:func:`kvtvm.ops.copy_slots` by default), then the active batch shrinks to
        ``len(keep)``.

        Parameters
        ----------
        keep : sequence of int
            Distinct indices in ``[0, active_batch_size)``.

        Raises
        ------
        InvalidArgumentError
            An index out of range or repeated (nothing changes).
        KVCacheError
            Slots must move but no slot copier was handed in or registered. A copier's own
            error propagates after the written slots are restored.
        """
        idx = self._host_ints("keep", keep)
        with self._lock:
            if idx.size and ((idx < 0).any() or (idx >= self._active).any()):
                bad = int(idx[np.argmax((idx < 0) | (idx >= self._active))])
                raise InvalidArgumentError(describe(
                    "keep", f"indices in [0, active_batch_size={self._active})", bad))
            if np.unique(idx).size != idx.size:
                raise InvalidArgumentError(describe("keep", "distinct indices", idx.tolist()))
            idx = np.sort(idx)
            moves = [(int(s), j) for j, s in enumerate(idx.tolist()) if s != j]
            if moves:
                import torch

                copier = self.slot_copier
                if copier is None:
                    raise KVCacheError("evict: moving slots needs a slot copier; none was "
                                       "handed in and none is registered "
                                       "(kvtvm.manager.copier)")
                src = torch.tensor([s for s, _ in moves], dtype=torch.int32)
                dst = torch.tensor([d for _, d in moves], dtype=torch.int32)
                # transactional: the slots written are saved first and put back when a copy
                # fails part-way (a round, a device), so a failed evict changes nothing
                dst_long = dst.long()
                saved = [cache.index_select(1, dst_long.to(cache.device))
                         for cache in self._cache]
                try:
                    for cache in self._cache:  # in order: the default splits into rounds
                        copier(copy_view(cache, 1), src, dst)
                except BaseException:
                    for cache, old in zip(self._cache, saved):
                        cache.index_copy_(1, dst_long.to(cache.device), old)
                    raise
            kept = self._lengths[idx].copy()
            self._lengths[:] = 0
            self._lengths[:idx.size] = kept
            self._active = int(idx.size)
            self._upload()

    # ------------------------------------------------------------------------------------
    # Inputs for the ops
    # ------------------------------------------------------------------------------------

    def step_inputs(self, new_tokens) -> list[RaggedKVCacheInputs]:
        """Inputs of :func:`kvtvm.ops.append_kv` (layout ``hnd``) for this step, per device.

        Parameters
        ----------
        new_tokens : int or sequence of int
            New tokens per active sequence this step (an int: the same for all), each in
            ``[0, max_seq_len]``.

        Returns
        -------
        list of RaggedKVCacheInputs
            One per device: ``lookup_table`` int32 ``[batch, 1]`` holding each sequence's
            slot; ``cache_lengths`` int32 ``[batch]`` the current lengths; ``qo_indptr`` int32
            ``[batch + 1]``. Valid until the next ``step_inputs`` or change of lengths or
            batch; afterwards the ops refuse them (:class:`~kvtvm.errors.StaleInputsError`,
            see ``token``).

        Raises
        ------
        InvalidArgumentError
            A negative count, or not ``active_batch_size`` of them.
        SequenceTooLongError
            A length after this step would pass ``max_seq_len``.
        """
        import torch

        with self._lock:
            b = self._active
            new = self._step_counts("new_tokens", new_tokens)
            self._check_range("length after new_tokens", self._lengths[:b] + new)
            mb = self.max_batch_size
            self._wait_host()
            qo = self._host_np[mb:2 * mb + 1]
            qo[0] = 0
            np.cumsum(new, out=qo[1:b + 1])
            self._upload("superseded by a later step_inputs of the same cache")
            end = self._lengths[:b] + new
            max_lengths = torch.tensor([[int(new.max(initial=0)), int(end.max(initial=0))]],
                                       dtype=torch.int32)
            token = self._token_slot.set(
                FetchToken(self._lock, self._views_by_signature, "hnd"), self._cache[0])
            out = []
            for i, buf in enumerate(self._dev):
                cl, qo_t = buf[:b], buf[mb:mb + b + 1]
                lt = buf[2 * mb + 1:2 * mb + 1 + b].view(b, 1)
                stamp(token, cl, qo_t, lt)
                out.append(RaggedKVCacheInputs(
                    blocks=self._cache[i], cache_lengths=cl, lookup_table=lt,
                    max_lengths=max_lengths, qo_indptr=qo_t,
                    seq_ids=tuple(range(b)), num_cached_tokens=(0,) * b,
                    cache_lengths_host=self._host_np[:b].copy(),
                    qo_indptr_host=qo[:b + 1].copy(), params=self.device_params,
                    num_layers=self.num_layers, max_seq_len=self.max_seq_len, device_index=i,
                    token=token))
            return out

    # ------------------------------------------------------------------------------------

    def _host_ints(self, name: str, value, cast: bool = True) -> np.ndarray:
        """A 1-D sequence of ints (a CUDA tensor is copied to the host) as an array: int64
        (``cast``; 2**63 and up refused), else of its own integer type."""
        import torch

        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        arr = host_int_array(name, value)
        return as_int64(name, arr) if cast else arr

    def _step_counts(self, name: str, value) -> np.ndarray:
        """int64 ``[active_batch_size]`` tokens per active sequence from an int (all alike) or
        a sequence of ints, each in ``[0, max_seq_len]`` (a larger one could only pass it; so
        the sums never wrap): InvalidArgumentError / SequenceTooLongError naming ``name``."""
        b = self._active
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            arr = np.array([int(value)], dtype=object)
        else:
            arr = self._host_ints(name, value, cast=False)
            if arr.size != b:
                raise InvalidArgumentError(describe(
                    name, f"[active_batch_size={b}] values", arr.size))
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())  # exact, whatever the integer type
            if lo < 0:
                raise InvalidArgumentError(describe(name, ">= 0", lo))
            if hi > self.max_seq_len:
                raise SequenceTooLongError(describe(
                    name, f"at most max_seq_len={self.max_seq_len} tokens", hi))
        return np.broadcast_to(arr, (b,)).astype(np.int64)

    def _check_range(self, name: str, lengths: np.ndarray) -> None:
        if (lengths < 0).any():
            raise InvalidArgumentError(describe(name, ">= 0",
                                                int(lengths[np.argmax(lengths < 0)])))
        if (lengths > self.max_seq_len).any():
            b = int(np.argmax(lengths > self.max_seq_len))
            raise SequenceTooLongError(describe(
                f"{name}[{b}]", f"at most max_seq_len={self.max_seq_len}", int(lengths[b])))

    def _wait_host(self) -> None:
        """Wait until the last host-to-device copy has read the host staging buffer."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def _upload(self, why: str = "the lengths or the batch changed") -> None:
        """Lengths to the host staging buffer, then one copy per non-CPU device. The inputs
        of the latest ``step_inputs`` no longer describe the buffer: their token dies."""
        import torch

        if self._token_slot.token is not None:
            self._token_slot.token.kill(why)
        mb = self.max_batch_size
        self._wait_host()
        self._host_np[:mb] = self._lengths
        for buf in self._dev:
            if buf is not self._host:
                buf.copy_(self._host, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(torch.cuda.current_stream(buf.device))
