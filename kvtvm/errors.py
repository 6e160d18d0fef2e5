"""kvtvm's exception hierarchy.

Every error kvtvm raises on purpose is a :class:`KVCacheError`. Errors about a value the caller
passed also derive from the matching builtin (``ValueError``, ``TypeError``) so ordinary
``except ValueError`` code keeps working.
"""

from __future__ import annotations


class KVCacheError(Exception):
    """Base class of every error kvtvm raises on purpose."""


class InvalidArgumentError(KVCacheError, ValueError):
    """An argument has the wrong value, shape, rank, stride or range."""


class DTypeMismatchError(KVCacheError, TypeError):
    """A tensor has the wrong dtype."""


class DeviceMismatchError(KVCacheError, ValueError):
    """A tensor lives on the wrong device (or tensors of one call live on different devices)."""


class UnknownSequenceError(KVCacheError, ValueError):
    """A ``seq_id`` that was never claimed, or was already released."""


class SequenceStateError(KVCacheError, ValueError):
    """A call made out of order, e.g. ``step`` without a ``fetch``."""


class KVCacheCapacityError(KVCacheError, RuntimeError):
    """Not enough free slots or pages for what was asked."""


class SequenceTooLongError(InvalidArgumentError):
    """A length would pass ``max_seq_len`` or the capacity of the sequence's pages."""


class CompilerUnavailableError(KVCacheError, RuntimeError):
    """A kernel must be built but the TVM compiler library is not available (runtime-only mode)."""


class DeviceUnavailableError(KVCacheError, RuntimeError):
    """A GPU is needed (CUDA kernel, CUDA tensor) but none can be used on this machine."""


def describe(name: str, expected, actual) -> str:
    """Format the standard 'argument, expected, actual' message."""
    return f"{name}: expected {expected}, got {actual}"


class KernelVersionError(KVCacheError, RuntimeError):
    """A built kernel module was made by another kvtvm or TVM version (or has no readable
    manifest) and cannot be rebuilt here because only the TVM runtime is present."""


class KernelIndexError(InvalidArgumentError):
    """A kernel met an index outside its tensors (a page, a position or a row offset), skipped
    that entry and recorded it in its error flag; raised after the launch (CPU) or by the next
    checked call or :func:`kvtvm.ops.check` (CUDA). The entries it names were not written."""


class StaleInputsError(SequenceStateError):
    """Inputs from a superseded ``fetch`` (a later fetch, the batch's ``step`` or a ``release``
    of one of its sequences came since) were given to an op or a plan; nothing was written."""


class UntrustedKernelError(KVCacheError, PermissionError):
    """A kernel directory or file is owned by another user, or group/others can write it (as
    ssh does with keys, kvtvm loads no code another user could have planted)."""


class CorruptKernelError(KVCacheError, RuntimeError):
    """A built kernel (or a tuning log) is truncated or corrupt -- its sha256 differs from its
    manifest's, or it cannot be read or loaded -- and cannot be rebuilt here."""


class KernelCacheError(KVCacheError, OSError):
    """A kernel must be built on demand but the kernel cache directory (``KVTVM_CACHE_DIR`` or
    the user cache) cannot be created or written (read-only, not a directory, no room)."""


class TransferError(KVCacheError, RuntimeError):
    """Moving pages between caches or processes failed (export, import, transport)."""


class FormatMismatchError(TransferError, ValueError):
    """A page header describes a cache the receiver cannot hold (dtype, layout, page size,
    heads, layers, version): the message names the field and both values."""


class CorruptTransferError(TransferError, ValueError):
    """Page data is truncated or a page's checksum does not match its header."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A peer did not answer in time (dead peer, dropped message)."""
