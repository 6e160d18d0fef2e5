"""KV transfer between caches: the :class:`PageTransport` interface and its implementations.

The managers export and import pages (:mod:`kvtvm.manager.pageio`); a transport moves them. It
sits above the managers and uses an existing engine -- ``torch.distributed`` point-to-point
ops (gloo on CPU, NCCL on GPU) -- not a transport of its own. Any other engine (NIXL, Mooncake)
would implement the same four calls:

- :meth:`PageTransport.register` -- the cache this endpoint serves;
- :meth:`PageTransport.lookup` -- how many leading pages of a chain of block hashes the peer
  holds (metadata plane, asked before sending, so a shared system prompt is not resent);
- :meth:`PageTransport.send` / :meth:`PageTransport.handle` -- send an export / receive and
  import one message on the peer (data plane);
- :meth:`Transfer.poll` / :meth:`Transfer.wait` -- completion; the exporter's lease ends
  exactly once when the peer acknowledged (or the transfer failed).

Wire protocol of :class:`DistributedTransport` (every frame an int64 tensor):

    lookup:  A->B [LOOKUP, n, 0] + int64 [n] hashes;           B->A [count]
    pages:   A->B [PAGES, len, tag] + uint8 [len] JSON header;  B->A [status, first_row]
             A->B data rows [first_row:] (one contiguous tensor: a view of the cache when
             the pages are consecutive);                         B->A [status, pages written]

``status`` 0 is success, 1 "resend from page ``first_row``" (the peer lacks the prefix the
sender thought it held -- e.g. a hash collision in the lookup), 2 a refused import
(format, capacity, corruption; the sender gets :class:`~kvtvm.errors.TransferError`). Every
wait polls with a deadline: a dead or silent peer is a
:class:`~kvtvm.errors.TransferTimeoutError` and the leases are ended, no page is leaked.
"""

from __future__ import annotations

import abc
import datetime
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from .errors import (CorruptTransferError, FormatMismatchError, InvalidArgumentError,
                     KVCacheCapacityError, TransferError, TransferTimeoutError, describe)
from .manager.pageio import PageExport, PageHeader

__all__ = ["PageTransport", "Transfer", "Received", "DistributedTransport",
           "InProcessTransport", "send_sequence"]

log = logging.getLogger(__name__)

LOOKUP, PAGES, CLOSE = 1, 2, 3
OK, RESEND, REFUSED = 0, 1, 2


@dataclass
class Transfer:
    """A send in flight: ``poll()`` is True once done; ``wait()`` returns the pages the peer
    wrote or raises the transfer's error."""

    export: PageExport
    manager: object = None          # the exporter: its lease ends when the transfer does
    _step: object = None            # callable advancing the protocol, True when finished
    done: bool = False
    pages_written: int = 0
    error: BaseException | None = None

    def poll(self) -> bool:
        if not self.done and self._step is not None:
            try:
                self.done = bool(self._step())
            except BaseException as err:  # noqa: BLE001 - kept and re-raised by wait()
                self.error, self.done = err, True
        if self.done and self.manager is not None:
            self.manager.end_lease(self.export.lease_id)  # exactly once: later calls no-op
        return self.done

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.poll():
            if deadline is not None and time.monotonic() > deadline:
                raise TransferTimeoutError(f"transfer: not done after {timeout} s")
            time.sleep(0)
        if self.error is not None:
            raise self.error
        return self.pages_written


@dataclass
class Received:
    """What :meth:`PageTransport.handle` processed: a lookup or an import."""

    kind: str                      # "lookup", "pages" or "close"
    tag: int = 0
    header: PageHeader | None = None
    seq_id: int | None = None
    pages_written: int = 0
    lookup_count: int = 0
    error: BaseException | None = field(default=None, repr=False)


class PageTransport(abc.ABC):
    """Moves exported pages to a peer's cache (see the module docstring)."""

    manager = None

    def register(self, manager) -> None:
        """The paged manager (prefix caching on) this endpoint exports from / imports into."""
        if not hasattr(manager, "export_pages") or not getattr(manager, "prefix_caching", 0):
            raise InvalidArgumentError(describe("manager", "a PagedKVCacheManager with prefix "
                                                "caching", type(manager).__name__))
        self.manager = manager

    @abc.abstractmethod
    def lookup(self, peer: int, block_hashes) -> int:
        """Leading pages of ``block_hashes`` the peer's cache holds."""

    @abc.abstractmethod
    def send(self, peer: int, export: PageExport, tag: int = 0) -> Transfer:
        """Start sending ``export``; the returned transfer ends its lease when done."""

    @abc.abstractmethod
    def handle(self, peer: int, seq_for=None, timeout: float | None = None) -> Received:
        """Process one incoming message from ``peer``: answer a lookup, or import pages.
        ``seq_for(header, tag)`` may return a claimed empty ``seq_id`` to import into."""

    def _need(self):
        if self.manager is None:
            raise TransferError("transport: register() a cache first")
        return self.manager


def _import_status(err: BaseException) -> int:
    return RESEND if type(err) is TransferError else REFUSED


def send_sequence(transport: PageTransport, peer: int, seq_id: int, tag: int = 0,
                  timeout: float | None = 60.0) -> int:
    """Send the pages of ``seq_id`` that the peer lacks (lookup by hashes first), wait for
    the acknowledgement; returns the pages the peer wrote. The export lease ends exactly once,
    whatever happens."""
    mgr = transport._need()
    have = transport.lookup(peer, mgr.block_hashes_of(seq_id))
    for first in (have, 0):
        export = mgr.export_pages(seq_id, first_page=first, timeout=timeout)
        transfer = transport.send(peer, export, tag)
        try:
            return transfer.wait(timeout)
        except TransferError as err:
            if not getattr(err, "resend", False) or first == 0:
                raise
        finally:
            mgr.end_lease(export.lease_id)
    raise AssertionError("unreachable")


class DistributedTransport(PageTransport):
    """:class:`PageTransport` over ``torch.distributed`` point-to-point ops.

    Parameters
    ----------
    group : optional
        Process group (default: the world). gloo moves CPU tensors, NCCL CUDA tensors.
    timeout : float
        Seconds any single wait for the peer may take.
    """

    def __init__(self, group=None, timeout: float = 60.0):
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            raise TransferError("DistributedTransport: torch.distributed is not initialized")
        self.dist, self.group, self.timeout = dist, group, float(timeout)
        self._pool = None
        backend = dist.get_backend(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if backend == "nccl" else torch.device("cpu")

    # -- low level ------------------------------------------------------------------------------
    def _waiter(self):
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtvm-transfer")
        return self._pool

    def _wait(self, work, what: str, timeout: float | None = None) -> None:
        # gloo's receive work never reports is_completed() before wait(): wait with a timeout
        seconds = self.timeout if timeout is None else timeout
        try:
            work.wait(timeout=datetime.timedelta(seconds=seconds))
        except RuntimeError as err:  # DistBackendError derives from it
            raise TransferTimeoutError(f"transport: peer silent or gone for {seconds} s ({what}): "
                                       f"{str(err).splitlines()[0][:200]}") from None

    def _send(self, t, peer, what: str = "send"):
        # a send waits for the peer's matching receive: bounded by the timeout too
        self._wait(self.dist.isend(t.to(self.device), peer, group=self.group), what)

    def _recv(self, shape, dtype, peer, what, timeout=None):
        import torch

        buf = torch.empty(shape, dtype=dtype, device=self.device)
        self._wait(self.dist.irecv(buf, peer, group=self.group), what, timeout)
        return buf

    def _ints(self, values):
        import torch

        return torch.tensor(list(values), dtype=torch.int64)

    # -- interface ------------------------------------------------------------------------------
    def lookup(self, peer: int, block_hashes) -> int:
        import torch

        hashes = [int(h) - (1 << 64) if int(h) >= 1 << 63 else int(h) for h in block_hashes]
        self._send(self._ints([LOOKUP, len(hashes), 0]), peer)
        if hashes:
            self._send(self._ints(hashes), peer)
        return int(self._recv((1,), torch.int64, peer, "lookup answer")[0])

    def send(self, peer: int, export: PageExport, tag: int = 0) -> Transfer:
        import torch

        self._need()
        raw = export.header.to_bytes()
        self._send(self._ints([PAGES, len(raw), tag]), peer)
        self._send(torch.frombuffer(bytearray(raw), dtype=torch.uint8), peer)
        transfer = Transfer(export, self.manager)
        status, first_row = self._recv((2,), torch.int64, peer, "import plan").tolist()
        if status != OK:
            err = TransferError(f"transport: the peer refused the pages ({_CODES[status]}); "
                                f"it holds {first_row} leading pages")
            err.resend = status == RESEND
            transfer.error, transfer.done = err, True
            return transfer
        data = export.data[first_row:]
        if data.shape[0]:
            if not data.is_contiguous():
                data = data.contiguous()
            self._send(data, peer)
        ack = torch.empty(2, dtype=torch.int64, device=self.device)
        work = self.dist.irecv(ack, peer, group=self.group)
        # the acknowledgement is awaited on a helper thread, so poll() never blocks
        pending = self._waiter().submit(self._wait, work, f"acknowledgement from rank {peer}")

        def step():
            if not pending.done():
                return False
            pending.result()  # raises the timeout
            st, n = ack.tolist()
            if st != OK:
                raise TransferError(f"transport: the peer could not import ({_CODES[st]})")
            transfer.pages_written = n
            return True

        transfer._step = step
        return transfer

    def send_ints(self, peer: int, values) -> None:
        """Send a few int64 values (an application's own control message, e.g. the first
        generated token); the peer takes them with :meth:`recv_ints`."""
        self._send(self._ints(values), peer, "control message")

    def recv_ints(self, peer: int, n: int) -> list[int]:
        """Receive ``n`` int64 values sent with :meth:`send_ints`."""
        import torch

        return self._recv((n,), torch.int64, peer, "control message").tolist()

    def close(self, peer: int) -> None:
        """Tell the peer's :meth:`handle` loop that nothing more comes."""
        self._send(self._ints([CLOSE, 0, 0]), peer)

    def handle(self, peer: int, seq_for=None, timeout: float | None = None) -> Received:
        import torch

        mgr = self._need()
        kind, n, tag = self._recv((3,), torch.int64, peer, "next message", timeout).tolist()
        if kind == CLOSE:
            return Received("close")
        if kind == LOOKUP:
            hashes = self._recv((n,), torch.int64, peer, "lookup").tolist() if n else []
            count = mgr.held_prefix_pages([h & 0xFFFFFFFFFFFFFFFF for h in hashes])
            self._send(self._ints([count]), peer)
            return Received("lookup", tag, lookup_count=count)
        if kind != PAGES:
            raise CorruptTransferError(f"transport: unknown message kind {kind}")
        raw = self._recv((n,), torch.uint8, peer, "page header").numpy().tobytes()
        header = None
        try:
            header = PageHeader.from_bytes(raw)
            seq_id = seq_for(header, tag) if seq_for is not None else None
            lid, first_row = mgr.begin_import(header, seq_id, timeout=self.timeout)
        except (TransferError, KVCacheCapacityError, InvalidArgumentError) as err:
            held = mgr.held_prefix_pages(header.block_hashes) \
                if type(err) is TransferError and header is not None else 0
            self._send(self._ints([_import_status(err), held]), peer)
            return Received("pages", tag, error=err)
        self._send(self._ints([OK, first_row]), peer)
        rows = header.n_carried - first_row
        try:
            data = self._recv((rows, *header.page_shape), getattr(torch, header.dtype), peer,
                              "page data") if rows else \
                torch.empty((0, *header.page_shape), dtype=getattr(torch, header.dtype))
            written = mgr.finish_import(lid, data.cpu() if data.device.type != "cpu" else data)
        except BaseException as err:
            mgr.end_lease(lid)  # no-op if finish_import ended it
            if isinstance(err, (TransferTimeoutError,)):
                raise
            self._send(self._ints([REFUSED, 0]), peer)
            return Received("pages", tag, header=header, error=err)
        self._send(self._ints([OK, written]), peer)
        return Received("pages", tag, header=header, seq_id=seq_id, pages_written=written)


_CODES = {OK: "ok", RESEND: "missing prefix, resend", REFUSED: "refused"}


class InProcessTransport(PageTransport):
    """Two endpoints in one process (tests): :meth:`pair` links them; a send is queued on the
    peer and done once the peer's :meth:`handle` imported it -- at once when the peer was
    made with ``auto=True`` (then ``peer.seq_for`` picks the sequence to import into)."""

    def __init__(self, auto: bool = False, seq_for=None):
        self.peer_ep: InProcessTransport | None = None
        self.inbox: deque = deque()
        self.auto, self.seq_for = auto, seq_for

    @classmethod
    def pair(cls, mgr_a, mgr_b, auto: bool = False,
             seq_for=None) -> tuple["InProcessTransport", "InProcessTransport"]:
        """Endpoints of ``mgr_a`` and ``mgr_b``; ``auto``/``seq_for`` apply to ``mgr_b``'s."""
        a, b = cls(), cls(auto, seq_for)
        a.register(mgr_a)
        b.register(mgr_b)
        a.peer_ep, b.peer_ep = b, a
        return a, b

    def lookup(self, peer: int, block_hashes) -> int:
        return self.peer_ep._need().held_prefix_pages(block_hashes)

    def send(self, peer: int, export: PageExport, tag: int = 0) -> Transfer:
        self._need()
        transfer = Transfer(export, self.manager)
        box = {}
        # the bytes travel now (a copy, as a wire would); the ack comes when the peer handles
        self.peer_ep.inbox.append((PageHeader.from_bytes(export.header.to_bytes()),
                                   export.data.clone(), tag, box))
        if self.peer_ep.auto:
            self.peer_ep.handle(0, self.peer_ep.seq_for)

        def step():
            if "error" in box:
                err = box["error"]
                if type(err) is TransferError:
                    err.resend = True
                raise err
            if "written" in box:
                transfer.pages_written = box["written"]
                return True
            return False

        transfer._step = step
        return transfer

    def handle(self, peer: int, seq_for=None, timeout: float | None = None) -> Received:
        mgr = self._need()
        if not self.inbox:
            raise TransferTimeoutError("in-process transport: nothing to handle")
        header, data, tag, box = self.inbox.popleft()
        seq_id = None
        try:
            seq_id = seq_for(header, tag) if seq_for is not None else None
            box["written"] = mgr.import_pages(header, data, seq_id)
        except (TransferError, KVCacheCapacityError, InvalidArgumentError,
                FormatMismatchError) as err:
            box["error"] = err
            return Received("pages", tag, header=header, error=err)
        return Received("pages", tag, header=header, seq_id=seq_id,
                        pages_written=box["written"])
