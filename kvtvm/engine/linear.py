"""The engine's linear layers: oneDNN with pre-packed weights on the CPU, else torch's own.

torch's ``nn.Linear`` runs float32 on the CPU through MKL's ``sgemm``. On this project's AMD
EPYC (AVX-512) MKL takes its AVX2 path: about 100 GFLOP/s on one core for a 1024-token prefill
and 9 GB/s of weights for an 8-token decode step, while oneDNN (also inside torch) reaches about
200 GFLOP/s and 20 GB/s with its weights packed once into its blocked layout (docs/PERF.md,
"Linear layers through oneDNN"). :class:`LinearBackend` holds one packed copy of each weight the
engine multiplies by (memory: the model's linear weights once more) and calls
``torch.ops.mkldnn._linear_pointwise``; the model's own modules and weights are left untouched.

The packed copy is rebuilt when a weight changes (another tensor, or an in-place write: torch's
version counter). The op is private to torch, so the backend checks it once against
``torch.nn.functional.linear`` on random inputs and falls back to torch (with a log line) when
the op is missing or disagrees; any dtype but float32, any device but the CPU, or
``backend="torch"`` use torch's ``nn.Linear`` directly. oneDNN and MKL sum in a different
order: outputs differ in the last bits (about 1e-6 relative), as between any two GEMM libraries.
"""

from __future__ import annotations

import logging
import weakref

import torch

from ..errors import InvalidArgumentError

__all__ = ["LinearBackend", "LINEAR_BACKENDS", "backend_for"]

_log = logging.getLogger("kvtvm.engine")

#: ``ModelRunner(linear=...)`` choices: "auto" is oneDNN where it applies (CPU float32).
LINEAR_BACKENDS = ("auto", "onednn", "torch")


def _onednn_op():
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or mkldnn is None:
        return None, None
    try:
        return mkldnn._reorder_linear_weight, mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None, None


def _self_check(pack, call) -> str:
    """Why oneDNN's linear cannot be used here ("" when it agrees with torch's)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=gen)
    b = torch.randn(96, generator=gen)
    try:
        for rows in (1, 7, 64):
            x = torch.randn(rows, 80, generator=gen)
            got = call(x, pack(w), b, "none", [], "")
            want = torch.nn.functional.linear(x, w, b)
            if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
                return "its output differs from torch.nn.functional.linear"
    except (RuntimeError, TypeError) as err:
        return f"it failed ({err})"
    return ""


class LinearBackend:
    """``y = x @ W.T + b`` for the model's ``nn.Linear`` modules, through oneDNN when it applies.

    Parameters
    ----------
    dtype : torch.dtype
        The model's dtype.
    device : torch.device
        The model's device.
    backend : {"auto", "onednn", "torch"}
        ``"auto"``: oneDNN on the CPU in float32, torch otherwise. ``"onednn"``: the same, but an
        unusable oneDNN raises instead of falling back.
    """

    def __init__(self, dtype, device, backend: str = "auto"):
        if backend not in LINEAR_BACKENDS:
            raise InvalidArgumentError(
                f"linear must be one of {LINEAR_BACKENDS}, got {backend!r}")
        self._packed: dict[int, tuple] = {}
        self._pack = self._call = None
        self.name = "torch"
        if backend == "torch":
            return
        why = ""
        if torch.device(device).type != "cpu" or dtype != torch.float32:
            why = f"it is used on the CPU in float32 only (model: {device}, {dtype})"
        else:
            pack, call = _onednn_op()
            why = "torch has no oneDNN linear op" if pack is None else _self_check(pack, call)
        if why:
            if backend == "onednn":
                raise InvalidArgumentError(f"linear='onednn': {why}")
            if torch.device(device).type == "cpu" and dtype == torch.float32:
                _log.info("linear layers through torch, not oneDNN: %s", why)
            return
        self._pack, self._call, self.name = pack, call, "onednn"

    def __call__(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``module(x)`` for ``x`` of shape ``[rows, in_features]`` -> ``[rows, out_features]``."""
        if self._call is None:
            return module(x)
        w = module.weight
        key = id(module)
        entry = self._packed.get(key)
        if entry is None or entry[0] is not w or entry[1] != w._version:
            entry = (w, w._version, self._pack(w.detach()))
            self._packed[key] = entry
        return self._call(x, entry[2], module.bias, "none", [], "")

    def packed_bytes(self) -> int:
        """Bytes of the packed weight copies held now."""
        return sum(e[0].numel() * e[0].element_size() for e in self._packed.values())


_SHARED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def backend_for(model, dtype, device, backend: str = "auto") -> LinearBackend:
    """The :class:`LinearBackend` of ``model`` for ``backend``, shared by every runner of the
    same model (one packed copy of its weights, not one per engine)."""
    per_model = _SHARED.setdefault(model, {})
    key = (backend, dtype, str(device))
    if key not in per_model:
        per_model[key] = LinearBackend(dtype, device, backend)
    return per_model[key]
