"""Chained block hashes and page checksums: the keys of the metadata plane across processes.

Inside one process the prefix cache keys a page by ``(key id of its parent, bytes of its
tokens)`` and compares tokens exactly (:mod:`.prefix_cache`). Across processes and tiers a page
is named by its *chained block hash*: ``h_i = H(h_{i-1} || tokens of page i)`` with ``h_{-1}``
a fixed seed, so two pages share a hash only if (up to collisions) their whole prefixes agree.
A hash is only a name: every hit from any tier or peer is also checked against the page's
stored token ids (content-verified hits), so a collision or a stale entry is a miss.

``bits`` narrows the hash (a test injects a tiny range to force collisions). Hashes are
``xxhash.xxh3_64`` (falling back to ``zlib.crc32`` widened with ``hashlib.blake2b`` when the
``xxhash`` package is missing); page checksums are ``xxh3_64`` of the page's bytes.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

try:  # pragma: no branch
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a dependency; this keeps imports working
    xxhash = None

__all__ = ["HASH_SEED", "DEFAULT_HASH_BITS", "CHECKSUM_NAME", "chain_hash", "block_hashes",
           "fingerprint", "checksum"]

#: The hash of the (empty) parent of page 0.
HASH_SEED = 0x6B7674766D2D3137  # "kvtvm-17"
DEFAULT_HASH_BITS = 64
#: Name of the checksum written into page headers and disk entries.
CHECKSUM_NAME = "xxh3_64" if xxhash is not None else "blake2b_64"

_PACK = struct.Struct("<Q")


def _h64(data: bytes) -> int:
    if xxhash is not None:
        return xxhash.xxh3_64_intdigest(data)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def chain_hash(parent: int, token_bytes: bytes, bits: int = DEFAULT_HASH_BITS) -> int:
    """Hash of a page whose parent page hashes to ``parent`` and whose tokens (int64) are
    ``token_bytes``; in ``[0, 2**bits)``."""
    h = _h64(_PACK.pack(parent & 0xFFFFFFFFFFFFFFFF) + token_bytes)
    return h & ((1 << bits) - 1) if bits < 64 else h


def fingerprint(parent: int, token_bytes: bytes) -> int:
    """Second, independent 64-bit fingerprint of a page's whole prefix (blake2b, never
    narrowed): stored with tier entries next to the token ids, so a hit needs the page's
    tokens *and* its prefix to agree."""
    return int.from_bytes(hashlib.blake2b(_PACK.pack(parent & 0xFFFFFFFFFFFFFFFF) + token_bytes,
                                          digest_size=8).digest(), "little")


def block_hashes(tokens, page_size: int, bits: int = DEFAULT_HASH_BITS,
                 parent: int = HASH_SEED) -> list[int]:
    """Chained hashes of the full pages of ``tokens`` (int sequence ``[n]``); the partial
    last page (``n % page_size`` tokens) has none."""
    raw = np.ascontiguousarray(tokens, dtype=np.int64).reshape(-1).tobytes()
    width, out = 8 * page_size, []
    pack, mask = _PACK.pack, (1 << bits) - 1
    digest = xxhash.xxh3_64_intdigest if xxhash is not None else _h64
    for i in range(0, len(raw) - width + 1, width):  # chain_hash, inlined (hot: every page)
        parent = digest(pack(parent & 0xFFFFFFFFFFFFFFFF) + raw[i:i + width]) & mask
        out.append(parent)
    return out


def tensor_bytes(t):
    """The bytes of torch tensor ``t`` in row-major order, as a 1-D uint8 numpy array (no copy
    when ``t`` is a contiguous CPU tensor)."""
    import torch

    flat = t.detach().contiguous().view(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:  # torch keeps a 1-element view's stride
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8).cpu().numpy()


def checksum(data) -> int:
    """64-bit checksum of a buffer (bytes, numpy array or contiguous CPU torch tensor)."""
    if hasattr(data, "numpy"):  # torch tensor: its bytes, without a copy when contiguous
        data = tensor_bytes(data)
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).view(np.uint8)
    if xxhash is not None:
        return xxhash.xxh3_64_intdigest(data)
    return int.from_bytes(hashlib.blake2b(bytes(data), digest_size=8).digest(), "little")


def checksum_rows(rows) -> list[int]:
    """:func:`checksum` of each row of ``rows`` (a C-contiguous 2-D uint8 numpy array), with
    the per-call checks done once (a page of a few KiB hashes in well under a microsecond)."""
    if xxhash is not None:
        digest = xxhash.xxh3_64_intdigest
        return [digest(r) for r in rows]
    return [checksum(r) for r in rows]
