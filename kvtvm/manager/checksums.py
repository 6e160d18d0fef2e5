"""Page checksums: which algorithm a cache names in its page headers, and computing it.

Two algorithms, named in the header's ``checksum`` field:

- :data:`HOST` (``xxh3_64``, or ``blake2b_64`` without the ``xxhash`` package): the pages'
  bytes hashed on the host. Used by CPU caches (33 GB/s on one core here).
- :data:`DEVICE` (``poly16-m31x2``): computed with torch ops where the pages live, so a CUDA
  cache's pages never cross to the host to be checked -- only one 64-bit value per page
  does. The page's bytes are read as little-endian 16-bit words ``w_0 .. w_{n-1}`` (a zero
  byte pads an odd length) and hashed as a polynomial modulo the Mersenne prime
  ``p = 2**31 - 1`` at two points, ``g_0 = 7`` and ``g_1 = 7**5 = 16807`` (both primitive
  roots mod ``p``)::

      h_k = sum_i w_i * g_k**(i + 1)  mod p          checksum = h_0 << 32 | h_1

  Detection: an error confined to one 16-bit word always changes both sums (``g_k`` is a unit
  and ``0 < |e| < p``); any other error pattern ``e`` goes unnoticed only if the nonzero
  polynomial ``E(x) = sum e_i x**(i+1)`` vanishes at both points -- for corruption unrelated to
  the points that is about ``2**-62`` (``n/p`` per point is the worst case over a random
  point). It is a checksum against corruption and truncation, not a MAC: an adversary can
  forge a collision (so can one against xxh3).

  Exact integer arithmetic in int64 (products ``< 2**47``, summed in blocks of ``2**15``,
  ``< 2**62``), identical on CPU and CUDA, so either side can verify the other's pages; the
  weights ``g_k**(i+1) mod p`` are built once per page size and device.

A cache uses :data:`DEVICE` when it lives on CUDA and :data:`HOST` otherwise
(:func:`algorithm_for`); an importer verifies whichever known algorithm the header names and
refuses an unknown name.
"""

from __future__ import annotations

import numpy as np

from .hashing import CHECKSUM_NAME, checksum, checksum_rows, tensor_bytes

__all__ = ["HOST", "DEVICE", "KNOWN", "algorithm_for", "page_checksums"]

HOST = CHECKSUM_NAME
DEVICE = "poly16-m31x2"
KNOWN = (HOST, DEVICE)

_P = (1 << 31) - 1
_POINTS = (7, 16807)
_BLOCK = 1 << 15           # words summed before a reduction (2**15 * 2**47 < 2**63)
_TEMP_BYTES = 128 << 20    # int64 working memory per batch of pages
_weights: dict = {}


def algorithm_for(device) -> str:
    """The checksum a cache on ``device`` writes into its headers."""
    return DEVICE if str(device).startswith("cuda") else HOST


def _powers(g: int, n: int) -> np.ndarray:
    """``g**(i+1) mod p`` for ``i < n`` (exact: every product of two residues is < 2**62)."""
    out = np.ones(n, dtype=np.int64)
    base = np.full(n, g, dtype=np.int64)
    e = np.arange(1, n + 1, dtype=np.int64)
    while e.any():
        odd = (e & 1).astype(bool)
        out[odd] = out[odd] * base[odd] % _P
        base = base * base % _P
        e >>= 1
    return out


def _weights_for(n_padded: int, device):
    import torch

    key = (n_padded, str(device))
    w = _weights.get(key)
    if w is None:
        w = torch.from_numpy(np.stack([_powers(g, n_padded) for g in _POINTS])).to(device)
        if len(_weights) > 16:
            _weights.clear()
        _weights[key] = w
    return w


def _device_sums(pages) -> list[int]:
    """:data:`DEVICE` checksums of ``pages`` (a tensor ``[n, ...]``), computed where they
    live; only the ``n`` results are read back."""
    import torch

    n = pages.shape[0]
    if n == 0:
        return []
    flat = pages.contiguous().view(n, -1).view(torch.uint8)
    if flat.shape[1] % 2:
        flat = torch.nn.functional.pad(flat, (0, 1))
    words = flat.view(torch.int16)
    W = words.shape[1]
    Wp = -(-W // _BLOCK) * _BLOCK
    weights = _weights_for(Wp, pages.device)
    batch = max(1, _TEMP_BYTES // (8 * Wp))
    out = []
    for b in range(0, n, batch):
        part = words[b:b + batch]
        m = part.shape[0]
        w = torch.zeros((m, Wp), dtype=torch.int64, device=pages.device)
        w[:, :W] = part
        w[:, :W] &= 0xFFFF                      # the words unsigned
        sums = []
        for k in range(len(_POINTS)):
            prod = w * weights[k]               # < 2**47 each
            h = prod.view(m, Wp // _BLOCK, _BLOCK).sum(-1) % _P   # block sums < 2**62
            sums.append(h.sum(-1) % _P)
        out.append((sums[0] << 32) | sums[1])
    return torch.cat(out).tolist()


def page_checksums(pages, algorithm: str) -> list[int]:
    """Checksums of each page of ``pages`` (a tensor ``[n, ...]`` or a list of page tensors)
    with ``algorithm`` (:data:`HOST` or :data:`DEVICE`)."""
    import torch

    if algorithm == DEVICE:
        if isinstance(pages, torch.Tensor):
            return _device_sums(pages)
        return [s for p in pages for s in _device_sums(p[None])]
    if algorithm != HOST:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}")
    if isinstance(pages, torch.Tensor) and pages.dim() > 0 and pages.numel() > 0:
        # one conversion for the whole run, then a numpy row per page: per-page torch views
        # cost ~5 us each (2.8 ms against 0.13 ms for 512 pages of 8 KiB)
        return checksum_rows(tensor_bytes(pages).reshape(pages.shape[0], -1))
    return [checksum(p) for p in pages]
