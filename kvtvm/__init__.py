"""kvtvm: KV-cache managers and ahead-of-time compiled TVM kernels for LLM inference.

``import kvtvm`` needs only the TVM runtime (it works with ``TVM_USE_RUNTIME_LIB=1``); the
compiler is imported when a kernel has to be built. Managers and ops load lazily.

The package root sits above every layer, so it is where the managers (which import no kernels
and no TVM) are handed their defaults: the page / slot copier behind ``fork``'s copy-on-write
and ``LinearKVCache.evict`` (:func:`kvtvm.ops.copy_pages` / :func:`kvtvm.ops.copy_slots`), and
the Relax typing behind ``input_symbols()``
(:func:`kvtvm.integrations.relax.struct_info_of`). Each is imported at its first use.
"""

from __future__ import annotations

import importlib

from .errors import (CompilerUnavailableError, DeviceMismatchError, DeviceUnavailableError,
                     DTypeMismatchError, InvalidArgumentError, KVCacheCapacityError,
                     KVCacheError, SequenceStateError, SequenceTooLongError,
                     UnknownSequenceError)
from .manager.copier import set_default_copiers as _set_default_copiers
from .manager.symbols import set_symbol_builder as _set_symbol_builder
from .params import KVCacheParams, KVCacheStrategy

from ._version import __version__

_LAZY = {
    "ops": "kvtvm.ops",
    "plan": "kvtvm.plan",
    "plan_step": "kvtvm.plan",
    "StepPlan": "kvtvm.plan",
    "compiler": "kvtvm.compiler",
    "KernelSpec": "kvtvm.compiler",
    "KVCacheManager": "kvtvm.manager",
    "ContinuousBatchingKVCacheManager": "kvtvm.manager",
    "PagedKVCacheManager": "kvtvm.manager",
    "LinearKVCache": "kvtvm.manager",
    "RaggedKVCacheInputs": "kvtvm.inputs",
    "PaddedKVCacheInputs": "kvtvm.inputs",
    "KVCacheInputs": "kvtvm.inputs",
    "KVCacheInputsSequence": "kvtvm.inputs",
    "KVCacheInputSymbols": "kvtvm.inputs",
    "RaggedKVCacheInputSymbols": "kvtvm.inputs",
    "ContinuousBatchingKVCacheInputSymbols": "kvtvm.inputs",
    "BatchItem": "kvtvm.inputs",
    "TokenBatch": "kvtvm.inputs",
}


def _copy_pages(blocks, src_pages, dst_pages) -> None:
    """The managers' default page copier: :func:`kvtvm.ops.copy_pages`."""
    from .ops import copy_pages

    copy_pages(blocks, src_pages, dst_pages)


def _copy_slots(cache, src_slots, dst_slots) -> None:
    """The managers' default slot copier: :func:`kvtvm.ops.copy_slots`."""
    from .ops import copy_slots

    copy_slots(cache, src_slots, dst_slots)


def _relax_struct_info(specs):
    """The managers' default ``input_symbols()`` typing: Relax struct info."""
    from .integrations.relax import struct_info_of

    return struct_info_of(specs)


_set_default_copiers(page=_copy_pages, slot=_copy_slots)
_set_symbol_builder(_relax_struct_info)


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        return module if module.__name__.endswith(name) else getattr(module, name)
    raise AttributeError(f"module 'kvtvm' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["KVCacheParams", "KVCacheStrategy", "KVCacheError", "InvalidArgumentError",
           "DTypeMismatchError", "DeviceMismatchError", "UnknownSequenceError",
           "SequenceStateError", "KVCacheCapacityError", "SequenceTooLongError",
           "CompilerUnavailableError", "DeviceUnavailableError", *_LAZY]
