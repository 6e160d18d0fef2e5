"""The self-describing format of exported pages: :class:`PageHeader` (the metadata plane: its
fields as JSON, its token ids, block hashes and checksums as binary arrays) and
:class:`PageExport` (a header, the page data as views of the cache, and the lease that keeps
those pages unchanged until the data has been sent). Plain data: the manager side that fills
and checks them is :mod:`.pageio`."""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, fields, replace

import numpy as np

from ..errors import (CorruptTransferError, FormatMismatchError, InvalidArgumentError,
                      TransferError, describe)

__all__ = ["FORMAT_VERSION", "LAYOUT", "STORAGE", "PageHeader", "PageExport", "check_export",
           "tokens_checksum"]

#: 3: the header carries ``tokens_checksum`` (version 2 had nothing covering its token ids)
FORMAT_VERSION = 3
#: Wire encoding of a header: this magic, the JSON length (uint32 little-endian), the JSON of
#: every field but the three arrays (with their lengths, -1 for absent checksums), then the
#: tokens (int64), block hashes and checksums (uint64), little-endian. Arrays in JSON cost
#: ~0.4 us an element each way (3 ms to encode the header of an 8K-token prompt).
HEADER_MAGIC = b"KVTH"
_ARRAYS = (("tokens", "<i8"), ("block_hashes", "<u8"), ("checksums", "<u8"))
_HEAD = struct.Struct("<4sI")
LAYOUT = "page,kv,layer,slot,head,dim"
STORAGE = "dense"  # quantized caches name their scale format here


def tokens_checksum(tokens) -> int:
    """Checksum of token ids ``tokens`` (int sequence ``[n]``) as a header carries it: the
    64-bit blake2b of their int64 little-endian bytes (fixed, whatever hash package a peer
    has; ~0.1 ms for 8K tokens)."""
    raw = np.ascontiguousarray(tokens, dtype="<i8").tobytes()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


@dataclass(frozen=True)
class PageHeader:
    """Self-description of a run of exported pages (the metadata plane).

    Attributes
    ----------
    version, dtype, storage, layout : int, str, str, str
        Format version; element type; ``"dense"`` (or a quantized format with its scale
        layout: ``quant:<KVCacheParams.storage_key>:scale=f32-per-row:align=16``, each layer's
        K/V storage type and a float32 scale per (token, head) row); the axes of one page,
        ``page,kv,layer,slot,head,dim``.
    page_size, n_kv_heads, head_dim, num_layers : int
        Tokens per page; KV heads of the model (all devices); elements per head; layers.
    head_range : tuple of int
        ``(h0, h1)``: the heads carried, of ``n_kv_heads``.
    tokens : tuple of int
        Every token the pages cover, from token 0 (``n_pages = ceil(len / page_size)``).
    first_page : int
        Pages ``[first_page, n_pages)`` carry data (the peer holds the ones before).
    block_hashes : tuple of int
        Chained hashes of the full pages, from page 0 (:mod:`.hashing`), ``hash_bits`` wide.
    tokens_checksum : int
        :func:`tokens_checksum` of ``tokens``: the page checksums cover the data only, and a
        token id damaged on the way would register the pages under other tokens (the ids of
        the partial last page have no block hash to betray them).
    checksum, checksums : str, tuple of int
        Checksum algorithm (:mod:`.checksums`: ``xxh3_64`` on the host, ``poly16-m31x2``
        computed where the pages live) and one checksum per carried page; ``None`` in a
        header sent ahead of its data (a transport sends the checksums after the pages,
        computed while they are on the wire).
    page_bytes : int
        Bytes of one carried page.
    """

    version: int
    dtype: str
    storage: str
    layout: str
    page_size: int
    n_kv_heads: int
    head_range: tuple
    head_dim: int
    num_layers: int
    tokens: tuple
    first_page: int
    block_hashes: tuple
    hash_bits: int
    checksum: str
    checksums: tuple
    page_bytes: int = 0
    tokens_checksum: int | None = None

    @property
    def tensor_dtype(self) -> str:
        """Element type of the page data: ``dtype``, or ``uint8`` for a quantized cache."""
        return self.dtype if self.storage == STORAGE else "uint8"

    def token_array(self) -> np.ndarray:
        """``tokens`` as a read-only int64 array ``[len(tokens)]`` (made once per header)."""
        arr = self.__dict__.get("_token_array")
        if arr is None:
            arr = np.asarray(self.tokens, dtype=np.int64)
            arr.setflags(write=False)
            object.__setattr__(self, "_token_array", arr)
        return arr

    @property
    def n_pages(self) -> int:
        return -(-len(self.tokens) // self.page_size)

    @property
    def n_carried(self) -> int:
        return self.n_pages - self.first_page

    @property
    def page_shape(self) -> tuple:
        """Shape of one carried page: ``(2, num_layers, page_size, heads, head_dim)``, or
        ``(page_bytes,)`` for a quantized cache (its pages are byte rows)."""
        if self.storage != STORAGE:
            return (self.page_bytes,)
        h0, h1 = self.head_range
        return (2, self.num_layers, self.page_size, h1 - h0, self.head_dim)

    def to_bytes(self) -> bytes:
        """The wire encoding (:data:`HEADER_MAGIC`); :meth:`from_bytes` reads it back."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}  # asdict deep-copies
        arrays = []
        for name, dt in _ARRAYS:
            value = d.pop(name)
            if value is None:
                d[f"n_{name}"] = -1
                continue
            try:
                arr = self.token_array() if name == "tokens" else np.asarray(value, dtype=dt)
            except (TypeError, ValueError, OverflowError) as err:
                raise CorruptTransferError(f"page header field {name}: not encodable as "
                                           f"{np.dtype(dt).name} ({err})") from None
            if arr.ndim != 1:
                raise CorruptTransferError(f"page header field {name}: expected a sequence "
                                           f"of int, got shape {arr.shape}")
            d[f"n_{name}"] = arr.size
            arrays.append(arr.tobytes())
        text = json.dumps(d, separators=(",", ":")).encode()
        return b"".join([_HEAD.pack(HEADER_MAGIC, len(text)), text, *arrays])

    def with_checksums(self, checksums) -> "PageHeader":
        """This header with ``checksums`` filled in (one int per carried page)."""
        try:
            sums = tuple(int(c) for c in checksums)
        except (TypeError, ValueError) as err:
            raise CorruptTransferError(f"page header: checksums unreadable ({err})") from None
        if len(sums) != self.n_carried:
            raise CorruptTransferError(f"page header: {len(sums)} checksums for "
                                       f"{self.n_carried} pages")
        return self._replace_checksums(sums)

    def _replace_checksums(self, sums) -> "PageHeader":
        out = replace(self, checksums=sums)
        if "_token_array" in self.__dict__:  # the same tokens: keep their array
            object.__setattr__(out, "_token_array", self.__dict__["_token_array"])
        return out

    def check(self, deferred: bool = False, content: bool = True) -> "PageHeader":
        """Raise :class:`CorruptTransferError` naming the first field of the wrong type or
        inconsistent with the others (a header built in Python, or parsed from the wire);
        returns the header. ``deferred``: the checksums may be ``None`` (they follow the
        data). ``content`` False: the layout only, not the version (another version is a
        :class:`FormatMismatchError`) nor the tokens' checksum -- what a transport needs to
        drain the data of a header the import then refuses, the wire kept in step."""
        def bad(name, why):
            raise CorruptTransferError(f"page header field {name}: {why} (truncated, corrupt "
                                       "or built inconsistently)")

        def ints(name, seq, lo=None, hi=None):  # exact ints: a JSON true must not pass as 1
            if not isinstance(seq, tuple) or not set(map(type, seq)) <= {int}:  # in C
                bad(name, f"expected a tuple of int, got {_short(seq)}")
            if seq and ((lo is not None and min(seq) < lo) or (hi is not None and max(seq) > hi)):
                bad(name, f"expected values in [{lo}, {hi}]")

        ints("version", (self.version,), 0)
        if content and self.version != FORMAT_VERSION:  # before fields another version lays
            raise FormatMismatchError(f"page header field version: this kvtvm reads "  # out
                                      f"{FORMAT_VERSION}, the peer sent {self.version}")
        for name in ("page_size", "n_kv_heads", "head_dim", "num_layers", "first_page",
                     "page_bytes"):
            ints(name, (getattr(self, name),), 0)
        ints("hash_bits", (self.hash_bits,), 1, 64)
        if content:
            ints("tokens_checksum", (self.tokens_checksum,), 0, (1 << 64) - 1)
        for name in ("dtype", "storage", "layout", "checksum"):
            if not isinstance(getattr(self, name), str):
                bad(name, f"expected a str, got {_short(getattr(self, name))}")
        ints("head_range", tuple(self.head_range) if isinstance(self.head_range, (tuple, list))
             else self.head_range, 0)
        if len(self.head_range) != 2:
            bad("head_range", f"expected (h0, h1), got {_short(self.head_range)}")
        if self.page_size < 1:
            bad("page_size", f"expected a positive int, got {self.page_size}")
        typed = self.__dict__.get("_typed_arrays", False)  # decoded from int64/uint64 arrays
        if not typed:
            ints("tokens", self.tokens, -(1 << 63), (1 << 63) - 1)  # int64 token ids
        if content and tokens_checksum(self.token_array()) != self.tokens_checksum:
            bad("tokens", f"their checksum is not tokens_checksum {self.tokens_checksum:#x}")
        if not 0 <= self.first_page <= self.n_pages:
            bad("first_page", f"expected an int in [0, n_pages={self.n_pages}], got "
                f"{self.first_page}")
        if not typed:
            ints("block_hashes", self.block_hashes, 0)
        full = len(self.tokens) // self.page_size
        if len(self.block_hashes) != full:
            bad("block_hashes", f"expected one per full page ({full}), got "
                f"{len(self.block_hashes)}")
        if self.checksums is None and deferred:
            return self
        if not typed or not isinstance(self.checksums, tuple):
            ints("checksums", self.checksums, 0)
        if len(self.checksums) != self.n_carried:
            bad("checksums", f"expected one per carried page ({self.n_carried}), got "
                f"{len(self.checksums)}")
        return self

    @classmethod
    def from_bytes(cls, raw: bytes, deferred: bool = False,
                   content: bool = True) -> "PageHeader":
        """Parse and sanity-check a header (:meth:`check`, ``deferred`` and ``content`` as
        there); anything malformed is a CorruptTransferError."""
        try:
            raw = bytes(raw)
            magic, n = _HEAD.unpack_from(raw)
            if magic != HEADER_MAGIC:
                raise ValueError(f"not a kvtvm page header (starts {raw[:4]!r})")
            d = json.loads(raw[_HEAD.size:_HEAD.size + n].decode())
            if not isinstance(d, dict):
                raise ValueError(f"fields are {type(d).__name__}, not an object")
            at, arrays = _HEAD.size + n, {}
            for name, dt in _ARRAYS:
                count = d.pop(f"n_{name}")
                # -1: the checksums follow the data (deferred); the other arrays always come
                if type(count) is not int or count < (-1 if name == "checksums" else 0):
                    raise ValueError(f"length of {name} is {count!r}")
                if count == -1:
                    d[name] = None
                    continue
                size = count * 8
                if at + size > len(raw):
                    raise ValueError(f"{name}: {count} values announced, "
                                     f"{(len(raw) - at) // 8} sent")
                arrays[name] = np.frombuffer(raw, dt, count, at)  # read-only
                d[name] = tuple(arrays[name].tolist())
                at += size
            if at != len(raw):
                raise ValueError(f"{len(raw) - at} bytes past the header")
            hdr = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
            # the three arrays were int64 / uint64 on the wire: exact ints in range, so
            # check() (here and on import) skips their per-element type scan
            object.__setattr__(hdr, "_typed_arrays", True)
            if "tokens" in arrays:
                toks = arrays["tokens"].astype(np.int64, copy=False)
                toks.setflags(write=False)
                object.__setattr__(hdr, "_token_array", toks)
        except (ValueError, TypeError, KeyError, UnicodeDecodeError, AttributeError,
                struct.error) as err:
            raise CorruptTransferError(f"page header: unreadable ({err})") from None
        return hdr.check(deferred, content)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class PageExport:
    """An export: its header, its data and the lease to end once it is sent.

    ``data`` is ``[n_carried, *header.page_shape]``: a view of the cache when the pages are
    consecutive, else gathered on first access. A transport that can send page runs reads
    ``page_runs(...)`` instead: views of the cache only (zero copy), valid while the lease
    holds. ``pages`` are the cache pages carried (``None`` when the cache splits the heads
    over several devices or only some heads are carried: then only ``data`` exists).

    The checksums are computed when first needed: ``header`` computes them all;
    ``wire_header`` is the header without them (until computed) and :meth:`row_checksums`
    computes those of a run of rows (a transport computes them while the peer gets ready, or
    while the run is on the wire).
    """

    def __init__(self, header: PageHeader, lease_id: int, pages, blocks, gather, sums=None,
                 alive=None):
        self.lease_id, self.pages, self._alive = lease_id, pages, alive
        self._blocks, self._gather, self._data = blocks, gather, None
        self._wire = header._replace_checksums(None) if sums is not None else header
        self._full = None if sums is not None else header
        self._sums, self._known = sums, {}

    @property
    def header(self) -> PageHeader:
        if self._full is None:
            for row, run in self.page_runs(0):
                self.row_checksums(row, run)
            self._full = self._wire.with_checksums(
                self._known[r] for r in range(self._wire.n_carried))
        return self._full

    @property
    def wire_header(self) -> PageHeader:
        """The header as far as it is known: without the checksums until they are computed."""
        return self._full if self._full is not None else self._wire

    @property
    def data(self):
        if self._data is None:
            self._data = self._gather()
        return self._data

    def row_checksums(self, row: int, run) -> list[int]:
        """Checksums of rows ``[row, row + len(run))``; ``run`` is their data (a view from
        :meth:`page_runs`)."""
        n = run.shape[0]
        if self._full is not None:
            return list(self._full.checksums[row:row + n])
        if any(row + i not in self._known for i in range(n)):
            sums = self._sums(run)
            if self._alive is not None and not self._alive():
                raise TransferError(f"export: lease {self.lease_id} ended before the "
                                    "checksums were computed (its pages may be reused)")
            for i, s in enumerate(sums):
                self._known[row + i] = s
        return [self._known[row + i] for i in range(n)]

    def page_runs(self, first_row: int, cuts=()):
        """Views ``[(row, tensor [n, *page_shape])]`` covering rows ``[first_row,
        n_carried)``: each a run of consecutive cache pages, also cut at the given rows. They
        are torch views of the cache (``__dlpack__`` hands them zero-copy to a transport that
        is not torch's, e.g. NIXL's memory registration)."""
        if self.pages is None:
            return [(first_row, self.data[first_row:])]
        pages, out = self.pages, []
        cuts, r = set(cuts), first_row
        while r < len(pages):
            e = r + 1
            while e < len(pages) and pages[e] == pages[e - 1] + 1 and e not in cuts:
                e += 1
            out.append((r, self._blocks[pages[r]:pages[r] + e - r]))
            r = e
        return out


def check_export(export) -> None:
    """Raise :class:`~kvtvm.errors.InvalidArgumentError` naming ``export`` unless it is a
    :class:`PageExport` (what a transport's ``send`` takes)."""
    if not isinstance(export, PageExport):
        raise InvalidArgumentError(describe("export", "a PageExport (from export_pages)",
                                            type(export).__name__))
