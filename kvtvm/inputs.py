"""What a manager hands a model each step: batch items in, KV cache inputs out.

``fetch`` takes a list of batch items (anything with ``.seq_id`` and ``.tokens``; :class:`BatchItem`
is the plain one), or the same batch as arrays (:class:`TokenBatch`), and returns one
:class:`RaggedKVCacheInputs` per device. The four seed-002
fields (``blocks``, ``cache_lengths``, ``lookup_table``, ``max_lengths``) are what the attention
kernels take; the extra fields carry what an engine needs to call :func:`kvtvm.ops.append_kv` and
the attention ops straight from the inputs (``qo_indptr``, per-layer views through
:meth:`RaggedKVCacheInputs.collection`) and host-side copies of the small tables, so reading a
length never syncs a device.

Lifetime: ``cache_lengths``, ``lookup_table`` and ``qo_indptr`` are views of the manager's
preallocated per-step buffers (CUDA-graph friendly: fixed addresses, updated in place). They stay
valid until the next ``fetch`` of the same manager overwrites them, the batch's ``step`` commits
it, or one of its sequences is released. Each fetch's inputs carry a :class:`FetchToken` (also
stamped on its three table tensors); the manager kills it at that moment, and every op and plan
given a table tensor of a dead token raises :class:`~kvtvm.errors.StaleInputsError` before
writing anything (see docs/managers.md, "Threads").
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .errors import InvalidArgumentError, StaleInputsError, describe
from .params import KVCacheParams, KVCacheStrategy

__all__ = [
    "BatchItem", "TokenBatch", "KVCacheInputs", "RaggedKVCacheInputs", "PaddedKVCacheInputs",
    "KVCacheInputsSequence", "KVCacheInputSymbols", "RaggedKVCacheInputSymbols",
    "ContinuousBatchingKVCacheInputSymbols", "FetchToken",
    "stamp", "token_of", "check_live",
]


class FetchToken:
    """Whether the inputs of one ``fetch`` may still be used.

    The manager creates one per fetch and kills it when the fetch's tables stop describing it:
    at the manager's next ``fetch`` (which overwrites the shared table buffers), at the
    batch's ``step`` and at a ``release`` of one of its sequences. The ops read it through the
    table tensors (:func:`token_of`), so they learn staleness without knowing managers.
    """

    __slots__ = ("live", "why", "lock", "views", "layout", "capacity")

    def __init__(self, lock=None, views=None, layout=None, capacity=None):
        #: the manager's lock: a launch holds it from its liveness check to the kernel's
        #: return (CPU) or enqueue (CUDA), so a concurrent fetch cannot slip in between
        self.live, self.why, self.lock = True, "", lock
        #: the manager's per-layer cache views, ``view_signature -> (layer, kv, dtype,
        #: device index)``
        #: (:func:`kvtvm.collection.layer_views_by_signature`; built once per manager): with
        #: these tables the ops take only these views -- K as K, V as V, of one layer
        self.views = views or {}
        #: the token layout of the manager's per-layer views ("nhd", "hnd"; None: unknown)
        self.layout = layout
        #: int64 ``[batch]``: the tokens the pages of each row of the fetch's lookup table hold
        #: (None: only the table's width bounds them). A PAGED table pads a row past its pages
        #: with 0, a page index of another sequence, so the ops refuse a cache length past
        #: these (:func:`kvtvm.ops.checks.check_batch_indices`)
        self.capacity = capacity

    def kill(self, why: str) -> None:
        """Mark the inputs superseded (the first reason is kept)."""
        if self.live:
            self.live, self.why = False, why

    def check(self, name: str) -> None:
        """Raise :class:`StaleInputsError` naming ``name`` when the inputs are superseded."""
        if not self.live:
            raise StaleInputsError(
                f"{name}: inputs of a superseded fetch ({self.why}); use the inputs of the "
                "latest fetch -- nothing was written")

    def __repr__(self) -> str:
        return "FetchToken(live)" if self.live else f"FetchToken(dead: {self.why})"


class TokenSlot:
    """A manager's latest fetch token, killed when the manager's cache memory goes: a new
    manager may then be given the same memory, and its cache views would match the dead
    tables (an append with them wrote into the new manager's sequences). Watched is the
    manager's first cache tensor, which its inputs hold too: inputs kept alive keep their
    memory, and stay usable."""

    __slots__ = ("token", "_watched")

    def __init__(self):
        self.token: FetchToken | None = None
        self._watched = False

    def set(self, token: FetchToken, cache) -> FetchToken:
        """Hold ``token`` (returned) of the manager whose first cache tensor is ``cache``."""
        if not self._watched:
            weakref.finalize(cache, _kill_held, self)
            self._watched = True
        self.token = token
        return token


def _kill_held(slot: TokenSlot) -> None:
    if slot.token is not None:
        slot.token.kill("its manager's cache memory was freed")


#: Attribute of a table tensor holding its fetch's token (torch tensors take attributes).
_TOKEN_ATTR = "_kvtvm_fetch_token"


def stamp(token: FetchToken, *tensors) -> None:
    """Attach ``token`` to each tensor (fresh view objects of one fetch)."""
    for t in tensors:
        setattr(t, _TOKEN_ATTR, token)


def token_of(tensor) -> "FetchToken | None":
    """The fetch token stamped on ``tensor`` (None for a tensor no manager handed out)."""
    return getattr(tensor, _TOKEN_ATTR, None)


def check_live(name: str, token: "FetchToken | None") -> None:
    """Raise :class:`StaleInputsError` naming ``name`` when ``token`` is dead."""
    if token is not None:
        token.check(name)


@dataclass
class BatchItem:
    """One sequence of a batch: which sequence, and the tokens it adds to the cache this step.

    Parameters
    ----------
    seq_id : int
        An id returned by ``claim`` / ``external_claim`` / ``fork``.
    tokens : sequence of int
        Token ids added this step. For a new sequence with prefix caching this is the whole
        prompt; the manager tells how many of them are already cached
        (``RaggedKVCacheInputs.num_cached_tokens``). At ``step`` after a multistep fetch, the
        fetched tokens followed by the tokens fed in the later steps.
    """

    seq_id: int
    tokens: Sequence[int]


def host_int_array(name: str, values) -> np.ndarray:
    """``values`` (a list, numpy array or CPU torch tensor of ints) as a 1-D integer array of
    its own dtype; bools, ragged nesting, other ranks and non-integers raise
    :class:`InvalidArgumentError` naming ``name``."""
    if isinstance(values, (list, tuple)) and set(map(type, values)) & {bool, np.bool_}:
        raise InvalidArgumentError(describe(name, "ints", f"a bool in {list(values)}"))
    try:
        arr = np.asarray(values)
    except (TypeError, RuntimeError, ValueError) as err:  # e.g. a CUDA tensor (a host copy
        # would sync), or ragged nesting
        raise InvalidArgumentError(describe(name, "a host (CPU) 1-D array of ints",
                                            type(values).__name__)) from err
    if arr.ndim != 1:
        raise InvalidArgumentError(describe(f"{name} rank", "a 1-D array", arr.ndim))
    if arr.dtype.kind not in "iu" and arr.size:
        raise InvalidArgumentError(describe(f"{name} dtype", "integers", arr.dtype))
    return arr


def _host_int_vector(name: str, values) -> np.ndarray:
    """:func:`host_int_array` as int64."""
    return as_int64(name, host_int_array(name, values))


def as_int64(name: str, arr: np.ndarray) -> np.ndarray:
    """An integer array as int64 (no copy when it is one); uint64 values of 2**63 and more
    (they would wrap to negative ids) raise :class:`InvalidArgumentError` naming ``name``."""
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size \
            and int(arr.max()) > np.iinfo(np.int64).max:
        raise InvalidArgumentError(describe(name, "values below 2**63", int(arr.max())))
    return arr.astype(np.int64, copy=False)


class TokenBatch:
    """A batch held as arrays: what :class:`BatchItem` lists say, without a Python object per
    sequence.

    ``fetch`` and ``step`` take a ``TokenBatch`` wherever they take a list of batch items. An
    engine that keeps its batch in numpy or torch (sampled tokens come out of the model as a
    tensor) hands it over with no per-sequence Python work, which at batch 256 is most of the
    host cost of a step. The arrays are read, not kept: the manager copies what it stores.

    Parameters
    ----------
    seq_ids : array of int, ``[n]``
        Sequence ids, in batch order (host memory: list, numpy array or CPU tensor).
    tokens : array of int, ``[sum(counts)]``
        The new tokens of every item, item after item: item ``b`` adds
        ``tokens[offsets[b]:offsets[b + 1]]``.
    counts : array of int, ``[n]``, optional
        Tokens per item; by default one each (a decode step), so ``tokens`` is ``[n]``.

    Raises
    ------
    InvalidArgumentError
        An array is not 1-D host ints, a count is negative, or the sizes disagree.

    Examples
    --------
    >>> TokenBatch([3, 7], [11, 12, 13], counts=[2, 1]).tokens_of(0)
    array([11, 12])
    """

    __slots__ = ("seq_ids", "tokens", "counts", "offsets")

    def __init__(self, seq_ids, tokens, counts=None):
        ids = _host_int_vector("TokenBatch seq_ids", seq_ids)
        toks = _host_int_vector("TokenBatch tokens", tokens)
        n = ids.size
        if counts is None:
            if toks.size != n:
                raise InvalidArgumentError(describe(
                    "TokenBatch tokens", f"{n} tokens (one per sequence, no counts given)",
                    toks.size))
            cnt = np.ones(n, dtype=np.int64)
        else:
            cnt = _host_int_vector("TokenBatch counts", counts)
            if cnt.size != n:
                raise InvalidArgumentError(describe("TokenBatch counts", f"{n} values", cnt.size))
            if (cnt < 0).any():
                raise InvalidArgumentError(describe("TokenBatch counts", "non-negative counts",
                                                    cnt.tolist()))
            if int(cnt.sum()) != toks.size:
                raise InvalidArgumentError(describe(
                    "TokenBatch tokens", f"sum(counts) = {int(cnt.sum())} tokens", toks.size))
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(cnt, out=offsets[1:])
        self.seq_ids, self.tokens, self.counts, self.offsets = ids, toks, cnt, offsets

    @classmethod
    def from_items(cls, items) -> "TokenBatch":
        """The same batch as a list of :class:`BatchItem` (or anything with ``seq_id`` and
        ``tokens``)."""
        seqs = [list(it.tokens) for it in items]
        flat = [t for s in seqs for t in s]
        return cls([it.seq_id for it in items], np.array(flat, dtype=np.int64),
                   [len(s) for s in seqs])

    def tokens_of(self, b: int) -> np.ndarray:
        """int64 ``[counts[b]]``: the tokens item ``b`` adds."""
        return self.tokens[self.offsets[b]:self.offsets[b + 1]]

    def __len__(self) -> int:
        return self.seq_ids.size

    def __getitem__(self, b: int) -> BatchItem:
        if not -len(self) <= b < len(self):
            raise IndexError(f"TokenBatch index {b} out of range for {len(self)} items")
        b %= len(self)
        return BatchItem(int(self.seq_ids[b]), self.tokens_of(b).tolist())

    def __iter__(self):
        return (self[b] for b in range(len(self)))

    def __repr__(self) -> str:
        return (f"TokenBatch(seq_ids={self.seq_ids.tolist()}, counts={self.counts.tolist()}, "
                f"tokens={self.tokens.size})")


class KVCacheInputs:
    """Base class of the KV cache inputs of one device for one step. Like seed 002's, it
    unpacks into its seed fields (``blocks, cache_lengths, lookup_table, max_lengths =
    inputs``; ``len(inputs)``, ``inputs[i]``)."""

    #: The fields it unpacks into, in order (a subclass's seed fields).
    _seed_fields: tuple = ()

    def __iter__(self):
        return iter([getattr(self, name) for name in self._seed_fields])

    def __len__(self) -> int:
        return len(self._seed_fields)

    def __getitem__(self, i):
        return getattr(self, self._seed_fields[i])


class KVCacheInputSymbols:
    """Base class of the symbolic (TVM Relax struct info) description of KV cache inputs."""


@dataclass
class RaggedKVCacheInputSymbols(KVCacheInputSymbols):
    """Relax struct info of each tensor of :class:`RaggedKVCacheInputs` (seed 002; its
    ``ContinuousBatchingKVCacheInputSymbols``, whose ``kv_blocks`` is ``blocks`` here).
    Iterates over the four, in that order."""

    blocks: Any
    cache_lengths: Any
    lookup_table: Any
    max_lengths: Any

    @property
    def kv_blocks(self):
        """:attr:`blocks` (seed 002's name)."""
        return self.blocks

    def __iter__(self):
        return iter((self.blocks, self.cache_lengths, self.lookup_table, self.max_lengths))

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i):
        return (self.blocks, self.cache_lengths, self.lookup_table, self.max_lengths)[i]


class ContinuousBatchingKVCacheInputSymbols(RaggedKVCacheInputSymbols):
    """Seed 002's symbols of a continuous (or any ragged) cache's inputs: the same four, the
    first named ``kv_blocks`` as there (``blocks`` also works)."""

    def __init__(self, kv_blocks=None, cache_lengths=None, lookup_table=None,
                 max_lengths=None, *, blocks=None):
        if (kv_blocks is None) == (blocks is None):
            raise InvalidArgumentError(describe("kv_blocks", "given once (kv_blocks or blocks)",
                                                "both" if blocks is not None else "neither"))
        super().__init__(kv_blocks if blocks is None else blocks, cache_lengths, lookup_table,
                         max_lengths)


@dataclass
class RaggedKVCacheInputs(KVCacheInputs):
    """KV cache inputs for a ragged batch, on one device.

    Parameters
    ----------
    blocks : torch.Tensor
        The device's whole cache tensor (shape per strategy, see :mod:`kvtvm.params`).
    cache_lengths : torch.Tensor
        int32 ``[batch]``: tokens already in the cache of each item before this step's tokens.
    lookup_table : torch.Tensor
        int32 ``[batch, W]``: PAGED: ``W = ceil(max_seq_len / page_size)`` page ids (entries past
        a sequence's pages are 0); CONTINUOUS: ``W = 1``, the sequence's block; LINEAR:
        ``W = 1``, the batch slot.
    max_lengths : torch.Tensor
        int32 ``[num_steps, 2]`` on the host: per remaining step, (max new tokens of an item,
        max cache length of an item after the step's tokens).
    qo_indptr : torch.Tensor
        int32 ``[batch + 1]`` on the device: offsets of each item's new tokens in the ragged
        token dimension (``input_row_offsets``).
    seq_ids : tuple of int
        The batch's sequence ids, in batch order.
    num_cached_tokens : tuple of int
        Per item, how many leading ``tokens`` were already in the cache (prefix-cache hits) and
        must not be run through the model; the model computes ``tokens[num_cached_tokens[b]:]``.
    cache_lengths_host, qo_indptr_host : numpy.ndarray
        Host copies of ``cache_lengths`` and ``qo_indptr`` (reading them never syncs).
    params : KVCacheParams
        The cache parameters (``n_kv_heads`` is the per-device count here).
    num_layers, max_seq_len : int
        As given to the manager.
    device_index : int
        Index of this device in the manager's ``devices``.
    extra : dict
        The caller's own per-step data; kvtvm neither sets nor reads it.
    token : FetchToken, optional
        The fetch these inputs come from: ops and plans refuse them
        (:class:`~kvtvm.errors.StaleInputsError`) once it is superseded.
    """

    blocks: Any
    cache_lengths: Any
    lookup_table: Any
    max_lengths: Any
    qo_indptr: Any = None
    seq_ids: tuple = ()
    num_cached_tokens: tuple = ()
    cache_lengths_host: np.ndarray | None = None
    qo_indptr_host: np.ndarray | None = None
    params: KVCacheParams | None = None
    num_layers: int = 0
    max_seq_len: int = 0
    device_index: int = 0
    extra: dict = field(default_factory=dict, repr=False)
    token: FetchToken | None = field(default=None, repr=False)

    _seed_fields = ("blocks", "cache_lengths", "lookup_table", "max_lengths")

    def check_live(self) -> None:
        """Raise :class:`~kvtvm.errors.StaleInputsError` when these inputs were superseded
        (a later fetch, their step, or a release of one of their sequences)."""
        check_live("kv_cache_inputs", self.token)

    def __repr__(self) -> str:
        """The step in numbers (never the cache's contents)."""
        def shape(t):
            return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"
        lengths = self.cache_lengths_host
        indptr = self.qo_indptr_host
        new = None if indptr is None else np.diff(indptr).tolist()
        state = "" if self.token is None else (", live" if self.token.live else ", stale")
        strategy = "" if self.params is None else f"{self.params.cache_strategy.value}, "
        return (f"RaggedKVCacheInputs({strategy}seq_ids={list(self.seq_ids)}, "
                f"cache_lengths={None if lengths is None else lengths.tolist()}, "
                f"new_tokens={new}, num_cached_tokens={list(self.num_cached_tokens)}, "
                f"lookup_table={shape(self.lookup_table)}, blocks={shape(self.blocks)} on "
                f"{getattr(self.blocks, 'device', 'host')}, device_index={self.device_index}"
                f"{state})")

    @property
    def batch_size(self) -> int:
        return int(self.cache_lengths.shape[0])

    def collection(self):
        """The per-layer view of these inputs (:mod:`kvtvm.collection`)."""
        from .collection import make_collection

        return make_collection(self)

    def k_cache(self, layer: int):
        """Zero-copy K view of ``layer`` in the layout :func:`kvtvm.ops.append_kv` takes:
        ``[num_pages, page_size, n_kv_heads, head_dim]`` (``nhd``) or ``[max_batch_size,
        n_kv_heads, max_seq_len, head_dim]`` (``hnd``, LINEAR); see :mod:`kvtvm.collection`."""
        return self.collection().get_key_cache(layer).blocks

    def v_cache(self, layer: int):
        """Zero-copy V view of ``layer``, shaped as :meth:`k_cache`."""
        return self.collection().get_value_cache(layer).blocks

    @property
    def strategy(self) -> KVCacheStrategy:
        return self.params.cache_strategy

    @property
    def layout(self) -> str:
        """Token layout of the per-layer views: ``"hnd"`` for LINEAR, else ``"nhd"``."""
        return "hnd" if self.params.cache_strategy is KVCacheStrategy.LINEAR else "nhd"


@dataclass
class PaddedKVCacheInputs(KVCacheInputs):
    """KV cache inputs for padded (non-ragged) tensors (seed 002); kept for API parity.

    Parameters
    ----------
    k_cache, v_cache : torch.Tensor
        Key and value caches.
    start_pos : torch.Tensor
        Position of the first new token.
    null_op : torch.Tensor
        Placeholder kept from the seed API.
    """

    k_cache: Any
    v_cache: Any
    start_pos: Any
    null_op: Any

    _seed_fields = ("k_cache", "v_cache", "start_pos", "null_op")


@dataclass
class KVCacheInputsSequence(KVCacheInputs):
    """A sequence of :class:`KVCacheInputs` (e.g. one per device or per step of a multistep run)."""

    kv_cache_inputs: Sequence[KVCacheInputs]

    def __len__(self):
        return len(self.kv_cache_inputs)

    def __getitem__(self, i):
        return self.kv_cache_inputs[i]

    def __iter__(self):
        return iter(self.kv_cache_inputs)
