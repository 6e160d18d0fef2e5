"""The abstract KV cache manager (seed 002) and the machinery its table-based managers share.

A manager owns the cache memory (one torch tensor per device), the per-sequence cache lengths
and lookup tables, and hands the model, each step, the inputs its attention needs::

    ids = mgr.claim(2)                                  # reserve sequence slots
    inputs = mgr.fetch([BatchItem(ids[0], prompt0),      # make room for the new tokens,
                        BatchItem(ids[1], prompt1)])     # one RaggedKVCacheInputs per device
    ... model runs, kvtvm.ops.append_kv writes K/V ...
    mgr.step([BatchItem(ids[0], prompt0), ...])          # commit the tokens
    ... fetch / step per generated token ...
    mgr.release(ids[0])

Choices written down here (the seeds are silent on them):

- ``seq_id`` values are slots in ``[0, max_batch_size)``; ``claim`` hands out the lowest free ones.
- A sequence has at most one fetch in flight: ``fetch`` of a sequence whose previous fetch was not
  ``step``-ped raises :class:`SequenceStateError`; ``step`` of a sequence not fetched raises it too.
  ``release`` is always allowed and drops an in-flight fetch.
- ``fetch(batch, num_steps)`` reserves room for ``len(tokens) + num_steps - 1`` tokens; the
  following ``step`` commits ``len(tokens)`` tokens, where its ``tokens`` are the fetched tokens
  followed by 0 .. ``num_steps - 1`` tokens fed in the later steps of a multistep run.
- Atomic or nothing: every public method validates and plans first, then mutates; a call that
  raises leaves tables, lengths, refcounts and free lists as they were.
- Thread safety: every public method holds the manager's ``RLock``; a fetch's inputs live
  until the next fetch, their step, a release of one of their sequences or the freeing of
  the cache memory; ops given them then raise :class:`StaleInputsError` (docs/managers.md).
  A manager is never copied or pickled (:mod:`.uncopyable`).
- ``step`` checks the tokens against the fetch's (a 64-bit fingerprint per sequence, kept at
  fetch): a batch whose tokens differ raises, so the prefix cache never learns wrong tokens.
- Per-step tables live in one int32 buffer per device (:mod:`.tables`), one copy per step.
- No kernels and no TVM here (graph types: :mod:`.symbols`; page copies: :mod:`.copier`).
"""

from __future__ import annotations

import abc
import dataclasses
import operator
import threading
from typing import Any, Sequence

import numpy as np

from ..errors import (InvalidArgumentError, KVCacheCapacityError,
                      SequenceStateError, SequenceTooLongError, UnknownSequenceError,
                      describe)
from ..inputs import (FetchToken, KVCacheInputs, RaggedKVCacheInputs, RaggedKVCacheInputSymbols,
                      TokenBatch, TokenSlot, stamp)
from ..collection import layer_views_by_signature
from .uncopyable import Uncopyable
from ..params import KVCacheParams, KVCacheStrategy
from .args import ItemTokens as _ItemTokens, allocate, check_batch_slots, check_num_steps, \
    check_positive_int, check_size, parse_devices
from .args import row_offsets as _row_offsets
from .fingerprint import fingerprints
from .symbols import TensorSymbol, build_symbols

__all__ = ["KVCacheManager", "parse_devices", "check_positive_int"]

_SEQ_ID = operator.attrgetter("seq_id")
_TOKENS = operator.attrgetter("tokens")


class KVCacheManager(Uncopyable, abc.ABC):
    """Abstract KV cache manager (seed 002), snake_case.

    Parameters
    ----------
    params : KVCacheParams
        Cache parameters; ``params.cache_strategy`` must match the manager.
    max_batch_size : int
        Sequences that can be claimed at once; ``seq_id`` values lie in ``[0, max_batch_size)``.
    max_seq_len : int
        Most tokens one sequence may hold.
    num_layers : int
        Decoder layers; each has a K and a V view of the cache tensor.
    devices : sequence of str or torch.device
        Devices holding the cache; with several, the KV heads are split evenly across them and
        ``fetch`` returns one inputs object per device.
    """

    #: The strategy a concrete manager implements.
    strategy: KVCacheStrategy
    #: ``ids ->`` the tokens each lookup-table row's pages hold (``FetchToken.capacity``; None)
    _row_capacity = None

    def __init__(self, params: KVCacheParams, max_batch_size: int, max_seq_len: int,
                 num_layers: int, devices: Sequence = ("cpu",)):
        if not isinstance(params, KVCacheParams):
            raise InvalidArgumentError(describe("params", "a KVCacheParams", type(params).__name__))
        if params.cache_strategy is not self.strategy:
            raise InvalidArgumentError(describe(
                "params.cache_strategy", f"{self.strategy.name} for {type(self).__name__}",
                params.cache_strategy.name))
        self.params = params
        self.max_batch_size = check_batch_slots(max_batch_size)
        self.max_seq_len = check_size("max_seq_len", max_seq_len)
        self.num_layers = check_size("num_layers", num_layers)
        params.resolve_skip_layers(self.num_layers)
        self.devices = parse_devices(devices, params)
        self.n_devices = len(self.devices)
        heads = params.heads_per_device(self.n_devices)
        #: Parameters of the cache one device holds (``n_kv_heads`` = heads per device).
        self.device_params = dataclasses.replace(params, n_kv_heads=heads)
        self._lock = threading.RLock()
        mb = self.max_batch_size
        self._claimed = np.zeros(mb, dtype=bool)
        self._lengths = np.zeros(mb, dtype=np.int64)       # committed tokens per slot
        self._pending = np.full(mb, -1, dtype=np.int64)    # tokens fetched, -1: none in flight
        self._pending_steps = np.zeros(mb, dtype=np.int64)
        self._mark = np.zeros(mb, dtype=np.int64)         # scratch of the duplicate check
        self._positions = np.arange(mb, dtype=np.int64)
        self._fingerprint = np.zeros(mb, dtype=np.uint64)  # of the fetched tokens per slot
        self._token_slot = TokenSlot()  # the latest fetch's token, killed with the memory
        self._token_ids = np.zeros(0, dtype=np.int64)      # its sequences
        self._in_token = np.zeros(mb, dtype=bool)          # ... as a mask over the slots

    # -- Abstract / per-strategy parts -----------------------------------------------------

    @classmethod
    @abc.abstractmethod
    def estimated_memory_size(cls, params, max_batch_size, max_seq_len, num_layers,
                              available_cache_memory=None, devices=("cpu",), **kwargs) -> int:
        """Bytes the manager allocates on each device (cache tensor + per-step tables)."""

    @classmethod
    @abc.abstractmethod
    def infer_optimal_batch_size(cls, params, max_seq_len, num_layers, available_cache_memory,
                                 devices=("cpu",), **kwargs) -> int:
        """Largest batch whose sequences can all reach ``max_seq_len`` in the given memory."""

    @abc.abstractmethod
    def _fetch_plan_apply(self, tokens, ids: np.ndarray, counts: np.ndarray, num_steps: int,
                          lengths: np.ndarray, total: np.ndarray):
        """Reserve room and fill the lookup rows of the host table buffer; atomic.

        ``lengths`` are the committed lengths of ``ids`` and ``total`` the lengths to make room
        for (``lengths + counts + num_steps - 1``). Returns ``(start, hits)``: int64 arrays
        ``[batch]`` of the cache length each item's new tokens start at, and of the leading
        tokens already cached (prefix hits), or None when there are none.
        """

    def _commit(self, tokens, ids: np.ndarray, counts: np.ndarray) -> None:
        """Strategy hook run by ``step`` after validation, before lengths change; it may raise
        only before it changes anything (reading ``tokens``)."""

    def _release_slot(self, seq_id: int) -> None:
        """Strategy hook: return a released sequence's memory."""

    # -- Slots -----------------------------------------------------------------------------

    def claim(self, n: int) -> list[int]:
        """Claim ``n`` sequence slots for incoming requests.

        Parameters
        ----------
        n : int
            Number of sequences.

        Returns
        -------
        list of int
            The new ``seq_id`` values (the lowest free slots), to pass to ``fetch``.

        Raises
        ------
        KVCacheCapacityError
            Fewer than ``n`` slots are free.
        """
        n = check_positive_int("n", n, allow_zero=True)
        with self._lock:
            free = np.flatnonzero(~self._claimed)
            if n > free.size:
                raise KVCacheCapacityError(
                    f"claim: asked for {n} sequence slots, {free.size} of "
                    f"{self.max_batch_size} are free")
            ids = free[:n]
            self._claim_ids(ids)
            return [int(i) for i in ids]

    def external_claim(self, seq_ids: Sequence[int]) -> None:
        """Claim the given ``seq_ids`` (reserved by the caller).

        Raises
        ------
        InvalidArgumentError
            An id is not an int in ``[0, max_batch_size)`` or appears twice.
        SequenceStateError
            An id is already claimed.
        """
        if isinstance(seq_ids, (int, np.integer)):
            seq_ids = [seq_ids]
        if not isinstance(seq_ids, (list, tuple, np.ndarray)):
            raise InvalidArgumentError(describe("seq_ids", "a list of ints",
                                                type(seq_ids).__name__))
        ids = []
        for s in seq_ids:
            if not isinstance(s, (int, np.integer)) or isinstance(s, bool) \
                    or not 0 <= s < self.max_batch_size:
                raise InvalidArgumentError(describe(
                    "seq_id", f"an int in [0, {self.max_batch_size})", repr(s)))
            ids.append(int(s))
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError(describe("seq_ids", "distinct ids", ids))
        with self._lock:
            taken = [s for s in ids if self._claimed[s]]
            if taken:
                raise SequenceStateError(
                    f"external_claim: seq_id {taken[0]} is already claimed "
                    f"(taken among those asked: {taken})")
            self._claim_ids(np.asarray(ids, dtype=np.int64))

    def _claim_ids(self, ids: np.ndarray) -> None:
        self._claimed[ids] = True
        self._lengths[ids] = 0
        self._pending[ids] = -1

    def contains(self, seq_id: int) -> bool:
        """True if ``seq_id`` is claimed and not released."""
        with self._lock:
            return (isinstance(seq_id, (int, np.integer)) and not isinstance(seq_id, bool)
                    and 0 <= seq_id < self.max_batch_size and bool(self._claimed[seq_id]))

    def __repr__(self) -> str:
        with self._lock:
            active = int(self._claimed.sum())
        devices = ", ".join(str(d) for d in self.devices)
        return (f"{type(self).__name__}({self.params.summary()}, layers={self.num_layers}, "
                f"max_batch_size={self.max_batch_size}, max_seq_len={self.max_seq_len}"
                f"{self._repr_geometry()}, devices=[{devices}], sequences={active})")

    def _repr_geometry(self) -> str:
        """The manager's own sizes for ``repr`` (pages, blocks), after ``max_seq_len``."""
        return ""

    @property
    def slots_remaining(self) -> set[int]:
        """The ``seq_id`` slots that can still be claimed."""
        with self._lock:
            return {int(i) for i in np.flatnonzero(~self._claimed)}

    def release(self, seq_id: int) -> None:
        """Release ``seq_id``: its memory returns to the pool and the id can be claimed again.

        Raises
        ------
        UnknownSequenceError
            ``seq_id`` was never claimed or was already released.
        """
        with self._lock:
            self._check_known(seq_id, "release")
            self._kill_token_of(np.array([int(seq_id)]), f"seq_id {int(seq_id)} was released")
            self._release_slot(int(seq_id))
            self._claimed[seq_id] = False
            self._lengths[seq_id] = 0
            self._pending[seq_id] = -1

    def _kill_token_of(self, ids: np.ndarray, why: str) -> None:
        """Kill the latest fetch's token when ``ids`` share a sequence with its batch."""
        if self._token_slot.token is not None and self._in_token[ids].any():
            self._token_slot.token.kill(why)

    def _check_known(self, seq_id, what: str) -> int:
        if not isinstance(seq_id, (int, np.integer)) or isinstance(seq_id, bool):
            raise InvalidArgumentError(describe("seq_id", "an int", repr(seq_id)))
        if not 0 <= seq_id < self.max_batch_size or not self._claimed[seq_id]:
            raise UnknownSequenceError(
                f"{what}: seq_id {seq_id} is not claimed (never claimed, or already released)")
        return int(seq_id)

    def _check_settled(self, seq_id, what: str) -> int:
        """``seq_id`` as a claimed slot with no fetch in flight (fork, pop, export need one)."""
        sid = self._check_known(seq_id, what)
        if self._pending[sid] >= 0:
            raise SequenceStateError(
                f"{what}: seq_id {sid} has a fetch in flight; step() it before {what}()")
        return sid

    def cache_length(self, seq_id: int) -> int:
        """Committed tokens of ``seq_id``."""
        with self._lock:
            return int(self._lengths[self._check_known(seq_id, "cache_length")])

    @property
    def cache_lengths(self) -> dict[int, int]:
        """Committed tokens of every claimed sequence, ``{seq_id: length}`` (a copy; seed
        000's ``cache_lengths``)."""
        with self._lock:
            return {int(s): int(self._lengths[s]) for s in np.flatnonzero(self._claimed)}

    # -- Batches ---------------------------------------------------------------------------

    def _parse_batch(self, batch, what: str):
        """Validated ``(ids, counts, tokens)`` of a batch (a list of batch items or a
        :class:`TokenBatch`): claimed, distinct, at least one token each. ``tokens`` reads the
        items' tokens (``.tokens``: all, flat int64; ``.tokens_of(b)``) only when asked."""
        if isinstance(batch, TokenBatch):
            ids, counts, tokens = batch.seq_ids, batch.counts, batch
            n = ids.size
        elif isinstance(batch, (list, tuple)):
            n = len(batch)
            try:
                id_list = list(map(_SEQ_ID, batch))
                if set(map(type, id_list)) & {bool, np.bool_}:  # True would pass as seq_id 1
                    raise TypeError(f"a bool seq_id in {id_list}")
                ids = np.array(id_list)
                seqs = list(map(_TOKENS, batch))
                counts = np.fromiter(map(len, seqs), dtype=np.int64, count=n)
            except (AttributeError, TypeError) as err:
                raise InvalidArgumentError(describe(
                    f"{what}: batch items", "objects with .seq_id (int) and .tokens (sequence)",
                    repr(err))) from None
            tokens = _ItemTokens(seqs, counts, what)
        else:
            raise InvalidArgumentError(describe(f"{what}: batch",
                                                "a list of batch items or a TokenBatch",
                                                type(batch).__name__))
        if n == 0:
            raise InvalidArgumentError(describe(f"{what}: batch", "at least one item", "[]"))
        if ids.dtype.kind not in "iu":
            raise InvalidArgumentError(describe(f"{what}: seq_id", "ints", ids.tolist()))
        if ids.min() < 0 or ids.max() >= self.max_batch_size or not self._claimed[ids].all():
            inside = (ids >= 0) & (ids < self.max_batch_size)
            bad = ~inside
            bad[inside] = ~self._claimed[ids[inside]]
            s = int(ids[np.argmax(bad)])
            raise UnknownSequenceError(
                f"{what}: seq_id {s} is not claimed (never claimed, or already released)")
        if n > 1:  # duplicates: the last write of a repeated id wins, so positions differ
            mark, pos = self._mark, self._positions[:n]
            mark[ids] = pos
            if np.count_nonzero(mark[ids] != pos):
                raise InvalidArgumentError(describe(f"{what}: seq_ids", "distinct ids",
                                                    ids.tolist()))
        if counts.min() < 1:
            b = int(np.argmin(counts))
            raise InvalidArgumentError(describe(
                f"{what}: tokens of seq_id {int(ids[b])}", "at least one token", 0))
        return ids.astype(np.int64, copy=False), counts, tokens

    def fetch(self, batch: Sequence[Any], num_steps: int = 1) -> list[RaggedKVCacheInputs]:
        """Make room for the batch's new tokens and return the inputs of the KV cache kernels.

        Parameters
        ----------
        batch : list of BatchItem, or TokenBatch
            Items with ``seq_id`` and ``tokens`` (the tokens each sequence adds this step), or
            the same batch as arrays (no Python object per sequence: cheaper at large batch).
        num_steps : int
            Steps of a multistep run: room is reserved for ``len(tokens) + num_steps - 1``
            tokens per sequence; advance between steps with :meth:`increment_cache_lengths`.

        Returns
        -------
        list of RaggedKVCacheInputs
            One per device. ``max_lengths`` is ``[num_steps, 2]``: per step, (max new tokens,
            max cache length after the step's tokens), e.g. a prompt of 5 and 3 steps gives
            ``[[5, 5], [1, 6], [1, 7]]``.

        Raises
        ------
        InvalidArgumentError, UnknownSequenceError
            A malformed batch (repeated ids, no tokens) or ``num_steps``; an unclaimed id.
        SequenceStateError
            A sequence already has a fetch in flight (no ``step`` since).
        SequenceTooLongError
            A sequence would pass ``max_seq_len``.
        KVCacheCapacityError
            Not enough free pages (PAGED).
        """
        num_steps = check_num_steps(num_steps, self.max_seq_len)
        with self._lock:
            ids, counts, tokens = self._parse_batch(batch, "fetch")
            if self._pending[ids].max() >= 0:
                s = int(ids[np.argmax(self._pending[ids] >= 0)])
                raise SequenceStateError(
                    f"fetch: seq_id {s} already has a fetch in flight; call step() to commit "
                    "it (or release() it) before fetching again")
            lengths = self._lengths[ids]
            total = lengths + counts + (num_steps - 1)
            end = int(total.max())
            if end > self.max_seq_len:
                b = int(np.argmax(total))
                raise SequenceTooLongError(describe(
                    f"fetch: length of seq_id {int(ids[b])} after this fetch "
                    f"({int(self._lengths[ids[b]])} cached + {int(counts[b])} new + "
                    f"{num_steps - 1} more steps of num_steps={num_steps})",
                    f"at most max_seq_len={self.max_seq_len}", int(total[b])))
            # read the tokens (they may be refused) before anything changes
            fingerprint = fingerprints(tokens.tokens, counts, counts)
            self._tables.wait_host_free()
            start, hits = self._fetch_plan_apply(tokens, ids, counts, num_steps, lengths,
                                                 total)
            # -- nothing below raises: fill the per-step tables and hand them out --------
            n = ids.size
            tables = self._tables
            new = counts if hits is None else counts - hits
            tables.cache_lengths[:n] = start
            qo = tables.qo_indptr
            qo[0] = 0
            np.cumsum(new, out=qo[1:n + 1])
            self._pending[ids] = counts
            self._pending_steps[ids] = num_steps
            self._fingerprint[ids] = fingerprint
            tables.upload(n)
            end0 = end - (num_steps - 1)  # max of lengths + counts
            max_lengths = np.empty((num_steps, 2), dtype=np.int32)
            max_lengths[0] = (new.max(), end0)
            if num_steps > 1:
                max_lengths[1:, 0] = 1
                max_lengths[1:, 1] = end0 + np.arange(1, num_steps)
            return self._make_inputs(ids, hits, max_lengths, n)

    def _make_inputs(self, ids, hits, max_lengths, n) -> list[RaggedKVCacheInputs]:
        import torch

        tables = self._tables
        seq_ids = tuple(ids.tolist())
        cached = (0,) * n if hits is None else tuple(hits.tolist())
        cl_host = tables.cache_lengths[:n].copy()
        qo_host = tables.qo_indptr[:n + 1].copy()
        max_t = torch.from_numpy(max_lengths)
        if self._token_slot.token is not None:
            self._token_slot.token.kill("superseded by a later fetch of the same manager")
        self._in_token[self._token_ids] = False
        held = self._row_capacity(ids) if self._row_capacity else None
        token = self._token_slot.set(FetchToken(self._lock, self._views_by_signature, "nhd",
                                                held), self._blocks[0])
        self._token_ids = ids.copy()
        self._in_token[ids] = True
        out = []
        for dev in range(self.n_devices):
            cl, qo, lt = tables.views(dev, n)
            stamp(token, cl, qo, lt)
            out.append(RaggedKVCacheInputs(
                blocks=self._blocks[dev], cache_lengths=cl, lookup_table=lt,
                max_lengths=max_t, qo_indptr=qo, seq_ids=seq_ids, num_cached_tokens=cached,
                cache_lengths_host=cl_host, qo_indptr_host=qo_host, params=self.device_params,
                num_layers=self.num_layers, max_seq_len=self.max_seq_len, device_index=dev,
                token=token))
        return out

    def step(self, batch: Sequence[Any]) -> None:
        """Commit the tokens of a fetched batch (and, with prefix caching, cache full pages).

        Parameters
        ----------
        batch : list of BatchItem, or TokenBatch
            For each sequence, the tokens fetched, followed by the tokens fed in the later
            steps of a multistep fetch (0 .. ``num_steps - 1`` of them).

        Raises
        ------
        InvalidArgumentError, UnknownSequenceError
            A malformed batch; a ``seq_id`` not claimed.
        SequenceStateError
            A sequence has no fetch in flight, or its tokens do not match the fetch's.
        """
        with self._lock:
            ids, counts, tokens = self._parse_batch(batch, "step")
            pending = self._pending[ids]
            if pending.min() < 0:
                s = int(ids[np.argmax(pending < 0)])
                raise SequenceStateError(
                    f"step: seq_id {s} has no fetch in flight; call fetch() before step()")
            bad = None
            if np.count_nonzero(counts != pending):  # fine only within a multistep fetch
                bad = (counts < pending) | (counts > pending + self._pending_steps[ids] - 1)
            if bad is not None and np.count_nonzero(bad):
                b = int(np.argmax(bad))
                lo = int(pending[b])
                hi = lo + int(self._pending_steps[ids[b]]) - 1
                raise SequenceStateError(describe(f"step: tokens of seq_id {int(ids[b])}", (
                    f"between {lo} and {hi} tokens (as fetched)" if hi > lo else f"the {lo} "
                    "tokens fetched (more only after fetch(..., num_steps=n))"), int(counts[b])))
            differs = fingerprints(tokens.tokens, counts, pending) != self._fingerprint[ids]
            if np.count_nonzero(differs):
                b = int(np.argmax(differs))
                later = ", then any later ones" if self._pending_steps[ids[b]] > 1 else ""
                raise SequenceStateError(describe(
                    f"step: tokens of seq_id {int(ids[b])}",
                    f"the {int(pending[b])} tokens fetched{later}",
                    "different tokens (the cache holds K/V of the fetched ones)"))
            self._kill_token_of(ids, "its batch was committed by step()")
            self._commit(tokens, ids, counts)
            self._lengths[ids] += counts
            self._pending[ids] = -1

    def increment_cache_lengths(self, kv_cache_inputs, prev_model_inputs=None):
        """Inputs of the next step of a multistep run, computed on the device.

        No host sync and no change to the manager's state: the batch stays in flight until
        ``step``. ``cache_lengths`` grows by each item's new tokens of the previous step,
        ``max_lengths`` drops its first row, every item now adds one token (``qo_indptr =
        arange(batch + 1)``). Returns a list (one per device), or one if one was given.

        Parameters
        ----------
        kv_cache_inputs : list of RaggedKVCacheInputs, or one
            The previous step's inputs (one per device).
        prev_model_inputs : object, optional
            Anything with ``qo_indptr`` or ``input_row_offsets`` (int32 ``[batch + 1]``), or
            that tensor; default: the ``qo_indptr`` carried by ``kv_cache_inputs``.

        Raises
        ------
        StaleInputsError, InvalidArgumentError, SequenceStateError
            Inputs superseded, not this manager's latest fetch, or with no steps left.
        """
        import torch

        single = isinstance(kv_cache_inputs, KVCacheInputs)
        if not single and not isinstance(kv_cache_inputs, (list, tuple)):
            raise InvalidArgumentError(describe("kv_cache_inputs", "RaggedKVCacheInputs or a "
                                                "list of them", type(kv_cache_inputs).__name__))
        items, out = [kv_cache_inputs] if single else list(kv_cache_inputs), []
        with self._lock:  # a fetch on another thread rewrites the tables read here
            for inp in items:
                if not isinstance(inp, RaggedKVCacheInputs):
                    raise InvalidArgumentError(describe(
                        "kv_cache_inputs", "RaggedKVCacheInputs", type(inp).__name__))
                inp.check_live()  # StaleInputsError: a later fetch, their step, a release
                if inp.token is None or inp.token is not self._token_slot.token:  # another's
                    raise InvalidArgumentError(describe(
                        "kv_cache_inputs", "inputs of this manager's latest fetch",
                        "other inputs"))
                if inp.max_lengths.shape[0] < 2:
                    raise SequenceStateError(
                        "increment_cache_lengths: no steps left in max_lengths (fetch with "
                        "num_steps > 1 reserves room for more steps)")
                qo_prev, qo_prev_host = _row_offsets(prev_model_inputs, inp)
                b, dev = inp.cache_lengths.shape[0], inp.cache_lengths.device
                qo_prev = qo_prev.to(dev, non_blocking=True)
                new_cl = (inp.cache_lengths + (qo_prev[1:] - qo_prev[:-1])).to(torch.int32)
                cl_host = None if qo_prev_host is None or inp.cache_lengths_host is None else \
                    (inp.cache_lengths_host + np.diff(qo_prev_host)).astype(np.int32)
                out.append(dataclasses.replace(
                    inp, cache_lengths=new_cl, max_lengths=inp.max_lengths[1:],
                    qo_indptr=torch.arange(b + 1, dtype=torch.int32, device=dev),
                    num_cached_tokens=(0,) * b, cache_lengths_host=cl_host,
                    qo_indptr_host=np.arange(b + 1, dtype=np.int32)))
        return out[0] if single else out

    # -- Graph integration -----------------------------------------------------------------

    def num_kv_inputs(self) -> int:
        """KV inputs per device: blocks, cache_lengths, lookup_table, max_lengths."""
        return 4

    def input_specs(self) -> list[RaggedKVCacheInputSymbols]:
        """Shape and dtype of each input tensor, one entry per device, as plain data.

        Each field is a :class:`~kvtvm.manager.symbols.TensorSymbol`: ``blocks`` has the cache
        tensor's concrete shape and dtype; ``cache_lengths`` int32 ``("batch",)``;
        ``lookup_table`` int32 ``("batch", width)``; ``max_lengths`` int32
        ``("num_steps", 2)`` (``"batch"`` and ``"num_steps"`` are symbolic int64 dims).
        """
        out = []
        for dev in range(self.n_devices):
            out.append(RaggedKVCacheInputSymbols(
                blocks=TensorSymbol(tuple(int(s) for s in self._blocks[dev].shape),
                                    self.params.tensor_dtype),
                cache_lengths=TensorSymbol(("batch",), "int32"),
                lookup_table=TensorSymbol(("batch", self._tables.width), "int32"),
                max_lengths=TensorSymbol(("num_steps", 2), "int32")))
        return out

    def input_symbols(self) -> list[RaggedKVCacheInputSymbols]:
        """TVM Relax struct info of each input tensor, one entry per device.

        :meth:`input_specs` typed by the Relax integration
        (:func:`kvtvm.integrations.relax.struct_info_of`, registered by :mod:`kvtvm`):
        ``batch`` and ``num_steps`` are symbolic int64 vars; the cache shape and the lookup
        table width are concrete.
        """
        return build_symbols(self.input_specs())

    # -- Shared helpers --------------------------------------------------------------------

    @property
    def blocks(self):
        """The cache tensor of each device (list of torch tensors)."""
        return list(self._blocks)

    def _allocate_blocks(self, shape) -> list:
        import torch

        dtype = getattr(torch, self.params.tensor_dtype)  # uint8 for a quantized cache
        blocks = [allocate("cache", shape, dtype, d) for d in self.devices]
        # the per-layer views the ops take with this manager's fetch tables
        self._views_by_signature = layer_views_by_signature(blocks, self.device_params,
                                                            self.num_layers)
        return blocks

    def device_nbytes(self) -> int:
        """Bytes this manager allocated on each device (cache + per-step tables)."""
        b = self._blocks[0]
        return b.numel() * b.element_size() + self._tables.device_nbytes()
