"""A manager's per-step inputs as plain data, and the hook that types them for a graph.

:meth:`KVCacheManager.input_specs` describes each device's inputs (``blocks``,
``cache_lengths``, ``lookup_table``, ``max_lengths``) as :class:`TensorSymbol` values: a dtype
and a shape of ints and *named* symbolic dims (``"batch"``, ``"num_steps"``; one name is one
dim shared by every tensor of the call). :meth:`KVCacheManager.input_symbols` hands them to
the *symbol builder* registered here, which turns them into a graph compiler's types. The
package root (:mod:`kvtvm`) registers the Relax integration's builder
(:func:`kvtvm.integrations.relax.struct_info_of`), imported only when first called, so
managers import no TVM and nothing above them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

from ..errors import InvalidArgumentError, KVCacheError, describe

__all__ = ["TensorSymbol", "set_symbol_builder", "build_symbols"]


@dataclass(frozen=True)
class TensorSymbol:
    """Shape and dtype of one input tensor, with symbolic dims named.

    Attributes
    ----------
    shape : tuple of (int or str)
        Concrete extents as ints; a str is a symbolic int64 extent of that name.
    dtype : str
        ``"float32"``, ``"int32"``, ...
    """

    shape: tuple[Union[int, str], ...]
    dtype: str

    @property
    def ndim(self) -> int:
        return len(self.shape)


_builder: Optional[Callable] = None


def set_symbol_builder(builder: Callable) -> None:
    """Register the function :meth:`KVCacheManager.input_symbols` calls.

    ``builder(specs)`` takes a list (one per device) of
    :class:`kvtvm.inputs.RaggedKVCacheInputSymbols` whose fields are :class:`TensorSymbol`
    and returns the same list with each field typed for the graph compiler.
    """
    global _builder
    if not callable(builder):
        raise InvalidArgumentError(describe("set_symbol_builder: builder", "a callable",
                                            type(builder).__name__))
    _builder = builder


def build_symbols(specs: list) -> list:
    """``specs`` typed by the registered builder (see :func:`set_symbol_builder`)."""
    if _builder is None:
        raise KVCacheError("input_symbols: no symbol builder is registered (import kvtvm, "
                           "which registers the Relax integration's)")
    return _builder(specs)
