"""kvtvm: KV-cache managers and ahead-of-time compiled TVM kernels for LLM inference.

``import kvtvm`` needs only the TVM runtime (it works with ``TVM_USE_RUNTIME_LIB=1``); the
compiler is imported when a kernel has to be built. Managers and ops load lazily.
"""

from __future__ import annotations

import importlib

from .errors import (CompilerUnavailableError, DeviceMismatchError, DeviceUnavailableError,
                     DTypeMismatchError, InvalidArgumentError, KVCacheCapacityError,
                     KVCacheError, SequenceStateError, SequenceTooLongError,
                     UnknownSequenceError)
from .params import KVCacheParams, KVCacheStrategy

from ._version import __version__

_LAZY = {
    "ops": "kvtvm.ops",
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
    "BatchItem": "kvtvm.inputs",
    "TokenBatch": "kvtvm.inputs",
}


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        return module if module.__name__.endswith(name) else getattr(module, name)
    raise AttributeError(f"module 'kvtvm' has no attribute {name!r}")


__all__ = ["KVCacheParams", "KVCacheStrategy", "KVCacheError", "InvalidArgumentError",
           "DTypeMismatchError", "DeviceMismatchError", "UnknownSequenceError",
           "SequenceStateError", "KVCacheCapacityError", "SequenceTooLongError",
           "CompilerUnavailableError", "DeviceUnavailableError", *_LAZY]
