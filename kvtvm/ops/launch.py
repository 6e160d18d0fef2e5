"""Prepared kernel calls: :class:`Launch` holds a loaded kernel, its device and its arguments by
slot name; ``run()`` calls it (CUDA: on torch's current stream of that device).

Every op is ``prepare_<op>(...) -> Launch`` (all checks, policy such as the split count, kernel
lookup) followed by ``.run()``. A plan (:mod:`kvtvm.plan`) keeps the launches of one layer and
runs the other layers with :meth:`Launch.rebind`, which swaps tensors slot by slot after checking
that each new tensor has the dtype, shape, strides and device of the one it replaces.

Every launch's last slot, ``err``, is the kernel's error flag (:mod:`kvtvm.ops.errflag`): a CPU
``run()`` raises :class:`~kvtvm.errors.KernelIndexError` right after a kernel that skipped an
out-of-range index; on CUDA the device's flag is read by :func:`kvtvm.ops.check`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from .. import compiler, runtime
from ..errors import InvalidArgumentError, describe
from ..inputs import check_live
from ..storage import view_storage
from . import errflag
from .checks import (CACHE_ARGS, as_tensor, check_cache_owner, check_no_alias,
                     check_vector_aligned)

__all__ = ["Launch", "LaunchSequence", "kernel_for", "signature"]


def signature(t) -> tuple:
    """What a rebound tensor must share with the one it replaces."""
    return t.dtype, tuple(t.shape), t.stride(), t.device


#: slots whose rows a CUDA kernel may move as 16-byte vectors
_VECTOR_ROWS = CACHE_ARGS + ("q", "k", "v")
#: The slots :meth:`Launch.rebind` swaps (what a step plan changes between layers).
REBINDABLE = CACHE_ARGS + ("k", "v", "q", "out", "lse")


def cache_dtype_names(k_cache, v_cache) -> dict:
    """``Launch(cache_dtypes=...)``: the K/V caches' dtypes as the caller gave them (before
    the int8 views the kernels take of float8 caches)."""
    return {"k_cache": _dtype_name(k_cache), "v_cache": _dtype_name(v_cache)}


def _dtype_name(t) -> str:
    return str(getattr(t, "dtype", "")).replace("torch.", "")


def _bump_versions(tensors: tuple) -> None:
    import torch

    try:
        torch.autograd.graph.increment_version(tensors)  # (a sequence: torch 2.5 and later)
    except TypeError:
        for t in tensors:
            torch.autograd.graph.increment_version(t)


#: The int32 tables a kernel reads (slots that rebind keeps).
_TABLES = ("qo_indptr", "cache_lengths", "lookup_table")


def _roles(slots: dict) -> tuple:
    """(slots the kernel writes, slots it reads) among the tensors its op checks for aliasing:
    attention writes out and lse and reads q, the caches and the tables; append writes the
    caches and reads k, v and the tables."""
    tables = tuple(n for n in _TABLES if n in slots)
    if "out" in slots:
        return ("out", "lse"), ("q",) + CACHE_ARGS + tables
    if "k" in slots:
        return CACHE_ARGS, ("k", "v") + tables
    return (), ()


@functools.lru_cache(maxsize=None)
def _kernel(spec_items: tuple, target: tuple, search_key: tuple):
    target_name, arch = target
    spec = compiler.KernelSpec(target=target_name, arch=arch, **dict(spec_items))
    return compiler.get_kernel(spec)


def kernel_for(device, **spec) -> Callable:
    """The loaded kernel of ``spec`` (KernelSpec fields but target/arch) for ``device``.

    Memoized per (spec, target, kernel search path): once loaded, a lookup costs a dictionary
    access.
    """
    if not spec.get("variant"):
        spec.pop("variant", None)
    return _kernel(tuple(sorted(spec.items())), compiler.target_for_device(device),
                   compiler.search_key())


class Launch:
    """One prepared kernel call.

    Parameters
    ----------
    fn : callable or None
        The loaded kernel; None for a call with nothing to do (an empty batch).
    device : torch.device
        Where it runs.
    slots : dict
        Argument name -> value (tensor or scalar), in the kernel's argument order, but the
        error flag: ``err`` is added last (the device's flag on CUDA, a fresh one on the CPU)
        unless given (launches of one op may share it).
    outputs : tuple of str
        Slots ``run()`` returns (e.g. ``("out", "lse")``); ``run()`` returns None when empty.
    cache_dtypes : dict, optional
        ``{"k_cache": dtype name, "v_cache": ...}`` as the caller gave the caches
        (:func:`cache_dtype_names`; a float8 cache's slot holds its int8 view): what
        :meth:`rebind` accepts. Default: the slots' own dtypes.
    """

    __slots__ = ("fn", "device", "slots", "outputs", "tokens", "parallel", "_errv",
                 "cache_dtypes", "_written")

    def __init__(self, fn, device, slots: dict, outputs: tuple = (), tokens: tuple = (),
                 _errv=None, parallel: bool = True, cache_dtypes: dict | None = None):
        if "err" not in slots:
            slots = dict(slots)
            slots["err"], _errv = errflag.new_flag(device)
        self.fn, self.device, self.slots, self.outputs = fn, device, slots, tuple(outputs)
        self.tokens = tokens  # fetch tokens of the manager tables in the slots
        self.parallel = parallel  # CPU: uses TVM's thread pool (False: a serial variant)
        self._errv = _errv  # numpy view of a CPU flag (None on CUDA)
        #: the dtypes of the K/V caches as the caller gave them (a float8 cache sits in its
        #: slot as the int8 view the kernel takes); default: the slots' own
        self.cache_dtypes = cache_dtypes or {n: _dtype_name(slots[n]) for n in CACHE_ARGS
                                             if n in slots}
        #: the slots the kernel writes: their autograd version counters are bumped after it
        #: runs, as a torch in-place op would (a tensor saved for a backward then raises there)
        self._written = tuple(n for n in (_roles(slots)[0] or ("blocks",)) if n in slots)

    def run(self):
        """Call the kernel; returns the output slots (a tuple), or None when there are none.

        Raises
        ------
        StaleInputsError
            A table tensor comes from a superseded fetch (nothing is launched).
        KernelIndexError
            CPU: the kernel skipped an out-of-range index (nothing outside the tensors was
            touched; the skipped entries were not written).
        """
        lock = self.tokens[0].lock if self.tokens else None
        if lock is None:
            return self._run()
        with lock:  # the fetch's manager: no fetch between the check and the launch
            return self._run()

    def _run(self):
        for tok in self.tokens:
            if not tok.live:
                check_live("inputs of this launch", tok)
        if self.fn is not None:
            if self.device.type == "cuda":
                import torch

                with torch.cuda.device(self.device):
                    self.fn(*self.slots.values())
            else:
                runtime.call_cpu_kernel(self.fn, tuple(self.slots.values()), self.parallel)
            if self._written:
                slots = self.slots
                _bump_versions(tuple([slots[n] for n in self._written]))
            if self._errv is not None and errflag.is_set(self._errv):
                errflag.check_view(self._errv, f"the {self._name()} kernel")
        if self.outputs:
            return tuple(self.slots[name] for name in self.outputs)
        return None

    def rebind(self, _fresh: tuple = (), **tensors) -> "Launch":
        """A copy with ``tensors`` in the slots of the same names (``_fresh``: the names of
        those just allocated by the caller, which can share memory with nothing).

        Only the tensors a step plan swaps between layers are rebound: the K/V caches, the
        new rows ``k`` / ``v``, ``q``, ``out`` and ``lse`` (the tables, checked against their
        fetch when the call was prepared, stay).

        Raises
        ------
        InvalidArgumentError
            A name is not one of those slots, or a tensor differs from the one in its slot in
            dtype (a cache: the storage type it was prepared for, int8 and float8 apart),
            shape, strides or device (the caller then prepares the call afresh); or, as the
            op would refuse them: a cache view not of the fetch's manager (or K and V swapped,
            or of two layers), an output sharing memory with an input, rows not 16-byte
            aligned on CUDA.
        """
        slots = dict(self.slots)
        written, read = _roles(slots)
        for name, t in tensors.items():
            if name not in REBINDABLE:  # (stale or unchecked tables were accepted)
                raise InvalidArgumentError(describe(
                    name, f"one of the slots rebind swaps ({', '.join(REBINDABLE)}); "
                    "prepare the call afresh to change the others", "given"))
            if hasattr(t, "requires_grad") and name not in _fresh and not (
                    self.tokens and name in CACHE_ARGS):  # (a fetch's views: vouched below)
                t = as_tensor(name, t, written=name in written)  # the op's boundary checks
            old = slots.get(name)
            if name in CACHE_ARGS and old is not None:
                if not self.tokens:  # (a fetch's: check_cache_owner below vouches for them)
                    ref = slots["q"] if "q" in slots else slots["k"]  # head_dim, dtype
                    view_storage(name, t, int(ref.shape[-1]), _dtype_name(ref))
                given = _dtype_name(t)
                if given != self.cache_dtypes.get(name):  # (int8 rows read as float8, or
                    raise InvalidArgumentError(describe(  # the other way, were accepted)
                        name, f"a {self.cache_dtypes.get(name)} cache like the prepared one",
                        f"a {given} one"))
                if given == "float8_e4m3fn" and _dtype_name(old) == "int8":
                    t = t.view(old.dtype)  # the int8 view the kernels take of float8 rows
            if old is None or not hasattr(t, "stride") or signature(t) != signature(old):
                raise InvalidArgumentError(describe(
                    name, f"a tensor like the prepared one ({_describe(old)})", _describe(t)))
            slots[name] = t
        owned = bool(self.tokens)  # (the prepared caches were checked against the fetch)
        if owned and any(n in tensors for n in CACHE_ARGS):
            # K as K, V as V, of one layer, of the fetch's manager
            kept = {n for n in CACHE_ARGS if n in slots and n not in tensors}
            check_cache_owner(self.tokens[0], {n: tensors.get(n, slots[n]) for n in CACHE_ARGS
                                               if n in slots}, kernel_args=kept)
        if self.device.type == "cuda":  # as prepare_* checks: rows move in 16-byte vectors
            check_vector_aligned({n: t for n, t in tensors.items() if n in _VECTOR_ROWS})
            check_vector_aligned({n: t for n, t in tensors.items() if n == "out"},
                                 strides=False)
        checked = [n for n in written if n not in _fresh]
        if checked and any(n in tensors for n in written + read):  # as the op checks them
            check_no_alias({n: slots[n] for n in checked},
                           {n: slots[n] for n in read + tuple(set(written) - set(checked))},
                           kv_owned=owned)
        new = Launch.__new__(Launch)  # (this launch's other fields as they are)
        for field in Launch.__slots__:
            setattr(new, field, getattr(self, field))
        new.slots = slots
        return new

    def _name(self) -> str:
        # (a TVM function has no __name__: "the kvtvm kernel skipped ...", not "kernel kernel")
        return getattr(self.fn, "__name__", None) or ("no-op" if self.fn is None else "kvtvm")

    def __repr__(self) -> str:
        return f"Launch({self._name()} on {self.device}, slots={list(self.slots)})"


class LaunchSequence:
    """Launches that run one after another (e.g. the rounds of a copy); ``run()`` returns None."""

    __slots__ = ("launches",)

    def __init__(self, launches):
        self.launches = tuple(launches)

    def run(self) -> None:
        """Run the launches in order (errors as :meth:`Launch.run`)."""
        for launch in self.launches:
            launch.run()

    def __len__(self) -> int:
        return len(self.launches)


def _describe(t: Any) -> str:
    if hasattr(t, "stride"):
        dtype, shape, strides, device = signature(t)
        return f"{str(dtype).replace('torch.', '')} {list(shape)} strides {list(strides)} on {device}"
    return type(t).__name__
