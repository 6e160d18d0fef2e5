"""Cache parameters, strategies, dtype helpers and exact memory arithmetic.

Nothing here touches TVM or allocates memory: the managers allocate exactly what these
functions say, and ``estimated_memory_size`` is built on them.

Cache tensor of each strategy (one tensor per device; KV heads are split evenly across devices):

=============  ==========================================================================
CONTINUOUS     ``[num_blocks, 2, num_layers, max_seq_len, n_kv_heads, head_dim]``
PAGED          ``[num_pages, 2, num_layers, page_size, n_kv_heads, head_dim]``
LINEAR         ``[num_layers, max_batch_size, 2, n_kv_heads, max_seq_len, head_dim]``
=============  ==========================================================================

A **quantized or mixed cache** (``cache_dtype`` / ``k_cache_dtype`` / ``v_cache_dtype`` int8 or
float8_e4m3fn for some layer) is one byte tensor whose axis 0 (axis 1 for LINEAR) is still the
unit a copy moves, so page copies stay byte copies:

=============  ==========================================================================
CONTINUOUS     uint8 ``[num_blocks, max_seq_len * bytes_per_token]``
PAGED          uint8 ``[num_pages, page_size * bytes_per_token]``
LINEAR         uint8 ``[1, max_batch_size, max_seq_len * bytes_per_token]``
=============  ==========================================================================

Inside a unit of ``T`` tokens, segment ``(kv, layer)`` (K of every layer, then V of every layer,
as in the full-precision tensors) holds ``[T, H, row]`` (``[H, T, row]`` for LINEAR) rows of
:meth:`KVCacheParams.row_bytes` bytes: a quantized row is :func:`kvtvm.quant.quant_row_bytes`
(values, float32 scale, padding to 16 bytes); a full-precision row (a skipped layer, or the
other tensor of a K-only/V-only cache) is ``head_dim * itemsize`` rounded up to 16 bytes.
:func:`kvtvm.storage.layer_view` cuts the per-layer views out of it.
"""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidArgumentError, describe
from .quant import QUANT_DTYPES, ROW_ALIGN, quant_row_bytes, round_up

#: dtype name -> bytes per element, for the dtypes kvtvm's kernels support.
DTYPE_SIZES = {"float16": 2, "bfloat16": 2, "float32": 4}

_DTYPE_ALIASES = {
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float32": "float32", "fp32": "float32", "float": "float32",
}


class KVCacheStrategy(str, enum.Enum):
    """How a manager lays out its cache; see the module docstring for the tensor shapes."""

    CONTINUOUS = "continuous"
    PAGED = "paged"
    LINEAR = "linear"

    @classmethod
    def parse(cls, value: "KVCacheStrategy | str") -> "KVCacheStrategy":
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise InvalidArgumentError(
                describe("cache_strategy", [s.value for s in cls], repr(value))) from None


def dtype_name(dtype: Any) -> str:
    """Canonical kvtvm dtype name (``"float16"``, ``"bfloat16"``, ``"float32"``).

    Accepts a string, a ``torch.dtype`` or a ``numpy.dtype``.
    """
    text = str(dtype)
    for prefix in ("torch.", "dtype("):
        if text.startswith(prefix):
            text = text[len(prefix):]
    text = text.strip("')\"")
    try:
        return _DTYPE_ALIASES[text]
    except KeyError:
        raise InvalidArgumentError(
            describe("dtype", sorted(DTYPE_SIZES), repr(dtype))) from None


_CACHE_DTYPE_ALIASES = {"int8": "int8", "float8_e4m3fn": "float8_e4m3fn",
                        "float8_e4m3": "float8_e4m3fn", "fp8": "float8_e4m3fn",
                        "e4m3": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}


def cache_dtype_name(name: str, value: Any, dtype: str) -> str:
    """Canonical storage type of argument ``name``: ``dtype`` itself, ``"int8"`` or
    ``"float8_e4m3fn"`` (``None`` means ``dtype``)."""
    if value is None:
        return dtype
    text = str(value)
    for prefix in ("torch.", "dtype("):
        if text.startswith(prefix):
            text = text[len(prefix):]
    text = text.strip("')\"")
    if text in _CACHE_DTYPE_ALIASES:
        return _CACHE_DTYPE_ALIASES[text]
    if _DTYPE_ALIASES.get(text) == dtype:
        return dtype
    raise InvalidArgumentError(describe(name, [dtype, *QUANT_DTYPES], repr(value)))


def dtype_size(dtype: Any) -> int:
    """Bytes per element of ``dtype``."""
    return DTYPE_SIZES[dtype_name(dtype)]


def torch_dtype(dtype: Any):
    """The ``torch.dtype`` of a kvtvm dtype name."""
    import torch

    return getattr(torch, dtype_name(dtype))


def numpy_dtype(dtype: Any):
    """The numpy dtype of a kvtvm dtype name (``ml_dtypes.bfloat16`` for bfloat16)."""
    import numpy as np

    name = dtype_name(dtype)
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _count(name: str, value, allow_zero: bool = False) -> int:
    """``value`` as a positive (or non-negative) int, else InvalidArgumentError naming it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) \
            or value < (0 if allow_zero else 1):
        raise InvalidArgumentError(describe(
            name, f"a {'non-negative' if allow_zero else 'positive'} int", repr(value)))
    return int(value)


def hf_geometry_refusal(config) -> str | None:
    """Why a transformers decoder ``config`` (a text config) has no plain K/V heads of one
    ``head_dim`` for a cache to hold, or None: multi-head latent attention caches a latent
    (``kv_lora_rank``), and K and V of different head dims do not fit one ``head_dim``."""
    if getattr(config, "kv_lora_rank", None) or getattr(config, "q_lora_rank", None):
        return "multi-head latent attention (kv_lora_rank): kvtvm caches plain K/V heads"
    v_dim = getattr(config, "v_head_dim", None)
    qk_dim = getattr(config, "qk_head_dim", None) or getattr(config, "head_dim", None)
    if v_dim is not None and qk_dim is not None and v_dim != qk_dim:
        return (f"K and V head dims differ (head_dim {qk_dim}, v_head_dim {v_dim}): kvtvm's "
                "kernels take one head_dim")
    return None


@dataclass(frozen=True, repr=False)
class KVCacheParams:
    """Static description of a KV cache; frozen and hashable.

    Parameters
    ----------
    dtype : str or torch.dtype
        Element type of K and V: float16, bfloat16 or float32.
    n_kv_heads : int
        Key/value heads of the model (before any split across devices).
    head_dim : int
        Elements per head.
    cache_strategy : KVCacheStrategy or str
        CONTINUOUS, PAGED or LINEAR.
    page_size : int, optional
        Tokens per page; required for PAGED, must be None otherwise.
    enable_prefix_caching : bool
        Share full pages between sequences with the same token prefix (PAGED only).
    cache_dtype : str, optional
        Storage type of the cache: ``dtype`` (default), ``"int8"`` or ``"float8_e4m3fn"``
        (8-bit values with a float32 scale per (token, head) row, stored in the page;
        :mod:`kvtvm.quant`). ``dtype`` stays the type of the K/V/Q/output tensors the ops take.
    k_cache_dtype, v_cache_dtype : str, optional
        Storage type of K (of V) alone; default ``cache_dtype``. E.g. ``k_cache_dtype="int8"``
        with ``v_cache_dtype="float8_e4m3fn"``, or a K-only cache (``v_cache_dtype=dtype``).
    skip_layers : sequence of int
        Layers kept at full precision (``dtype``) whatever the storage types; negative
        indices count from the last layer (``(0, -1)``: the first and the last); numpy
        integers are taken, ``None`` means none.

    Raises
    ------
    InvalidArgumentError
        An unknown dtype, storage type or strategy; heads or ``head_dim`` not a positive int;
        ``page_size`` missing for PAGED or given for another strategy; prefix caching
        without PAGED; ``skip_layers`` not distinct ints, or given with no 8-bit storage.
    """

    dtype: str
    n_kv_heads: int
    head_dim: int
    cache_strategy: KVCacheStrategy = KVCacheStrategy.PAGED
    page_size: int | None = None
    enable_prefix_caching: bool = False
    cache_dtype: str | None = None
    k_cache_dtype: str | None = None
    v_cache_dtype: str | None = None
    skip_layers: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        cache = cache_dtype_name("cache_dtype", self.cache_dtype, self.dtype)
        object.__setattr__(self, "cache_dtype", cache)
        for name in ("k_cache_dtype", "v_cache_dtype"):
            value = getattr(self, name)
            object.__setattr__(self, name, cache if value is None
                               else cache_dtype_name(name, value, self.dtype))
        skip = () if self.skip_layers is None else self.skip_layers
        try:
            items = None if isinstance(skip, (numbers.Number, str, bytes)) else tuple(skip)
        except TypeError:  # not iterable (a float, an object)
            items = None
        if items is None or not all(isinstance(i, numbers.Integral)
                                    and not isinstance(i, (bool, np.bool_)) for i in items):
            raise InvalidArgumentError(describe("skip_layers", "a sequence of int layer indices",
                                                repr(skip)))
        items = tuple(int(i) for i in items)
        if len(set(items)) != len(items):
            raise InvalidArgumentError(describe("skip_layers", "distinct indices", repr(skip)))
        if items and self.k_cache_dtype == self.v_cache_dtype == self.dtype:
            raise InvalidArgumentError(describe(  # as the command line refuses it
                "skip_layers", f"() when K and V are stored in dtype {self.dtype} (layers to "
                "keep at full precision need an 8-bit cache_dtype)", repr(skip)))
        object.__setattr__(self, "skip_layers", tuple(sorted(items)))
        object.__setattr__(self, "cache_strategy", KVCacheStrategy.parse(self.cache_strategy))
        for name in ("n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 1 << 31:
                raise InvalidArgumentError(describe(name, "a positive int (below 2**31)",
                                                    repr(value)))
        if self.cache_strategy is KVCacheStrategy.PAGED:
            if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) \
                    or not 0 < self.page_size < 1 << 31:
                raise InvalidArgumentError(
                    describe("page_size", "a positive int for the PAGED strategy",
                             repr(self.page_size)))
        elif self.page_size is not None:
            raise InvalidArgumentError(
                describe("page_size", f"None for the {self.cache_strategy.name} strategy",
                         repr(self.page_size)))
        if not isinstance(self.enable_prefix_caching, (bool, np.bool_)):
            raise InvalidArgumentError(describe("enable_prefix_caching", "a bool",
                                                repr(self.enable_prefix_caching)))
        object.__setattr__(self, "enable_prefix_caching", bool(self.enable_prefix_caching))
        if self.enable_prefix_caching and self.cache_strategy is not KVCacheStrategy.PAGED:
            raise InvalidArgumentError(
                describe("enable_prefix_caching", "False unless the strategy is PAGED", True))

    @classmethod
    def from_hf_config(cls, config, dtype=None, cache_strategy="paged", page_size=None,
                       enable_prefix_caching: bool = False, cache_dtype=None,
                       k_cache_dtype=None, v_cache_dtype=None,
                       skip_layers=()) -> "KVCacheParams":
        """Parameters of a transformers model's KV cache.

        Parameters
        ----------
        config : transformers.PretrainedConfig
            A decoder config (a multimodal one's text config is used): ``num_key_value_heads``
            (default ``num_attention_heads``; Falcon's ``num_kv_heads``, 1 for its
            ``multi_query``), ``head_dim`` (default ``hidden_size // num_attention_heads``),
            ``dtype`` (when ``dtype`` is None; the text config's, else the outer config's).
            Multi-head latent attention (``kv_lora_rank``) and K and V head dims that differ
            (``v_head_dim``) are refused: no plain K/V heads of one ``head_dim`` to cache.
        dtype, cache_strategy, page_size, enable_prefix_caching
            As for the constructor.
        cache_dtype, k_cache_dtype, v_cache_dtype, skip_layers
            The storage types (8-bit KV), as for the constructor.

        Returns
        -------
        KVCacheParams

        Raises
        ------
        InvalidArgumentError
            The config lacks or has inconsistent head counts / sizes, caches no plain K/V
            heads (MLA, K and V head dims that differ), names no dtype when ``dtype`` is None,
            or as for the constructor.
        """
        outer = config
        config = getattr(config, "get_text_config", lambda: config)()
        heads = getattr(config, "num_attention_heads", None)
        if heads is None:
            raise InvalidArgumentError(describe("config", "a decoder config with "
                                                "num_attention_heads", type(config).__name__))

        def field(name, value, what):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise InvalidArgumentError(describe(f"config.{name}", what, repr(value)))
            return int(value)

        heads = field("num_attention_heads", heads, "a positive int")
        why = hf_geometry_refusal(config)
        if why:
            raise InvalidArgumentError(describe("config", "a decoder whose layers cache K and V "
                                                "heads of one head_dim", why))
        kv_heads = getattr(config, "num_key_value_heads", None)
        if kv_heads is None and getattr(config, "new_decoder_architecture", None) is not None:
            # Falcon's fields: grouped K/V heads, one shared head (multi_query), or one per head
            kv_heads = (getattr(config, "num_kv_heads", None) if config.new_decoder_architecture
                        else 1 if getattr(config, "multi_query", False)
                        else getattr(config, "num_kv_heads", None))
        kv_heads = heads if kv_heads is None else field(
            "num_key_value_heads", kv_heads, f"a positive int dividing num_attention_heads="
            f"{heads}")
        if heads % kv_heads:
            raise InvalidArgumentError(describe(
                "config.num_key_value_heads",
                f"a positive int dividing num_attention_heads={heads}", kv_heads))
        head_dim = getattr(config, "head_dim", None)
        if head_dim is None:
            hidden = field("hidden_size", getattr(config, "hidden_size", None),
                           f"a multiple of num_attention_heads={heads} (the config names no "
                           "head_dim)")
            if hidden % heads:
                raise InvalidArgumentError(describe(
                    "config.hidden_size", f"a multiple of num_attention_heads={heads} (the "
                    "config names no head_dim)", hidden))
            head_dim = hidden // heads
        head_dim = field("head_dim", head_dim, "a positive int")
        for c in (config, outer):  # a multimodal config names it at the top (saved files)
            if dtype is None:
                dtype = getattr(c, "dtype", None) or getattr(c, "torch_dtype", None)
        if dtype is None:
            raise InvalidArgumentError(describe("dtype", "given (the config names none)", None))
        return cls(dtype, int(kv_heads), int(head_dim), cache_strategy, page_size=page_size,
                   enable_prefix_caching=enable_prefix_caching, cache_dtype=cache_dtype,
                   k_cache_dtype=k_cache_dtype, v_cache_dtype=v_cache_dtype,
                   skip_layers=skip_layers)

    def __repr__(self) -> str:
        """The constructor call that makes these params, defaults left out."""
        parts = [repr(self.dtype), f"n_kv_heads={self.n_kv_heads}", f"head_dim={self.head_dim}",
                 f"cache_strategy={self.cache_strategy.value!r}"]
        if self.page_size is not None:
            parts.append(f"page_size={self.page_size}")
        if self.enable_prefix_caching:
            parts.append("enable_prefix_caching=True")
        if self.cache_dtype != self.dtype:
            parts.append(f"cache_dtype={self.cache_dtype!r}")
        for name in ("k_cache_dtype", "v_cache_dtype"):
            if getattr(self, name) != self.cache_dtype:
                parts.append(f"{name}={getattr(self, name)!r}")
        if self.skip_layers:
            parts.append(f"skip_layers={self.skip_layers}")
        return f"KVCacheParams({', '.join(parts)})"

    def summary(self) -> str:
        """One short line: element type, heads x head_dim, storage when not ``dtype``
        (e.g. ``"float16, 8 kv heads x 128, K int8 V float8_e4m3fn"``)."""
        text = f"{self.dtype}, {self.n_kv_heads} kv heads x {self.head_dim}"
        if self.k_cache_dtype == self.v_cache_dtype != self.dtype:
            text += f", {self.k_cache_dtype} K/V"
        elif self.k_cache_dtype != self.v_cache_dtype:
            text += f", K {self.k_cache_dtype} V {self.v_cache_dtype}"
        if self.skip_layers and self.quantized:
            text += f" (layers {list(self.skip_layers)} {self.dtype})"
        return text

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype`` (the ops' K/V/Q tensors)."""
        return DTYPE_SIZES[self.dtype]

    @property
    def quantized(self) -> bool:
        """True if K or V is stored in an 8-bit type in some layer (the cache is then the
        byte tensor of the module docstring)."""
        return self.k_cache_dtype != self.dtype or self.v_cache_dtype != self.dtype

    @property
    def tensor_dtype(self) -> str:
        """dtype of the cache tensor a manager allocates: ``dtype``, or ``"uint8"``."""
        return "uint8" if self.quantized else self.dtype

    def resolve_skip_layers(self, num_layers: int) -> tuple[int, ...]:
        """``skip_layers`` as sorted indices in ``[0, num_layers)``."""
        out = set()
        for i in self.skip_layers:
            if not -num_layers <= i < num_layers:
                raise InvalidArgumentError(describe(
                    "skip_layers", f"indices in [-{num_layers}, {num_layers}) for num_layers="
                    f"{num_layers}", repr(self.skip_layers)))
            out.add(i % num_layers)
        if len(out) != len(self.skip_layers):
            raise InvalidArgumentError(describe(
                "skip_layers", f"distinct layers of {num_layers}", repr(self.skip_layers)))
        return tuple(sorted(out))

    def check_cuda(self) -> None:
        """Raise :class:`~kvtvm.errors.InvalidArgumentError` naming head_dim when the CUDA
        kernels cannot run a cache with these parameters (:mod:`kvtvm.cuda_limits`; the CPU
        kernels take any head_dim). Managers call it when one of their devices is CUDA."""
        from .cuda_limits import check_params_on_cuda

        check_params_on_cuda(self)

    def storage(self, layer: int, kv: int, num_layers: int) -> str:
        """Storage type of layer ``layer``'s K (``kv=0``) or V (``kv=1``)."""
        if layer in self.resolve_skip_layers(num_layers):
            return self.dtype
        return self.v_cache_dtype if kv else self.k_cache_dtype

    def row_bytes(self, storage: str) -> int:
        """Bytes one (token, head) row of ``storage`` takes in the cache: ``head_dim *
        itemsize`` in a full-precision cache; in a quantized one, rows are padded to 16 bytes
        (:func:`kvtvm.quant.quant_row_bytes` for an 8-bit row)."""
        if storage in QUANT_DTYPES:
            return quant_row_bytes(self.head_dim)
        size = self.head_dim * DTYPE_SIZES[storage]
        return round_up(size, ROW_ALIGN) if self.quantized else size

    def segments(self, num_layers: int, tokens: int, n_devices: int = 1):
        """Where each layer's K and V live inside one unit (page, block or slot) of
        ``tokens`` tokens, on one device: ``[(kv, layer, byte offset, storage, row bytes)]``,
        K of every layer first, then V."""
        heads = self.heads_per_device(n_devices)
        out, offset = [], 0
        for kv in (0, 1):
            for layer in range(num_layers):
                storage = self.storage(layer, kv, num_layers)
                row = self.row_bytes(storage)
                out.append((kv, layer, offset, storage, row))
                offset += tokens * heads * row
        return out

    def storage_key(self, num_layers: int) -> str:
        """The cache format, as a string: element type, head shape, each layer's K/V storage
        and, for a :attr:`quantized` cache, its byte rows (padded to 16 bytes even in the
        full-precision layers: an 8-bit cache with every layer skipped is not the plain
        cache's format). Prefix-cache keys start from it, so pages of two formats never
        alias."""
        layers = ",".join(f"{self.storage(i, 0, num_layers)}/{self.storage(i, 1, num_layers)}"
                          for i in range(num_layers))
        rows = ":byte-rows" if self.quantized else ""
        return f"{self.dtype}:H{self.n_kv_heads}:D{self.head_dim}:[{layers}]{rows}"

    def heads_per_device(self, n_devices: int = 1) -> int:
        """KV heads each device holds when the heads are split evenly over ``n_devices``."""
        if isinstance(n_devices, (bool, np.bool_)) or not isinstance(n_devices, numbers.Integral) \
                or n_devices <= 0 or self.n_kv_heads % n_devices:
            raise InvalidArgumentError(describe(
                "devices", f"a count that divides n_kv_heads={self.n_kv_heads}", n_devices))
        return self.n_kv_heads // n_devices

    def bytes_per_token(self, num_layers: int, n_devices: int = 1) -> int:
        """Bytes of K and V one token takes over all layers, on one device (scales and row
        padding of a quantized cache included)."""
        _count("num_layers", num_layers)
        heads = self.heads_per_device(n_devices)
        if not self.quantized:
            return 2 * num_layers * heads * self.head_dim * self.itemsize
        return heads * sum(self.row_bytes(self.storage(layer, kv, num_layers))
                           for kv in (0, 1) for layer in range(num_layers))

    def bytes_per_page(self, num_layers: int, n_devices: int = 1) -> int:
        """Bytes of one page (PAGED) over all layers, on one device."""
        if self.page_size is None:
            raise InvalidArgumentError(describe("page_size", "set (PAGED strategy)", None))
        return self.page_size * self.bytes_per_token(num_layers, n_devices)

    def cache_shape(self, num_layers: int, max_batch_size: int, max_seq_len: int,
                    num_pages: int | None = None, n_devices: int = 1) -> tuple[int, ...]:
        """Shape of the cache tensor one device holds (see the module docstring).

        Parameters
        ----------
        num_layers, max_batch_size, max_seq_len : int
            Positive, for every strategy (a PAGED cache's shape depends on ``num_pages``
            instead of the last two, which are still checked).
        num_pages : int, optional
            Pages of a PAGED cache (required there, ignored by the others).
        n_devices : int
            Devices the KV heads are split over (this returns one device's share).

        Returns
        -------
        tuple of int
            CONTINUOUS ``(max_batch_size, 2, num_layers, max_seq_len, heads, head_dim)``,
            PAGED ``(num_pages, 2, num_layers, page_size, heads, head_dim)``, LINEAR
            ``(num_layers, max_batch_size, 2, heads, max_seq_len, head_dim)``; an 8-bit cache
            is bytes: ``(max_batch_size, max_seq_len * bytes_per_token)``, ``(num_pages,
            page_size * bytes_per_token)``, ``(1, max_batch_size, max_seq_len *
            bytes_per_token)``.
        """
        for name, value in (("num_layers", num_layers), ("max_batch_size", max_batch_size),
                            ("max_seq_len", max_seq_len)):
            _count(name, value)
        if num_pages is not None:
            _count("num_pages", num_pages)
        heads = self.heads_per_device(n_devices)
        if self.quantized:
            per_token = self.bytes_per_token(num_layers, n_devices)
            if self.cache_strategy is KVCacheStrategy.CONTINUOUS:
                return (max_batch_size, max_seq_len * per_token)
            if self.cache_strategy is KVCacheStrategy.LINEAR:
                return (1, max_batch_size, max_seq_len * per_token)
            if num_pages is None:
                raise InvalidArgumentError(describe("num_pages", "an int for PAGED", None))
            return (num_pages, self.page_size * per_token)
        if self.cache_strategy is KVCacheStrategy.CONTINUOUS:
            return (max_batch_size, 2, num_layers, max_seq_len, heads, self.head_dim)
        if self.cache_strategy is KVCacheStrategy.LINEAR:
            return (num_layers, max_batch_size, 2, heads, max_seq_len, self.head_dim)
        if num_pages is None:
            raise InvalidArgumentError(describe("num_pages", "an int for PAGED", None))
        return (num_pages, 2, num_layers, self.page_size, heads, self.head_dim)

    def cache_bytes(self, num_layers: int, max_batch_size: int, max_seq_len: int,
                    num_pages: int | None = None, n_devices: int = 1) -> int:
        """Exact bytes of the cache tensor one device holds (arguments as
        :meth:`cache_shape`)."""
        n = 1
        for dim in self.cache_shape(num_layers, max_batch_size, max_seq_len, num_pages,
                                    n_devices):
            n *= dim
        return n * (1 if self.quantized else self.itemsize)

    def pages_for_tokens(self, n_tokens: int) -> int:
        """Pages needed to hold ``n_tokens`` tokens of one sequence (PAGED)."""
        if self.page_size is None:
            raise InvalidArgumentError(describe("page_size", "set (PAGED strategy)", None))
        return -(-_count("n_tokens", n_tokens, allow_zero=True) // self.page_size)
