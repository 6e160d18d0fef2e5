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

A :class:`DistributedTransport` speaks the wire protocol :mod:`kvtvm.transferwire` describes
(one round trip per sequence). Every wait within a message or for an answer has a deadline: a
dead or silent peer is a :class:`~kvtvm.errors.TransferTimeoutError`, the leases ended (no
page leaked); after it (or a message out of step) the wire is unusable and every later call
raises :class:`~kvtvm.errors.TransferError` saying so (gloo closes the connection on a
timeout). Polling for the *next* message (``handle``, ``recv_ints`` with a ``timeout`` below
the transport's) is not fatal: nothing arriving in time raises
:class:`~kvtvm.errors.TransferTimeoutError`, the receive stays posted and a later call takes
the message. A ``peer`` must be a rank of the group other than this process's
(:class:`~kvtvm.errors.InvalidArgumentError` before anything is posted). One initiator per
rank pair at a time (see :mod:`kvtvm.transferwire`).
"""

from __future__ import annotations

import datetime
import logging
import struct
import threading
from concurrent.futures import wait as futures_wait

import numpy as np

from .errors import (CorruptTransferError, InvalidArgumentError, KVCacheError, TransferError,
                     TransferTimeoutError, describe)
from .manager.args import check_hashes, check_seconds
from .manager.checksums import DEVICE, page_checksums
from .manager.pageformat import check_export
from .manager.pageio import PageExport, PageHeader
from .pagetransport import InProcessTransport, PageTransport, Received, Transfer, send_sequence
from .transferwire import (_ACK, _FRAME, _LEN, _MASK, ACK, ANSWER, CLOSE, INTS,  # noqa: F401
                           LOOKUP, MSG_BYTES, OK, ONE_INITIATOR, PAGES, READY, REFUSED, RESEND,
                           SUMS, _ack_payload, _import_status, _read_ack, check_peer,
                           out_of_step, receive_targets)
from . import transferwait as polls

__all__ = ["PageTransport", "Transfer", "Received", "DistributedTransport",
           "InProcessTransport", "send_sequence"]

log = logging.getLogger(__name__)

#: Bytes one data message carries at most (whole pages, at least one): the receiver checks a
#: message's pages while the next ones arrive, so only the last one's check is not hidden.
CHUNK_BYTES = 2 << 20


class DistributedTransport(PageTransport):
    """:class:`PageTransport` over ``torch.distributed`` point-to-point ops.

    Control messages travel in one fixed-size buffer (:data:`MSG_BYTES`; a longer payload --
    a long prompt's header -- continues in a second message), page data as views of the
    cache pages, one message per run of pages consecutive on both sides.

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

        timeout = check_seconds("timeout", timeout, allow_none=False)
        if timeout == 0:  # every wait would fail at once (and a failed wait ends the wire)
            raise InvalidArgumentError(describe("timeout", "seconds > 0", 0.0))
        if not dist.is_initialized():
            raise TransferError("DistributedTransport: torch.distributed is not initialized")
        self.dist, self.group, self.timeout = dist, group, timeout
        backend = dist.get_backend(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if backend == "nccl" else torch.device("cpu")
        # gloo: answers' receives posted early and the runs sent after READY (the module
        # docstring); NCCL runs one peer's ops in order on one stream, so neither there
        self._gloo_order = backend == "gloo"
        self._broken = None  # why the wire is unusable (a peer gone, a message out of step)
        self._local = threading.local()  # .posts: this thread's sends and receives posted
        self._rank = dist.get_rank()  # (global ranks: what isend/irecv take)
        self._ranks = frozenset(dist.get_process_group_ranks(group or dist.group.WORLD))
        # key of this group's polls (kvtvm.transferwait: shared by the group's transports)
        self._group_key = group if group is not None else dist.group.WORLD
        self._pool = None
        # one initiator call at a time per peer (its messages posted together: threads
        # sending to one peer interleaved them, and the peer's receives took the wrong ones)
        self._peer_locks: dict = {}
        self._peer_locks_guard = threading.Lock()

    @property
    def _out(self):
        """This thread's control send buffer (shared ones were overwritten by a thread
        handling another peer while in flight); ``_in`` the receive one."""
        return self._thread_buffer("out")

    @property
    def _in(self):
        return self._thread_buffer("in")

    def _thread_buffer(self, name: str):
        import torch

        buf = getattr(self._local, name, None)
        if buf is None:
            buf = torch.zeros(MSG_BYTES, dtype=torch.uint8, device=self.device)
            setattr(self._local, name, buf)
        return buf

    def _initiating(self, peer: int):
        """The lock of ``peer``'s initiator calls (lookup, send, ints, close)."""
        with self._peer_locks_guard:
            return self._peer_locks.setdefault(peer, threading.RLock())

    # -- low level ------------------------------------------------------------------------------
    def _waiter(self):
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtvm-transfer")
        return self._pool

    def _peer(self, peer, what: str, sends: bool = True, answers: bool = False) -> int:
        """``peer`` checked (:func:`check_peer`) before anything is posted. ``answers``: the
        call awaits an answer, which a pending :meth:`handle` receive from ``peer`` would take;
        ``sends`` (NCCL): a pending receive holds back every send to it (one stream)."""
        peer = check_peer(peer, self._ranks, self._rank)
        key = (self._group_key, peer)
        if polls.failed(key) is not None:  # the peer went while polled
            raise self._gone(what, polls.failed(key))
        if polls.pending(key) and (answers or (sends and not self._gloo_order)):
            raise TransferError(f"transport: {what} to rank {peer} refused: a handle() of its "
                                "messages is pending (it timed out, its receive stays posted; "
                                f"call handle({peer}) until one arrives) -- {ONE_INITIATOR}")
        return peer

    def _posts(self) -> int:
        """Sends and receives this thread posted (a send stopped midway leaves some)."""
        return getattr(self._local, "posts", 0)

    def _usable(self) -> None:
        """Raise :class:`TransferError` if an earlier failure left the wire unusable."""
        if self._broken is not None:
            raise TransferError(f"transport: unusable since an earlier failure ({self._broken})"
                                ": messages may be out of step; start a new process group")

    def _desync(self, why: str) -> CorruptTransferError:
        """A message out of step: the wire is unusable from now on (returns the error)."""
        self._broken = self._broken or why
        return CorruptTransferError(f"transport: {why}")

    def _gone(self, what: str, err: BaseException, seconds=None) -> TransferTimeoutError:
        """The peer is gone or silent (a failed wait or post): the wire is unusable."""
        text = f"{what}: {str(err).splitlines()[0][:200] if str(err) else type(err).__name__}"
        self._broken = self._broken or f"peer silent or gone ({text})"
        when = f"for {seconds} s " if seconds is not None else ""
        return TransferTimeoutError(f"transport: peer silent or gone {when}({text})")

    def _isend(self, tensor, peer: int, what: str):
        self._usable()
        self._local.posts = self._posts() + 1
        try:
            return self.dist.isend(tensor, peer, group=self.group)
        except RuntimeError as err:  # a connection the peer closed (killed, exited)
            raise self._gone(what, err) from None

    def _irecv(self, tensor, peer: int, what: str):
        self._usable()
        self._local.posts = self._posts() + 1
        try:
            return self.dist.irecv(tensor, peer, group=self.group)
        except RuntimeError as err:
            raise self._gone(what, err) from None

    def _wait(self, work, what: str, timeout: float | None = None) -> None:
        # gloo's receive work never reports is_completed() before wait(): wait with a timeout.
        # A failed wait leaves the wire unusable (gloo closes the connection on a timeout)
        seconds = self.timeout if timeout is None else timeout
        try:
            work.wait(timeout=datetime.timedelta(seconds=seconds))
        except RuntimeError as err:  # DistBackendError derives from it
            raise self._gone(what, err, seconds) from None

    def _staging(self, shape, dtype):
        """A reused receive buffer (fresh memory per message would cost page faults)."""
        import torch

        n = 1
        for d in shape:
            n *= d
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        stage = getattr(self._local, "stage", None)  # (per thread, as the control buffers)
        if stage is None or stage.numel() < nbytes:
            stage = self._local.stage = torch.empty(nbytes, dtype=torch.uint8,
                                                    device=self.device)
        return stage[:nbytes].view(dtype).view(shape)

    def _send_msg(self, peer: int, kind: int, tag: int = 0, payload: bytes = b"",
                  what: str = "message", wait: bool = True) -> list:
        """One control message: ``[kind, len, tag]`` and the payload's first bytes in one
        fixed-size buffer, the rest (if any) in a second message. ``wait=False``: returns the
        send works instead of waiting for them (the message gets a buffer of its own)."""
        import torch

        head = _FRAME.pack(kind, len(payload), tag) + payload[:MSG_BYTES - _FRAME.size]
        buf = self._out if wait else torch.zeros(MSG_BYTES, dtype=torch.uint8,
                                                 device=self.device)
        buf[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(self.device)
        works = [self._isend(buf, peer, what)]
        rest = payload[MSG_BYTES - _FRAME.size:]
        if rest:
            t = torch.frombuffer(bytearray(rest), dtype=torch.uint8).to(self.device)
            works.append(self._isend(t, peer, what))
        if wait:
            for work in works:
                self._wait(work, what)
            return []
        return works

    def _recv_msg(self, peer: int, what: str, timeout: float | None = None):
        """``(kind, tag, payload bytes)`` of the next control message."""
        self._wait(self._irecv(self._in, peer, what), what, timeout)
        return self._read_msg(peer, what, timeout)

    def _next_msg(self, peer: int, what: str, timeout: float | None = None):
        """``(kind, tag, payload)`` of the next message from ``peer`` that this side did not
        ask for (a request, ints). With a ``timeout`` shorter than the transport's its receive
        is waited on by a thread of its own, without a deadline (:mod:`kvtvm.transferwait`):
        running out of time is a :class:`TransferTimeoutError` that leaves the transport
        usable, the receive posted for a later call. Else (as :meth:`Transfer.wait`) the wait
        is in the caller's thread, no thread hop (~0.1 ms), fatal when it runs out."""
        import torch

        seconds = self.timeout if timeout is None else timeout
        key = (self._group_key, peer)
        if seconds >= self.timeout and polls.pending(key) is None:
            return self._recv_msg(peer, what, seconds)

        def post():  # in the caller's thread (in call order)
            buf = torch.zeros(MSG_BYTES, dtype=torch.uint8, device=self.device)
            return buf, self._irecv(buf, peer, what)

        buf, done = polls.posted(key, post)
        self._usable()
        if not futures_wait([done], timeout=seconds).done:
            raise TransferTimeoutError(f"transport: nothing from rank {peer} in {seconds} s "
                                       f"({what}; still awaited: the transport stays usable)")
        if not polls.take(key, done):
            raise TransferError(f"transport: {what}: another thread took the message from "
                                f"rank {peer} (one handle() at a time per peer)")
        err = done.exception()
        if err is not None:
            raise self._gone(what, err) if isinstance(err, RuntimeError) else err
        return self._read_msg(peer, what, None, buf)

    def _read_msg(self, peer: int, what: str, timeout: float | None = None, buf=None):
        """Parse the control message received into ``buf`` (default ``self._in``) and its
        continuation."""
        import torch

        raw = (self._in if buf is None else buf).cpu().numpy().tobytes()
        kind, n, tag = _FRAME.unpack_from(raw)
        if n < 0 or n > 1 << 31:
            raise self._desync(f"bad message length {n} ({what})")
        payload = raw[_FRAME.size:_FRAME.size + n]
        if n > len(payload):
            rest = torch.empty(n - len(payload), dtype=torch.uint8, device=self.device)
            self._wait(self._irecv(rest, peer, what), what, timeout)
            payload += rest.cpu().numpy().tobytes()
        return kind, tag, payload

    def _values(self, payload: bytes, dtype, what: str, n: int | None = None) -> list:
        """The ``n`` (any number if None) values of ``dtype`` a message carries; a payload
        of another size is a message out of step (:class:`CorruptTransferError`)."""
        size = np.dtype(dtype).itemsize
        if len(payload) % size or (n is not None and len(payload) != n * size):
            raise self._desync(f"{what}: {len(payload)} bytes, expected "
                               f"{'a multiple of ' if n is None else ''}{size * (n or 1)}")
        return np.frombuffer(payload, dtype).tolist()

    def _expect(self, peer: int, kind: int, what: str) -> tuple[int, bytes]:
        got, tag, payload = self._recv_msg(peer, what)
        if got != kind:
            raise self._desync(out_of_step(what, kind, got))
        return tag, payload

    # -- interface ------------------------------------------------------------------------------
    def lookup(self, peer: int, block_hashes) -> int:
        peer = self._peer(peer, "lookup", answers=True)
        hashes = np.asarray([h & _MASK for h in check_hashes("block_hashes", block_hashes)],
                            dtype=np.uint64)
        self._usable()
        with self._initiating(peer):
            self._send_msg(peer, LOOKUP, 0, hashes.tobytes(), "lookup")
            _, payload = self._expect(peer, ANSWER, "lookup answer")
        (count,) = self._values(payload, np.int64, "lookup answer", 1)
        if not 0 <= count <= len(hashes):
            raise self._desync(f"lookup answer {count} for {len(hashes)} hashes")
        return int(count)

    def send(self, peer: int, export: PageExport, tag: int = 0) -> Transfer:
        """Start sending ``export`` (see :meth:`PageTransport.send`). If this raises, the
        export's lease has ended; an export whose lease already ended is refused before
        anything goes on the wire (:class:`TransferError`: its pages may have been reused)."""
        check_export(export)
        mgr, posts = self._need(), self._posts()
        try:  # a refused peer ends the lease too, as every refusal does
            peer = self._peer(peer, "send", answers=True)
            self._usable()
            if export.lease_id not in mgr.active_leases():
                raise TransferError(f"transport: the lease of the export ({export.lease_id}) "
                                    "ended before the send: its pages may have been reused")
            with self._initiating(peer):
                return self._send(peer, export, tag)
        except BaseException as err:
            mgr.end_lease(export.lease_id)  # a no-op if it ended
            if self._posts() != posts and not isinstance(err, KVCacheError):  # (interrupt,
                self._broken = self._broken or (  # a torch error): the wire out of step
                    f"a send to rank {peer} stopped midway ({type(err).__name__})")
            raise

    def _send(self, peer: int, export: PageExport, tag: int) -> Transfer:
        import torch

        # one round trip: the header and the run lengths, the runs (views of the cache pages,
        # zero copy), their checksums (computed while the runs are on the wire), then the
        # peer's acknowledgement
        hdr = export.wire_header
        per = max(1, CHUNK_BYTES // max(1, hdr.page_bytes))
        runs = export.page_runs(0) if hdr.n_carried else []
        runs = [(r + i, v[i:i + per]) for r, v in runs for i in range(0, v.shape[0], per)]
        later = hdr.checksums is None
        raw = hdr.to_bytes()
        lengths = np.asarray([v.shape[0] for _, v in runs], dtype=np.int64)
        # gloo: the receives of READY and of the acknowledgement are posted first (in the
        # order the peer sends them), so the peer's answers need no "ready to receive"
        # notice from this side when they come. Not on NCCL: its p2p ops to one peer run in
        # order on one stream, a receive posted first would wait for the peer's answer
        # before the data it answers leaves (a deadlock)
        # The acknowledgement lands in a buffer of this send's own: with several sends in
        # flight each reads its own answer (one shared buffer held the latest one)
        what = f"acknowledgement from rank {peer}"
        ready_buf = torch.empty(MSG_BYTES, dtype=torch.uint8, device=self.device)
        ready = [self._irecv(ready_buf, peer, "ready")] if self._gloo_order else []
        ack_buf = torch.empty(MSG_BYTES, dtype=torch.uint8, device=self.device)
        ack = [self._irecv(ack_buf, peer, what)] if self._gloo_order else []

        def take_ack() -> bytes:  # (only waits: every receive is posted in the caller's thread)
            self._wait(ack[0], what)
            kind, _, payload = self._read_msg(peer, what, None, ack_buf)
            if kind != ACK:
                raise self._desync(out_of_step(what, ACK, kind))
            return payload

        works = self._send_msg(peer, PAGES, tag, _LEN.pack(len(raw)) + raw
                               + lengths.tobytes(), "page header", wait=False)
        if not ready:  # NCCL: the runs go now, hashed while on the wire (see the docstring)
            works += [self._isend(v.to(self.device), peer, "page data") for _, v in runs]
        failed, sums = None, []
        if later:
            try:
                sums = [c for row, v in runs for c in export.row_checksums(row, v)]
            except TransferError as err:  # the lease ended: the peer refuses a short list
                failed, sums = err, []
        if ready:  # gloo: the runs once the peer's receives are posted (see the docstring)
            self._wait(ready[0], "ready")
            kind, _, _ = self._read_msg(peer, "ready", None, ready_buf)
            if kind != READY:
                raise self._desync(out_of_step("ready", READY, kind))
            works += [self._isend(v.to(self.device), peer, "page data") for _, v in runs]
        if later:
            works += self._send_msg(peer, SUMS, tag, np.asarray(sums, np.uint64).tobytes(),
                                    "checksums", wait=False)
        if not ack:  # NCCL: after the data (one stream), now: each send's ACK in its own
            ack.append(self._irecv(ack_buf, peer, what))  # receive, in send order
        for work in works:
            self._wait(work, "page data")
        if failed is not None:
            take_ack()  # the peer's refusal (send() ends the lease)
            raise failed
        transfer = Transfer(export, self.manager)
        state = {}  # "future": the ack awaited on a helper thread (poll never blocks);
        #             "payload": the ack, received in the caller's thread by wait()

        def step():
            if "payload" not in state:
                if "future" not in state:
                    state["future"] = self._waiter().submit(take_ack)
                if not state["future"].done():
                    return False
                state["payload"] = state["future"].result()
            transfer.pages_written = _read_ack(state["payload"])
            return True

        def block(timeout):
            if "payload" in state:
                return
            if "future" not in state and (timeout is None or timeout >= self.timeout):
                state["payload"] = take_ack()  # nobody polled: no thread hop
                return
            # a shorter wait than the transport's: on the helper thread, so running out of
            # time leaves the transfer in flight (a failed gloo wait would end the wire)
            if "future" not in state:
                state["future"] = self._waiter().submit(take_ack)
            futures_wait([state["future"]], timeout=timeout)

        transfer._step, transfer._block = step, block
        return transfer

    def send_ints(self, peer: int, values) -> None:
        """Send a few int64 values (an application's own control message, e.g. the first
        generated token); the peer takes them with :meth:`recv_ints` (or :meth:`handle`)."""
        peer = self._peer(peer, "send_ints")
        with self._initiating(peer):
            self._send_msg(peer, INTS, 0, np.asarray(values, np.int64).tobytes(), "ints")

    def recv_ints(self, peer: int, n: int, timeout: float | None = None) -> list[int]:
        """Receive the ``n`` int64 values sent with :meth:`send_ints` (``timeout`` as in
        :meth:`handle`)."""
        peer = self._peer(peer, "recv_ints", sends=False)
        timeout = check_seconds("timeout", timeout)
        with self._initiating(peer):
            kind, _, payload = self._next_msg(peer, "ints", timeout)
        if kind != INTS:
            raise self._desync(out_of_step("ints", INTS, kind))
        return self._values(payload, np.int64, "ints", n)

    def close(self, peer: int) -> None:
        """Tell the peer's :meth:`handle` loop that nothing more comes."""
        peer = self._peer(peer, "close")
        with self._initiating(peer):
            self._send_msg(peer, CLOSE, 0, b"", "close")

    def _ints_msg(self, peer, kind, values, what):
        self._send_msg(peer, kind, 0, np.asarray(values, np.int64).tobytes(), what)

    def _ack(self, peer, status: int, n: int, err: BaseException | None = None) -> None:
        self._send_msg(peer, ACK, 0, _ack_payload(status, n, err), "acknowledgement")

    def handle(self, peer: int, seq_for=None, timeout: float | None = None) -> Received:
        """See :meth:`PageTransport.handle`; ``timeout`` bounds the wait for the message,
        the transport's own timeout each wait after it. One below the transport's polls:
        nothing arriving is a :class:`TransferTimeoutError` that leaves the transport usable
        (a later call takes the message); otherwise it ends the wire. Returns the peer's
        ``send_ints`` too (kind ``"ints"``); a refused import's ``seq_id`` is the one
        ``seq_for`` claimed (still the application's). The import's lease has no deadline
        (:meth:`expire_leases` leaves it alone while its pages receive data in place); it
        ends when the import is done, refused or failed."""
        import torch

        mgr = self._need()
        peer = self._peer(peer, "handle", sends=False)
        timeout = check_seconds("timeout", timeout)
        kind, tag, payload = self._next_msg(peer, "next message", timeout)
        if kind == CLOSE:
            return Received("close")
        if kind == INTS:  # an application's own message (send_ints)
            return Received("ints", tag, ints=self._values(payload, np.int64, "ints"))
        if kind == LOOKUP:
            hashes = self._values(payload, np.uint64, "lookup")
            count = mgr.held_prefix_pages(hashes)
            self._ints_msg(peer, ANSWER, [count], "lookup answer")
            return Received("lookup", tag, lookup_count=count)
        if kind != PAGES:
            raise self._desync(out_of_step("a request", 0, kind))
        header, seq_id, lid = None, None, None
        try:
            (hlen,) = _LEN.unpack_from(payload)
            header = PageHeader.from_bytes(payload[_LEN.size:_LEN.size + hlen], deferred=True,
                                           content=False)  # the import checks the rest
            lengths = np.frombuffer(payload[_LEN.size + hlen:], np.int64).tolist()
            if sum(lengths) != header.n_carried or min(lengths, default=1) < 1:
                raise CorruptTransferError(f"transport: runs {lengths} announced for "
                                           f"{header.n_carried} pages")
        except (struct.error, ValueError) as err:  # the runs that follow cannot be drained
            raise self._desync(f"unreadable page message ({err})") from None
        dtype = getattr(torch, header.tensor_dtype, None)
        if not isinstance(dtype, torch.dtype):  # a type this torch lacks: refused below,
            dtype, shape = torch.uint8, (header.page_bytes,)  # its data drained as bytes
        else:
            shape = header.page_shape
        later = header.checksums is None  # a SUMS message follows the data
        try:
            seq_id = seq_for(header, tag) if seq_for is not None else None
            # no deadline: expire_leases must not end this lease while runs are landing in
            # its pages (they would be freed, handed out, then overwritten by the late runs);
            # every wait here is bounded and every failure ends the lease
            lid, first_row = mgr.begin_import(header, seq_id, timeout=None)
        except Exception as err:  # refused (format, room, a busy or unknown seq_id...), or
            # seq_for failed: take the data (and checksums) off the wire all the same (the
            # wire stays in step), then say why
            self._ready(peer, tag)
            self._drain(peer, lengths, shape, dtype, later)
            held = mgr.held_prefix_pages(header.block_hashes) if type(err) is TransferError \
                else 0
            self._ack(peer, _import_status(err), held, err)
            if not isinstance(err, KVCacheError):
                raise  # the application's own error (from seq_for)
            return Received("pages", tag, header=header, seq_id=seq_id, error=err)
        readied = False
        try:
            targets, fixups = receive_targets(mgr.import_runs(lid), lengths, first_row,
                                              header.page_shape, dtype, self.device,
                                              self._staging)
            if targets is None:  # not in place: everything into a buffer, one copy after
                data = self._staging((header.n_carried, *header.page_shape), dtype)
                targets, r = [], 0
                for n in lengths:
                    targets.append(data[r:r + n])
                    r += n
            else:
                data = None
            works = [self._irecv(t, peer, "page data") for t in targets]
            sums_work = self._irecv(self._in, peer, "checksums") if later else None
            self._ready(peer, tag)
            readied = True
            # verify each run while the next ones arrive (the checksums leave the critical
            # path) -- unless the device checksum would run on a host buffer bound for a
            # CUDA cache: then finish_import checks the pages on the device
            inline = not (header.checksum == DEVICE and data is not None
                          and data.device.type == "cpu"
                          and mgr.blocks[0].device.type == "cuda")
            got, r = [], 0
            for work, target in zip(works, targets):
                self._wait(work, "page data")
                if inline:
                    got += page_checksums(target, header.checksum)
                r += target.shape[0]
            if later:
                self._wait(sums_work, "checksums")
                kind, _, raw = self._read_msg(peer, "checksums")
                if kind != SUMS:
                    raise self._desync(out_of_step("checksums", SUMS, kind))
                if len(raw) % 8:  # (a whole message: the wire is still in step)
                    raise CorruptTransferError(f"transport: checksums: {len(raw)} bytes, not "
                                               "whole uint64 values")
                header = header.with_checksums(np.frombuffer(raw, np.uint64).tolist())
            if inline:
                bad = next((i for i in range(first_row, len(got))
                            if got[i] != header.checksums[i]), None)
                if bad is not None:
                    raise CorruptTransferError(f"transport: page {header.first_page + bad} "
                                               f"fails its {header.checksum} checksum")
            for buf, rows in fixups:  # runs that straddled two runs of fresh pages
                for i, row in enumerate(rows):
                    row.copy_(buf[i])
            written = mgr.finish_import(lid, None if data is None else data[first_row:],
                                        verified=inline, checksums=header.checksums)
        except BaseException as err:
            mgr.end_lease(lid)  # no-op if finish_import ended it
            if isinstance(err, TransferTimeoutError) or self._broken is not None:
                raise
            if not readied:  # failed before a receive was posted: the runs are drained
                self._ready(peer, tag)
                self._drain(peer, lengths, shape, dtype, later)
            self._ack(peer, REFUSED, 0, err)
            return Received("pages", tag, header=header, seq_id=seq_id, error=err)
        self._ack(peer, OK, written)
        return Received("pages", tag, header=header, seq_id=seq_id, pages_written=written)

    def _ready(self, peer: int, tag: int) -> None:
        """gloo: tell the sender its runs may come (every receive is posted, or the runs of
        a refused import will be drained); see the module docstring. NCCL: nothing."""
        if self._gloo_order:
            self._send_msg(peer, READY, tag, b"", "ready")

    def _drain(self, peer, lengths, page_shape, dtype, sums: bool) -> None:
        """Receive and drop the runs (and checksums) of a refused import (the sender sends
        them regardless)."""
        if lengths:
            try:
                buf = self._staging((max(lengths), *page_shape), dtype)
            except (RuntimeError, MemoryError) as err:  # (an absurd page size in the header)
                raise self._desync(f"cannot take the refused runs off the wire: {err}") from None
            for n in lengths:
                self._wait(self._irecv(buf[:n], peer, "page data"), "page data")
        if sums:
            self._recv_msg(peer, "checksums")
