"""Argument checks every manager shares: positive ints, the device list, a batch's tokens, the
row offsets of a previous step."""

from __future__ import annotations

import os
from itertools import chain

import numpy as np

from ..errors import (DeviceUnavailableError, InvalidArgumentError, KVCacheCapacityError,
                      SequenceTooLongError, describe)
from ..inputs import as_int64

__all__ = ["check_positive_int", "check_size", "check_sizes", "check_size_kwargs",
           "parse_devices", "ItemTokens",
           "row_offsets", "check_step_tokens", "check_int", "check_hashes", "check_seconds",
           "allocate"]

#: Sizes (tokens, sequences, pages, layers) index int32 tables and kernels: at most this.
INT32_MAX = (1 << 31) - 1


def check_positive_int(name: str, value, allow_zero: bool = False) -> int:
    """``value`` as an int, or :class:`InvalidArgumentError` naming ``name``."""
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if not ok or value < (0 if allow_zero else 1):
        raise InvalidArgumentError(describe(
            name, "a non-negative int" if allow_zero else "a positive int", repr(value)))
    return int(value)


def check_num_steps(value, max_seq_len: int) -> int:
    """``fetch``'s ``num_steps`` as an int: positive (else :class:`InvalidArgumentError`), and
    at most ``max_seq_len + 1``, since each step after the first reserves a token (else
    :class:`SequenceTooLongError`, before any arithmetic a huge value could wrap)."""
    steps = check_positive_int("num_steps", value)
    if steps - 1 > max_seq_len:
        raise SequenceTooLongError(describe(
            "num_steps", f"at most max_seq_len + 1 = {max_seq_len + 1} (each step after the "
            "first reserves a token)", steps))
    return steps


def check_size(name: str, value) -> int:
    """``value`` as a positive int that the int32 tables can index (at most ``2**31 - 1``),
    or :class:`InvalidArgumentError` naming ``name``."""
    value = check_positive_int(name, value)
    if value > INT32_MAX:
        raise InvalidArgumentError(describe(name, f"at most {INT32_MAX} (int32 tables)", value))
    return value


def check_sizes(params, strategy, **sizes) -> tuple:
    """The arguments a manager's sizes come from (its constructor, ``estimated_memory_size``,
    ``infer_optimal_batch_size``): ``params`` a KVCacheParams of ``strategy``, each size (by
    keyword, e.g. ``max_seq_len``) a :func:`check_size` int; ``num_layers`` is also checked
    against ``params.skip_layers``. Returns the sizes in the order given."""
    from ..params import KVCacheParams

    if not isinstance(params, KVCacheParams):
        raise InvalidArgumentError(describe("params", "a KVCacheParams", type(params).__name__))
    if params.cache_strategy is not strategy:
        raise InvalidArgumentError(describe("params.cache_strategy", strategy.name,
                                            params.cache_strategy.name))
    out = tuple(check_size(name, value) for name, value in sizes.items())
    if "num_layers" in sizes:
        params.resolve_skip_layers(sizes["num_layers"])
    return out


def check_size_kwargs(where: str, kwargs: dict, ignored: tuple = (),
                      available_cache_memory=None) -> None:
    """Refuse (InvalidArgumentError naming it) a keyword of a sizing classmethod's
    ``**kwargs`` (the seed's signature) other than ``ignored`` -- constructor keywords that
    change no size, taken so an engine can pass its constructor's keywords: a typo such as
    ``num_page`` silently sized the default pool. ``available_cache_memory``, where the
    method does not use it, must still be a positive int or None."""
    for name in kwargs:
        if name not in ignored:
            takes = f" (besides its parameters it takes {', '.join(ignored)})" if ignored \
                else ""
            raise InvalidArgumentError(f"{where}: unexpected keyword {name!r}{takes}")
    if available_cache_memory is not None:
        check_positive_int("available_cache_memory", available_cache_memory)


#: Upper bound on the host bytes a manager keeps per ``max_batch_size`` slot (its per-slot
#: numpy arrays), for :func:`check_batch_slots`.
SLOT_BYTES = 64


def host_memory_bytes() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_bytes(what: str, nbytes: int) -> None:
    """:class:`KVCacheCapacityError` naming ``what`` when ``nbytes`` exceed the machine's
    physical memory: asked anyway, the allocation can succeed (overcommit) and the process is
    killed when the memory is touched."""
    total = host_memory_bytes()
    if total is not None and nbytes > total:
        raise KVCacheCapacityError(f"{what}: {nbytes} bytes of host memory asked, more than "
                                   f"this machine's {total}")


def check_batch_slots(value) -> int:
    """``max_batch_size``: :func:`check_size`, and its per-slot bookkeeping must fit in host
    memory (:func:`check_host_bytes`)."""
    mb = check_size("max_batch_size", value)
    check_host_bytes(f"max_batch_size={mb} (about {SLOT_BYTES} bytes of bookkeeping a slot)",
                     mb * SLOT_BYTES)
    return mb


def allocate(what: str, shape, dtype, device, pin_memory: bool = False, zero: bool = True):
    """``torch.zeros(shape)`` (``torch.empty`` unless ``zero``); a failed allocation (no
    memory for that size), or host memory past the machine's (:func:`check_host_bytes`), is
    a :class:`KVCacheCapacityError` naming ``what``, the shape and the bytes asked."""
    import torch

    make = torch.zeros if zero else torch.empty
    n = torch.empty((), dtype=dtype).element_size()
    for d in shape:
        n *= d
    if torch.device(device).type == "cpu":
        check_host_bytes(f"{what} {tuple(shape)} {dtype}", n)
    try:
        return make(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    except (RuntimeError, MemoryError) as err:
        raise KVCacheCapacityError(f"{what}: cannot allocate {tuple(shape)} {dtype} ({n} bytes) "
                                   f"on {device}: {str(err).splitlines()[0][:160]}") from None


def check_int(name: str, value) -> int:
    """``value`` as an int (not a bool), or :class:`InvalidArgumentError` naming ``name``."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentError(describe(name, "an int", repr(value)))
    return int(value)


def check_hashes(name: str, values) -> list:
    """A sequence of block hashes (ints, not bools) as a list of ints."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu" and values.ndim == 1:
        return [int(v) for v in values]
    if not isinstance(values, (list, tuple)):
        raise InvalidArgumentError(describe(name, "a list of int hashes",
                                            type(values).__name__))
    return [check_int(f"{name}[{i}]", v) for i, v in enumerate(values)]


def check_seconds(name: str, value, allow_none: bool = True, allow_inf: bool = False):
    """A non-negative number of seconds, finite unless ``allow_inf`` (or None when
    ``allow_none``); NaN and bools are refused."""
    if value is None and allow_none:
        return None
    ok = isinstance(value, (int, float, np.integer, np.floating)) and \
        not isinstance(value, (bool, np.bool_))
    if not ok or np.isnan(value) or value < 0 or (np.isinf(value) and not allow_inf):
        raise InvalidArgumentError(describe(
            name, "seconds >= 0" + ("" if allow_inf else ", finite"), repr(value)))
    return float(value)


def parse_devices(devices, params=None, name: str = "devices") -> tuple:
    """``devices`` (strings like ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or torch devices) as a
    tuple of ``torch.device``; errors name the argument ``name``. With ``params``
    (:class:`~kvtvm.params.KVCacheParams`) and a CUDA device among them, also checks that the
    CUDA kernels take its head_dim (:meth:`~kvtvm.params.KVCacheParams.check_cuda`), before
    asking whether CUDA is there."""
    import torch

    given = devices
    if isinstance(devices, (str, torch.device)):
        devices = (devices,)
    try:
        parsed = tuple(torch.device(d) for d in devices)
    except (TypeError, RuntimeError) as err:
        raise InvalidArgumentError(describe(name, "device names like 'cpu' or 'cuda:0'",
                                            repr(given))) from err
    if not parsed:
        raise InvalidArgumentError(describe(name, "at least one device", repr(devices)))
    for d in parsed:
        if d.type not in ("cpu", "cuda"):
            raise InvalidArgumentError(describe(name, "cpu or cuda devices", str(d)))
    if params is not None and any(d.type == "cuda" for d in parsed):
        params.check_cuda()
    for d in parsed:
        if d.type == "cuda" and not torch.cuda.is_available():
            raise DeviceUnavailableError(
                f"{name}: {d} was asked for but CUDA is not available on this machine")
    return parsed


class ItemTokens:
    """The tokens of a list of batch items, converted to int64 arrays only when read."""

    __slots__ = ("seqs", "counts", "what", "_flat")

    def __init__(self, seqs: list, counts: np.ndarray, what: str):
        if set(map(type, seqs)) & {set, frozenset, dict}:  # no order: not a sequence
            raise InvalidArgumentError(describe(f"{what}: tokens", "sequences of ints",
                                                "a set or dict (no order)"))
        self.seqs, self.counts, self.what, self._flat = seqs, counts, what, None

    def _ints(self, values, count: int) -> np.ndarray:
        try:
            arr = np.array(values if isinstance(values, list) else list(values))
        except (TypeError, ValueError) as err:
            raise InvalidArgumentError(describe(f"{self.what}: tokens", "ints",
                                                repr(err))) from None
        if arr.ndim != 1 or arr.size != count or (arr.size and arr.dtype.kind not in "iu"):
            raise InvalidArgumentError(describe(f"{self.what}: tokens", "flat sequences of ints",
                                                f"{arr.dtype} array of shape {arr.shape}"))
        return as_int64(f"{self.what}: tokens", arr)

    @property
    def tokens(self) -> np.ndarray:
        """int64 ``[sum(counts)]``: every item's tokens, item after item."""
        if self._flat is None:
            self._flat = self._ints(list(chain.from_iterable(self.seqs)),
                                    int(self.counts.sum()))
        return self._flat

    def tokens_of(self, b: int) -> np.ndarray:
        """int64 ``[counts[b]]``: the tokens of item ``b``."""
        return self._ints(self.seqs[b], int(self.counts[b]))


def row_offsets(prev_model_inputs, inp):
    """(tensor, host numpy or None) row offsets of the previous step of ``inp``: int32 or
    int64 ``[batch + 1]``, each item's count within what ``inp`` carried
    (:func:`check_step_tokens`) when known on the host."""
    import torch

    if prev_model_inputs is None:
        return inp.qo_indptr, inp.qo_indptr_host
    obj = prev_model_inputs
    for name in ("qo_indptr", "input_row_offsets"):
        if hasattr(obj, name):
            host = getattr(obj, "qo_indptr_host", None) if name == "qo_indptr" else None
            obj = getattr(obj, name)
            break
    else:
        host = None
    if isinstance(obj, np.ndarray):
        obj = torch.from_numpy(obj)
    if not isinstance(obj, torch.Tensor):
        raise InvalidArgumentError(describe(
            "prev_model_inputs", "a tensor of row offsets or an object with qo_indptr / "
            "input_row_offsets", type(prev_model_inputs).__name__))
    if obj.dtype == getattr(torch, "uint32", None):  # MAX's input_row_offsets are uint32
        obj = obj.to(torch.int64)
    if obj.dtype not in (torch.int32, torch.int64):
        raise InvalidArgumentError(describe("prev_model_inputs row offsets dtype",
                                            "int32, int64 or uint32", obj.dtype))
    b = inp.cache_lengths.shape[0]
    if tuple(obj.shape) != (b + 1,):
        raise InvalidArgumentError(describe("prev_model_inputs row offsets",
                                            f"shape ({b + 1},)", tuple(obj.shape)))
    if host is None and obj.device.type == "cpu":
        host = obj.numpy()
    check_step_tokens(host, inp.qo_indptr_host)
    return obj, host


def check_step_tokens(qo_prev_host, qo_fetched_host) -> None:
    """The previous step's row offsets (when known on the host) give each item between 0 and
    the tokens its inputs carried: more would make cache lengths past the pages the fetch
    reserved, where the lookup table's padding (page 0) is another sequence's page."""
    if qo_prev_host is None or qo_fetched_host is None:
        return  # a device tensor only: not read (no host sync)
    new, fetched = np.diff(np.asarray(qo_prev_host)), np.diff(np.asarray(qo_fetched_host))
    bad = np.flatnonzero((new < 0) | (new > fetched))
    if bad.size:
        b = int(bad[0])
        raise InvalidArgumentError(describe(
            "prev_model_inputs row offsets", "per item between 0 and the tokens of its inputs "
            f"({fetched.tolist()})", f"{int(new[b])} tokens for item {b}"))


def pop_length(sid: int, n, length: int) -> int:
    """The length of sequence ``sid`` (``length`` tokens) after a valid ``pop(sid, n)``."""
    n = check_positive_int("n", n, allow_zero=True)
    if n > length:
        raise InvalidArgumentError(describe(f"pop: n for seq_id {sid}",
                                            f"at most its cache length {length}", n))
    return length - n
