"""The page transport interface -- :class:`PageTransport`, the :class:`Transfer` a send returns
and the :class:`Received` a handle returns -- and :class:`InProcessTransport`, two endpoints in one
process (tests). :mod:`kvtvm.transfer` implements the interface over ``torch.distributed``
(and re-exports these names); :mod:`kvtvm.transferwire` describes its wire protocol."""

from __future__ import annotations

import abc
import time
from collections import deque
from dataclasses import dataclass, field

from .errors import (InvalidArgumentError, KVCacheError, TransferError, TransferTimeoutError,
                     describe)
from .manager.args import check_seconds
from .manager.pageformat import check_export
from .manager.pageio import PageExport, PageHeader

__all__ = ["PageTransport", "Transfer", "Received", "InProcessTransport", "send_sequence"]


@dataclass
class Transfer:
    """A send in flight: ``poll()`` is True once done; ``wait()`` returns the pages the peer
    wrote or raises the transfer's error."""

    export: PageExport
    manager: object = None          # the exporter: its lease ends when the transfer does
    _step: object = None            # callable advancing the protocol, True when finished
    _block: object = None           # optional callable(timeout) sleeping until _step may be
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
        timeout = check_seconds("timeout", timeout)  # NaN would wait for ever
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._block is not None and not self.done:
            try:
                self._block(timeout)
            except BaseException as err:  # noqa: BLE001 - ends the lease in poll, re-raised
                self.error, self.done = err, True
        while not self.poll():
            if deadline is not None and time.monotonic() > deadline:
                raise TransferTimeoutError(f"transfer: not done after {timeout} s")
            if self._block is not None:  # sleep on the completion instead of spinning
                self._block(None if deadline is None else max(0.0, deadline - time.monotonic()))
            else:
                time.sleep(0.0005)
        if self.error is not None:
            raise self.error
        return self.pages_written


@dataclass
class Received:
    """What :meth:`PageTransport.handle` processed: a lookup, an import, the peer's ints or its
    close. A refused import (``error`` set) still names the ``seq_id`` that ``seq_for``
    returned: it stays claimed and empty, the application's to reuse or release."""

    kind: str                      # "lookup", "pages", "ints" or "close"
    tag: int = 0
    header: PageHeader | None = None
    seq_id: int | None = None
    pages_written: int = 0
    lookup_count: int = 0
    error: BaseException | None = field(default=None, repr=False)
    ints: list[int] | None = None  # kind "ints": the values of the peer's send_ints


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
        """Start sending ``export``; the returned transfer ends its lease when done (if
        ``send`` raises, the lease has ended)."""

    @abc.abstractmethod
    def handle(self, peer: int, seq_for=None, timeout: float | None = None) -> Received:
        """Process one incoming message from ``peer``: answer a lookup, or import pages.
        ``seq_for(header, tag)`` may return a claimed empty ``seq_id`` to import into."""

    def _need(self):
        if self.manager is None:
            raise TransferError("transport: register() a cache first")
        return self.manager


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
        check_export(export)
        mgr = self._need()
        transfer = Transfer(export, mgr)
        box = {}
        try:  # the bytes travel now (a copy, as a wire would); the ack comes when the peer
            # handles them (at once with auto: its seq_for may raise)
            self.peer_ep.inbox.append((PageHeader.from_bytes(export.header.to_bytes()),
                                       export.data.clone(), tag, box))
            if self.peer_ep.auto:
                self.peer_ep.handle(0, self.peer_ep.seq_for)
        except BaseException:
            mgr.end_lease(export.lease_id)
            raise

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
        except KVCacheError as err:  # refused: the sender's wait raises it
            box["error"] = err
            return Received("pages", tag, header=header, seq_id=seq_id, error=err)
        return Received("pages", tag, header=header, seq_id=seq_id,
                        pages_written=box["written"])


def send_sequence(transport: PageTransport, peer: int, seq_id: int, tag: int = 0,
                  timeout: float | None = 60.0) -> int:
    """Send the pages of ``seq_id`` that the peer lacks (lookup by hashes first), wait for
    the acknowledgement; returns the pages the peer wrote. The export lease ends exactly once,
    whatever happens."""
    mgr = transport._need()
    have = transport.lookup(peer, mgr.block_hashes_of(seq_id))
    for first in (have, 0):
        export = mgr.export_pages(seq_id, first_page=first, timeout=timeout,
                                  defer_checksums=True)
        try:  # a send that raises has its lease ended here too (any transport)
            return transport.send(peer, export, tag).wait(timeout)
        except TransferError as err:
            if not getattr(err, "resend", False) or first == 0:
                raise
        finally:
            mgr.end_lease(export.lease_id)
    raise AssertionError("unreachable")
