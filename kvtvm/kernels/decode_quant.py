"""Compatibility name: decode is defined once for every storage type in
:mod:`kvtvm.kernels.decode` (quantized loads through :mod:`kvtvm.kernels.quant_access`).
``schedules/decode/cuda_quant.py`` still imports ``match_params`` from here; delete this module
once it imports it from :mod:`kvtvm.kernels.decode`."""

from .decode import match_params  # noqa: F401

__all__ = ["match_params"]
