"""Page export/import and leases of the paged manager: the manager's side of KV transfer.

A transfer moves whole pages between two caches (another process, another machine, a lower
tier). The manager owns the bytes, so it exposes them as torch tensors; moving them is the
caller's business (:mod:`kvtvm.transfer` over ``torch.distributed``). Two planes:

- metadata: a :class:`PageHeader` (format version, dtype, storage, layout, page size, KV
  heads and the head range carried, head_dim, layers, every token the pages cover, the
  chained block hashes of the full pages, a checksum of the tokens and one per carried
  page), sent as JSON;
- data: one tensor ``[n_pages, 2, num_layers, page_size, heads, head_dim]`` -- a view of the
  cache when the pages are consecutive on one device (no copy), else one gather.

Leases. A page being exported or imported is *leased*: it cannot be freed, evicted or
rewritten (a write into it copies it first) until the lease ends -- by release, abort,
timeout (:meth:`PageIOMixin.expire_leases`) or a failed import -- and it ends exactly once
(ending it again returns False and changes nothing). Releasing the exporting sequence while
its transfer still reads the pages leaves them leased; they are freed (or stay cached) when
the lease ends. Every page is exactly one of free, used (held by a sequence, not leased),
cached (on the LRU list) or leased: ``free + used + cached + leased == total``.

Import checks every header field against the receiving cache (:class:`FormatMismatchError`
naming the field and both values), the data's shape (:class:`CorruptTransferError`:
truncated), every checksum -- of the pages and of the tokens -- and the block hashes against
the tokens (:class:`CorruptTransferError`) before it writes anything, then registers the full
pages in the prefix cache under their *tokens* (so a later claim + fetch of the same tokens
hits them: content-verified, a hash collision can only cause a miss) and optionally
hands every page to a claimed, empty sequence, which then continues at the exported length.
A receiver that splits the KV heads over a different number of devices takes its heads from
the header's head range (resharding).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import (CorruptTransferError, DeviceMismatchError, FormatMismatchError,
                      InvalidArgumentError, KVCacheCapacityError, SequenceStateError,
                      TransferError, describe)
from .args import check_hashes, check_int, check_seconds
from .checksums import DEVICE, KNOWN, algorithm_for, page_checksums
from .hashing import HASH_SEED, chain_hash
from .hashing import block_hashes as _block_hashes
from .pagelayout import PageLayoutMixin
from .pageformat import FORMAT_VERSION, LAYOUT, STORAGE, PageExport, PageHeader, tokens_checksum
from .prefixhashes import PrefixHashMixin

#: Lease ids are unique in the process, not per manager: an id handed to another manager's
#: ``end_lease`` / ``finish_import`` / ``import_runs`` is never one of its open leases (with
#: per-manager counters, ending export 0 of one manager ended lease 0 of another).
_LEASE_IDS = itertools.count()

__all__ = ["FORMAT_VERSION", "PageHeader", "PageExport", "PageIOMixin"]


@dataclass
class _Lease:
    kind: str                  # "export" or "import"
    pages: list
    deadline: float | None
    header: PageHeader | None = None
    seq_id: int | None = None
    held: int = 0              # import: leading pages already cached here
    first_row: int = 0         # import: first row of the header's data that is written
    held_kids: list = field(default_factory=list)


class PageIOMixin(PrefixHashMixin, PageLayoutMixin):
    """Export, import and leases for :class:`~kvtvm.manager.PagedKVCacheManager`."""

    @property
    def checksum_algorithm(self) -> str:
        """The page checksum this cache writes into its headers (:mod:`.checksums`):
        ``poly16-m31x2``, computed on the device, for a CUDA cache, else ``xxh3_64``.
        Assignable (to either name), e.g. to run the device algorithm on a CPU cache."""
        alg = getattr(self, "_checksum_alg", None)
        return alg if alg is not None else algorithm_for(self._blocks[0].device)

    @checksum_algorithm.setter
    def checksum_algorithm(self, name: str) -> None:
        if name not in KNOWN:
            raise InvalidArgumentError(describe("checksum_algorithm", f"one of {KNOWN}", name))
        self._checksum_alg = name

    def storage_name(self) -> str:
        """The ``storage`` field of this cache's page headers."""
        p = self.params
        if not p.quantized:
            return STORAGE
        return f"quant:{p.storage_key(self.num_layers)}:scale=f32-per-row:align=16"

    def _init_pageio(self) -> None:
        self._leased = np.zeros(self.num_pages, dtype=np.int32)
        self._leases: dict[int, _Lease] = {}
        self._init_prefix_hashes()

    # -- leases -------------------------------------------------------------------------------
    def _lease_pages(self, pages) -> None:
        leased, rc, lru = self._leased, self._refcount, self._prefix.lru
        for p in pages:
            if leased[p] == 0 and rc[p] == 0:
                lru.pop(p, None)
            leased[p] += 1

    def _unlease_pages(self, pages) -> None:
        leased, rc, cached = self._leased, self._refcount, self._prefix.page_key
        for p in reversed(pages):
            leased[p] -= 1
            if leased[p] == 0 and rc[p] == 0:
                if p in cached:
                    self._prefix.lru[p] = None
                else:
                    self._free.append(p)

    def _new_lease(self, lease: _Lease) -> int:
        self._lease_pages(lease.pages)
        lid = next(_LEASE_IDS)
        self._leases[lid] = lease
        return lid

    def end_lease(self, lease_id: int) -> bool:
        """End a lease (a finished send, an abort, a preemption): its pages can be freed,
        evicted and written again. True the first time, False if it already ended (a
        duplicate completion), so each lease ends exactly once. An import lease that ends
        before :meth:`finish_import` drops its fresh pages (nothing was registered)."""
        check_int("lease_id", lease_id)
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            self._unlease_pages(lease.pages)
            return True

    def expire_leases(self, now: float | None = None) -> list[int]:
        """End every lease whose deadline (``time.monotonic()`` seconds) has passed; returns
        their ids (a dead peer's transfers)."""
        now = time.monotonic() if now is None else check_seconds("now", now, False, True)
        with self._lock:
            late = [lid for lid, ls in self._leases.items()
                    if ls.deadline is not None and ls.deadline <= now]
            for lid in late:
                self.end_lease(lid)
            return late

    def active_leases(self) -> dict[int, str]:
        """``{lease_id: "export" | "import"}`` of the leases not yet ended."""
        with self._lock:
            return {lid: ls.kind for lid, ls in self._leases.items()}

    # -- export -------------------------------------------------------------------------------
    def _header(self, tokens, first_page, heads) -> PageHeader:
        """The header of an export, its checksums left to :class:`PageExport`."""
        P = self.page_size
        toks = np.asarray(tokens, dtype=np.int64)
        hashes = _block_hashes(toks, P, self.hash_bits, self._root_chain()[0])
        hdr = PageHeader(
            version=FORMAT_VERSION, dtype=self.params.dtype, storage=self.storage_name(),
            layout=LAYOUT, page_bytes=self.params.bytes_per_page(self.num_layers),
            page_size=P, n_kv_heads=self.params.n_kv_heads, head_range=tuple(heads),
            head_dim=self.params.head_dim, num_layers=self.num_layers,
            tokens=tuple(toks.tolist()), first_page=int(first_page),
            block_hashes=tuple(hashes), hash_bits=self.hash_bits,
            checksum=self.checksum_algorithm, checksums=None,
            tokens_checksum=tokens_checksum(toks))
        toks.setflags(write=False)
        object.__setattr__(hdr, "_token_array", toks)  # what token_array() would make
        return hdr

    def export_pages(self, seq_id: int | None = None, *, block_hashes=None, first_page: int = 0,
                     heads=None, timeout: float | None = None,
                     defer_checksums: bool = False) -> PageExport:
        """Lease and describe the pages of a sequence or of cached block hashes.

        Parameters
        ----------
        seq_id : int, optional
            A claimed sequence with no fetch in flight: its pages up to its length (the
            partial last page included). Needs prefix caching (the tokens are recorded).
        block_hashes : sequence of int, optional
            Instead of ``seq_id``: a chain of cached full pages, from page 0.
        first_page : int
            Carry pages ``[first_page, n_pages)`` only (the peer holds the others).
        heads : (int, int), optional
            Head range to carry (default: all; an 8-bit cache carries all heads only).
        timeout : float, optional
            Seconds after which :meth:`expire_leases` ends the lease.
        defer_checksums : bool
            Leave the page checksums to the sender (``export.row_checksums`` while the pages
            are on the wire, or the first read of ``export.header``); computing them once the
            lease has ended raises :class:`TransferError` (the pages may have been reused).
            Default: computed now.

        Returns
        -------
        PageExport
            ``data`` is ``[n_carried, 2, num_layers, page_size, heads, head_dim]`` (uint8
            ``[n_carried, page_bytes]`` for an 8-bit cache); end the lease with
            :meth:`end_lease` once it has been sent.

        Raises
        ------
        UnknownSequenceError, SequenceStateError
            ``seq_id`` is unknown, released or has a fetch in flight.
        InvalidArgumentError
            Neither or both of ``seq_id`` / ``block_hashes``; a hash not cached; a bad range.
        """
        with self._lock:
            if (seq_id is None) == (block_hashes is None):
                raise InvalidArgumentError(describe("export_pages", "seq_id or block_hashes",
                                                    "both" if seq_id is not None else "neither"))
            if not self.prefix_caching:
                raise InvalidArgumentError(describe(
                    "export_pages: params.enable_prefix_caching", "True (the tokens of the "
                    "pages are recorded only then)", False))
            heads = self._check_heads(heads)
            timeout = check_seconds("timeout", timeout)
            if block_hashes is not None:
                block_hashes = check_hashes("block_hashes", block_hashes)
            P = self.page_size
            if seq_id is not None:
                sid = self._check_settled(seq_id, "export_pages")
                L = int(self._lengths[sid])
                tokens = self._tokens[sid, :L].copy()
                all_pages = self._page_table[sid, :-(-L // P)].tolist()
            else:
                sid = None
                index = self._hash_index()
                parent, all_pages, chunks = self._prefix.root, [], []
                for i, h in enumerate(block_hashes):
                    hit = self._child_by_hash(index, parent, int(h))
                    if hit is None:
                        raise InvalidArgumentError(describe(
                            f"export_pages: block_hashes[{i}]", "a cached page chained to the "
                            "previous hash", f"{int(h):#x} (not cached)"))
                    parent = hit[0]
                    all_pages.append(hit[1])
                    chunks.append(hit[2])
                tokens = np.frombuffer(b"".join(chunks), dtype=np.int64)
            n = len(all_pages)
            if not isinstance(first_page, (int, np.integer)) or isinstance(first_page, bool) \
                    or not 0 <= first_page <= n:
                raise InvalidArgumentError(describe("first_page", f"an int in [0, {n}]",
                                                    repr(first_page)))
            pages = all_pages[first_page:]
            direct = self.n_devices == 1 and heads == (0, self.params.n_kv_heads)
            blocks = self._blocks[0]
            if direct:  # views of the cache pages: nothing is copied
                gather = lambda: self._gather(pages, heads)  # noqa: E731
            else:
                data = self._gather(pages, heads)
                gather = lambda: data  # noqa: E731
            header = self._header(tokens, first_page, heads)
            alg = header.checksum
            deadline = None if timeout is None else time.monotonic() + float(timeout)
            lid = self._new_lease(_Lease("export", pages, deadline))
            if sid is not None:
                self._tail_check[sid] = True  # a write into a leased page copies it first
            ex = PageExport(header, lid, pages if direct else None, blocks, gather,
                            sums=lambda run: page_checksums(run, alg),
                            alive=lambda: lid in self._leases)
            if not defer_checksums:
                ex.header  # noqa: B018 - computed now, under the lease
            return ex

    # -- import -------------------------------------------------------------------------------
    def _check_header(self, hdr: PageHeader) -> None:
        hdr.check(deferred=True)  # types and lengths first: a header built in Python, too
        p = self.params
        want = {"version": FORMAT_VERSION, "dtype": p.dtype, "storage": self.storage_name(),
                "layout": LAYOUT, "page_size": self.page_size, "n_kv_heads": p.n_kv_heads,
                "head_dim": p.head_dim, "num_layers": self.num_layers}
        for name, value in want.items():
            got = getattr(hdr, name)
            if got != value:
                raise FormatMismatchError(f"page header field {name}: this cache has "
                                          f"{value!r}, the peer sent {got!r}")
        if hdr.checksum not in KNOWN:
            raise FormatMismatchError(f"page header field checksum: this cache verifies one of "
                                      f"{KNOWN!r}, the peer sent {hdr.checksum!r}")
        if hdr.page_bytes != p.bytes_per_page(self.num_layers):
            raise FormatMismatchError(
                f"page header field page_bytes: this cache has "
                f"{p.bytes_per_page(self.num_layers)}, the peer sent {hdr.page_bytes}")
        if tuple(hdr.head_range) != (0, p.n_kv_heads):
            raise FormatMismatchError(
                f"page header field head_range: this cache holds heads (0, {p.n_kv_heads}), "
                f"the peer sent {tuple(hdr.head_range)!r}")
        if len(hdr.tokens) > self.max_seq_len or not hdr.tokens:
            raise InvalidArgumentError(describe("header.tokens",
                                                f"1 to max_seq_len={self.max_seq_len} tokens",
                                                len(hdr.tokens)))
        # the pages are registered under the tokens: their block hashes must agree (the
        # tokens' checksum, checked above, covers damage; this, a header built inconsistently)
        root = chain_hash(HASH_SEED, p.storage_key(self.num_layers).encode(), hdr.hash_bits)
        want = _block_hashes(hdr.token_array(), self.page_size, hdr.hash_bits, root)
        if list(hdr.block_hashes) != want:
            i = next(i for i, (a, b) in enumerate(zip(hdr.block_hashes, want)) if a != b)
            raise CorruptTransferError(
                f"page header field block_hashes: [{i}] is {hdr.block_hashes[i]:#x}, the "
                f"chained hash of its tokens under this cache's storage format is {want[i]:#x}")

    def _import_room(self, header: PageHeader, held: list, skip: int | None = None) -> int:
        """New pages an import takes beside ``held`` (KVCacheCapacityError if not that many
        are free or evictable); ``skip``: the leading pages not to count (default: those held,
        or up to ``header.first_page``)."""
        n_new = header.n_pages - (max(len(held), header.first_page) if skip is None else skip)
        available = self._available_pages() - sum(1 for p in held if p in self._prefix.lru)
        if n_new > available:
            raise KVCacheCapacityError(f"import: needs {n_new} new pages, {available} are "
                                       f"free or evictable (pool of {self.num_pages})")
        return n_new

    def begin_import(self, header: PageHeader, seq_id: int | None = None,
                     timeout: float | None = None) -> tuple[int, int]:
        """Check ``header`` and lease the pages the import will fill.

        Pages this cache already holds (same tokens, device pool or a lower tier) are reused
        and skipped; only the others are allocated. Returns ``(lease_id, first_row)``: rows
        ``[first_row, header.n_carried)`` of the data are written by :meth:`finish_import`.

        Raises
        ------
        FormatMismatchError
            A header field differs from this cache (named, with both values).
        TransferError
            This cache lacks pages before ``header.first_page`` (the peer must resend them).
        KVCacheCapacityError
            Not enough free or evictable pages (nothing changed).
        UnknownSequenceError, SequenceStateError
            ``seq_id`` is not a claimed, empty sequence.
        InvalidArgumentError
            ``header`` is not a PageHeader, or prefix caching is off.
        """
        with self._lock:
            if not isinstance(header, PageHeader):
                raise InvalidArgumentError(describe("header", "a PageHeader",
                                                    type(header).__name__))
            self._check_header(header)
            timeout = check_seconds("timeout", timeout)
            if not self.prefix_caching:
                raise InvalidArgumentError(describe(
                    "import: params.enable_prefix_caching", "True", False))
            sid = None
            if seq_id is not None:
                sid = self._check_settled(seq_id, "import")
                if self._lengths[sid] or self._npages[sid]:
                    raise SequenceStateError(f"import: seq_id {sid} already holds tokens")
            P = self.page_size
            toks = header.token_array()
            chunks = [toks[i * P:(i + 1) * P].tobytes() for i in range(toks.size // P)]
            if getattr(self, "_tiers", None) is not None:  # nothing promoted unless the
                # import can go through: every page not on the device is promoted or taken,
                # and the tiers' content-checked hits cover what the peer did not send
                on_device = self._prefix.lookup(chunks)[0]
                self._import_room(header, on_device, skip=len(on_device))
                hits = self._tier_hits(chunks, touch=False)
                _check_sent_from(header, len(hits[0]) + len(hits[2]))
                self._promote(chunks, hits=hits)
            held, kids = self._prefix.lookup(chunks)
            k = len(held)
            _check_sent_from(header, k)
            start = max(k, header.first_page)
            n_new = self._import_room(header, held)
            self._lease_pages(held)  # pinned before taking: _take must not evict them
            try:  # ascending: consecutive pages make runs a transport receives in place
                new = sorted(self._take(n_new))
            except BaseException:
                self._unlease_pages(held)
                raise
            self._unlease_pages(held)
            deadline = None if timeout is None else time.monotonic() + float(timeout)
            lid = self._new_lease(_Lease("import", list(held) + new, deadline, header, sid,
                                         held=k, held_kids=list(kids),
                                         first_row=start - header.first_page))
            return lid, start - header.first_page

    def import_runs(self, lease_id: int):
        """Where the data of an open import lease can be received in place: ``[(row, view
        [n, *page_shape])]``, runs of consecutive fresh pages covering rows ``[0, n_new)`` of
        what :meth:`finish_import` expects; None when the cache splits heads over devices
        (receive into a buffer then). After receiving into them, call
        ``finish_import(lease_id, None)``: it verifies the checksums and copies nothing; on a
        bad checksum the pages are only ever freed, never registered or handed out.

        The views stay writable after the lease ends: a transport that receives into them must
        not let :meth:`expire_leases` end the lease while a write may still land (its pages
        would be freed, handed out and then overwritten). Begin such an import with
        ``timeout=None`` and end it yourself (``finish_import`` or :meth:`end_lease`) once no
        write can come, as :class:`~kvtvm.transfer.DistributedTransport` does."""
        check_int("import_runs: lease_id", lease_id)
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.kind != "import":
                raise SequenceStateError(f"import_runs: lease {lease_id} is not an open "
                                         "import lease")
            if self.n_devices != 1:
                return None
            new, out, r = lease.pages[lease.held:], [], 0
            while r < len(new):
                e = r + 1
                while e < len(new) and new[e] == new[e - 1] + 1:
                    e += 1
                out.append((r, self._blocks[0][new[r]:new[r] + e - r]))
                r = e
            return out

    def finish_import(self, lease_id: int, data, verified: bool = False,
                      checksums=None) -> int:
        """Verify ``data`` (rows ``[first_row, n_carried)`` of the header's pages: shape
        ``[n_carried - first_row, *header.page_shape]``, ``first_row`` from
        :meth:`begin_import`; None when it was received in place, see :meth:`import_runs`)
        and write and register the pages of an import lease; the lease ends either way.
        Returns the pages written. ``verified=True``: the caller (a transport, as the pages
        arrived) already compared every page with its checksum in the header. ``checksums``:
        those of every carried page, when :meth:`begin_import` got a header without them (a
        transport sends them after the data).

        Raises
        ------
        SequenceStateError
            The lease is not an open import lease (ended, aborted, expired), or its sequence
            took tokens since :meth:`begin_import` (nothing is written).
        CorruptTransferError
            Wrong shape or dtype (truncated) or a checksum differs: nothing is written.
        """
        import torch

        check_int("finish_import: lease_id", lease_id)
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.kind != "import":
                raise SequenceStateError(f"finish_import: lease {lease_id} is not an open "
                                         "import lease (ended, aborted or expired)")
            try:
                if checksums is not None and lease.header.checksums is None:
                    lease.header = lease.header.with_checksums(checksums)
                hdr, sid = lease.header, lease.seq_id
                if sid is not None and (self._lengths[sid] or self._npages[sid]
                                        or self._pending[sid] >= 0):
                    raise SequenceStateError(f"finish_import: seq_id {sid} took tokens since "
                                             "begin_import (it must stay empty until then)")
                if hdr.checksums is None and not verified:
                    raise CorruptTransferError("finish_import: the header carries no checksums")
                r0 = lease.first_row
                want = (hdr.n_carried - r0, *hdr.page_shape)
                in_place = data is None and self.n_devices == 1  # see import_runs
                rows = data if not in_place else None if verified \
                    else [self._blocks[0][p] for p in lease.pages[lease.held:]]
                if not in_place and (not isinstance(data, torch.Tensor)
                                     or tuple(data.shape) != want
                                     or str(data.dtype).removeprefix("torch.")
                                     != hdr.tensor_dtype):
                    got = (tuple(data.shape), data.dtype) if isinstance(data, torch.Tensor) \
                        else type(data).__name__
                    raise CorruptTransferError(describe("import data",
                                                        f"{want} {hdr.tensor_dtype}",
                                                        got))
                if not in_place:
                    data = self._checked_rows(hdr, data, r0, verified)
                elif not verified:
                    self._checked_rows(hdr, rows, r0)
            except BaseException:
                self.end_lease(lease_id)
                raise
            self._write_import(lease, data)
            self.end_lease(lease_id)
            return len(lease.pages) - lease.held  # the pages it did not find cached

    def _checked_rows(self, hdr: PageHeader, rows, r0: int, verified: bool = False):
        """``rows`` (rows ``[r0, n_carried)`` of ``hdr``'s pages), on the device when the
        header's checksum is the device one and the cache is on CUDA (checked where the pages
        go); CorruptTransferError naming the first page whose checksum differs."""
        dev = self._blocks[0].device
        if not isinstance(rows, list):  # (a list: rows received in place, the cache's pages)
            # data no checksum can read (a meta tensor) was torch's untyped error
            if rows.device.type != "cpu" and rows.device not in {b.device for b in self._blocks}:
                raise DeviceMismatchError(describe(
                    "import data", f"a tensor on cpu or the cache's device ({dev})", rows.device))
            if hdr.checksum == DEVICE and dev.type == "cuda":
                rows = rows.to(dev)
        if not verified:
            for i, s in enumerate(page_checksums(rows, hdr.checksum)):
                if s != hdr.checksums[r0 + i]:
                    raise CorruptTransferError(
                        f"import data: page {hdr.first_page + r0 + i} fails its "
                        f"{hdr.checksum} checksum (sent {hdr.checksums[r0 + i]:#x})")
        return rows

    def _write_import(self, lease: _Lease, data) -> None:
        import torch

        hdr, P = lease.header, self.page_size
        k = lease.held
        new_pages = lease.pages[k:]
        start = hdr.n_pages - len(new_pages)
        if new_pages and data is not None:  # else: received in place
            self._scatter(new_pages, data)
        toks = hdr.token_array()
        kids = list(lease.held_kids)
        parent = kids[-1] if kids else self._prefix.root
        for i in range(start, toks.size // P):
            parent = self._prefix.insert(parent, toks[i * P:(i + 1) * P].tobytes(),
                                         lease.pages[i])
            kids.append(parent)
        if lease.seq_id is not None and self.contains(lease.seq_id):
            sid, pages = lease.seq_id, lease.pages
            self._invalidate_lookup()
            rc = self._refcount
            for p in pages:
                rc[p] += 1
                if rc[p] == 2:
                    self._n_shared += 1
            self._page_table[sid, :len(pages)] = pages
            self._npages[sid] = len(pages)
            self._lengths[sid] = toks.size
            self._tokens[sid, :toks.size] = toks
            self._keys[sid] = kids
            self._tail_check[sid] = True

    def import_pages(self, header: PageHeader, data, seq_id: int | None = None) -> int:
        """Import exported pages in one call: :meth:`begin_import` then :meth:`finish_import`.

        Every checksum is verified before a page is taken, so a refused import changes nothing.

        Parameters
        ----------
        header : PageHeader
            The exporter's header (``export.header``), with its ``checksums``.
        data : torch.Tensor
            Every carried page, ``[header.n_carried, *header.page_shape]`` (``[n, 2,
            num_layers, page_size, heads, head_dim]``, or uint8 ``[n, page_bytes]`` for an
            8-bit cache), in the dtype of this cache's tensor.
        seq_id : int, optional
            A claimed, empty sequence: it takes every page and its length becomes
            ``len(header.tokens)`` (it continues where the exporter stopped).

        Returns
        -------
        int
            The pages written (pages this cache already held are reused, not written).

        Raises
        ------
        CorruptTransferError
            No checksums, wrong shape or dtype, or a checksum differs.
        FormatMismatchError, TransferError, KVCacheCapacityError
            As for :meth:`begin_import`.
        UnknownSequenceError, SequenceStateError, InvalidArgumentError
            As for :meth:`begin_import`.
        """
        import torch

        with self._lock:
            if not isinstance(header, PageHeader):
                raise InvalidArgumentError(describe("header", "a PageHeader",
                                                    type(header).__name__))
            self._check_header(header)
            if header.checksums is None:  # checked before a lease is taken: nothing changes
                raise CorruptTransferError("import: page header field checksums: expected one "
                                           "per carried page, got None")
            want = (header.n_carried, *header.page_shape)
            if not isinstance(data, torch.Tensor) or tuple(data.shape) != want:
                raise CorruptTransferError(describe(
                    "import data", want, tuple(getattr(data, "shape", ())) or type(data)))
            if data.dtype != self._blocks[0].dtype:
                raise CorruptTransferError(describe("import data dtype", self._blocks[0].dtype,
                                                    data.dtype))
            # every checksum before a page is taken: a refused import evicts no cached page
            data = self._checked_rows(header, data, 0)
            lid, first_row = self.begin_import(header, seq_id)
            return self.finish_import(lid, data[first_row:], verified=True)


def _check_sent_from(header: PageHeader, held: int) -> None:
    """TransferError unless the cache holds (or its tiers can bring back) the ``held`` >=
    ``header.first_page`` leading pages the peer did not send."""
    if held < header.first_page:
        raise TransferError(f"import: this cache holds {held} leading pages of the sequence, "
                            f"the peer sent from page {header.first_page}; resend from page "
                            f"{held}")
