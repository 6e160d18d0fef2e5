"""Cache parameters, strategies, dtype helpers and exact memory arithmetic.

Nothing here touches TVM or allocates memory: the managers allocate exactly what these
functions say, and ``estimated_memory_size`` is built on them.

Cache tensor of each strategy (one tensor per device; KV heads are split evenly across devices):

=============  ==========================================================================
CONTINUOUS     ``[num_blocks, 2, num_layers, max_seq_len, n_kv_heads, head_dim]``
PAGED          ``[num_pages, 2, num_layers, page_size, n_kv_heads, head_dim]``
LINEAR         ``[num_layers, max_batch_size, 2, n_kv_heads, max_seq_len, head_dim]``
=============  ==========================================================================
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from .errors import InvalidArgumentError, describe

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


@dataclass(frozen=True)
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
    """

    dtype: str
    n_kv_heads: int
    head_dim: int
    cache_strategy: KVCacheStrategy = KVCacheStrategy.PAGED
    page_size: int | None = None
    enable_prefix_caching: bool = False

    def __post_init__(self):
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "cache_strategy", KVCacheStrategy.parse(self.cache_strategy))
        for name in ("n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgumentError(describe(name, "a positive int", repr(value)))
        if self.cache_strategy is KVCacheStrategy.PAGED:
            if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) \
                    or self.page_size <= 0:
                raise InvalidArgumentError(
                    describe("page_size", "a positive int for the PAGED strategy",
                             repr(self.page_size)))
        elif self.page_size is not None:
            raise InvalidArgumentError(
                describe("page_size", f"None for the {self.cache_strategy.name} strategy",
                         repr(self.page_size)))
        if self.enable_prefix_caching and self.cache_strategy is not KVCacheStrategy.PAGED:
            raise InvalidArgumentError(
                describe("enable_prefix_caching", "False unless the strategy is PAGED", True))

    @classmethod
    def from_hf_config(cls, config, dtype=None, cache_strategy="paged", page_size=None,
                       enable_prefix_caching: bool = False) -> "KVCacheParams":
        """Parameters of a transformers model's KV cache.

        Parameters
        ----------
        config : transformers.PretrainedConfig
            A decoder config (a multimodal one's text config is used): ``num_key_value_heads``
            (default ``num_attention_heads``), ``head_dim`` (default ``hidden_size //
            num_attention_heads``), ``dtype`` (when ``dtype`` is None).
        dtype, cache_strategy, page_size, enable_prefix_caching
            As for the constructor.
        """
        config = getattr(config, "get_text_config", lambda: config)()
        heads = getattr(config, "num_attention_heads", None)
        if not isinstance(heads, int):
            raise InvalidArgumentError(describe("config", "a decoder config with "
                                                "num_attention_heads", type(config).__name__))
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        if dtype is None:
            dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if dtype is None:
            raise InvalidArgumentError(describe("dtype", "given (the config names none)", None))
        return cls(dtype, int(kv_heads), int(head_dim), cache_strategy, page_size=page_size,
                   enable_prefix_caching=enable_prefix_caching)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]

    def heads_per_device(self, n_devices: int = 1) -> int:
        """KV heads each device holds when the heads are split evenly over ``n_devices``."""
        if n_devices <= 0 or self.n_kv_heads % n_devices:
            raise InvalidArgumentError(describe(
                "devices", f"a count that divides n_kv_heads={self.n_kv_heads}", n_devices))
        return self.n_kv_heads // n_devices

    def bytes_per_token(self, num_layers: int, n_devices: int = 1) -> int:
        """Bytes of K and V one token takes over all layers, on one device."""
        return 2 * num_layers * self.heads_per_device(n_devices) * self.head_dim * self.itemsize

    def bytes_per_page(self, num_layers: int, n_devices: int = 1) -> int:
        """Bytes of one page (PAGED) over all layers, on one device."""
        if self.page_size is None:
            raise InvalidArgumentError(describe("page_size", "set (PAGED strategy)", None))
        return self.page_size * self.bytes_per_token(num_layers, n_devices)

    def cache_shape(self, num_layers: int, max_batch_size: int, max_seq_len: int,
                    num_pages: int | None = None, n_devices: int = 1) -> tuple[int, ...]:
        """Shape of the cache tensor one device holds (see the module docstring)."""
        heads = self.heads_per_device(n_devices)
        if self.cache_strategy is KVCacheStrategy.CONTINUOUS:
            return (max_batch_size, 2, num_layers, max_seq_len, heads, self.head_dim)
        if self.cache_strategy is KVCacheStrategy.LINEAR:
            return (num_layers, max_batch_size, 2, heads, max_seq_len, self.head_dim)
        if num_pages is None:
            raise InvalidArgumentError(describe("num_pages", "an int for PAGED", None))
        return (num_pages, 2, num_layers, self.page_size, heads, self.head_dim)

    def cache_bytes(self, num_layers: int, max_batch_size: int, max_seq_len: int,
                    num_pages: int | None = None, n_devices: int = 1) -> int:
        """Exact bytes of the cache tensor one device holds."""
        n = 1
        for dim in self.cache_shape(num_layers, max_batch_size, max_seq_len, num_pages,
                                    n_devices):
            n *= dim
        return n * self.itemsize

    def pages_for_tokens(self, n_tokens: int) -> int:
        """Pages needed to hold ``n_tokens`` tokens of one sequence (PAGED)."""
        if self.page_size is None:
            raise InvalidArgumentError(describe("page_size", "set (PAGED strategy)", None))
        return -(-n_tokens // self.page_size)
