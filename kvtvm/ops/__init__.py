"""The Python-facing ops: validate tensors at the DLPack boundary, pick the kernel, launch.

Every op takes torch tensors (CPU or CUDA) or, on the CPU, numpy arrays, with no copy; checks
dtype, device, rank, shape, strides and index ranges before launch (:mod:`kvtvm.ops.checks`)
and raises kvtvm's typed errors, writing nothing, on bad input. CUDA kernels run on torch's
current stream.

Each op comes in two forms: ``prepare_<op>(...) -> Launch`` does every check, the policy (the
split count, the kernel variant) and the kernel lookup, and returns the call with its arguments
by slot name (:mod:`kvtvm.ops.launch`); ``<op>(...)`` is ``prepare_<op>(...).run()``.
Per-step plans that replay one layer's launches on the others live above, in
:mod:`kvtvm.plan`.

Conventions shared by all ops: ``cache_lengths[b]`` is the number of tokens sequence ``b``
held *before* this step's new tokens; ``qo_indptr`` (int32 ``[batch + 1]``) gives the rows of
each sequence's new tokens; ``lookup_table`` (int32 ``[batch, max_pages]``) its pages.
"""

from __future__ import annotations

from .append import append_kv, prepare_append_kv
from .copy import copy_pages, copy_slots, prepare_copy_pages, prepare_copy_slots
from .decode import SplitWorkspace, decode_attention, prepare_decode_attention
from .errflag import check
from .launch import Launch, LaunchSequence
from .prefill import prefill_attention, prepare_prefill_attention

__all__ = ["append_kv", "prepare_append_kv", "decode_attention", "prepare_decode_attention",
           "prefill_attention", "prepare_prefill_attention", "copy_pages", "prepare_copy_pages",
           "copy_slots", "prepare_copy_slots", "Launch", "LaunchSequence", "SplitWorkspace", "check"]
