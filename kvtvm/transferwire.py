"""The wire format of :class:`kvtvm.transfer.DistributedTransport` and its ordering rules, and
the pure helpers for them (no I/O): the message kinds and statuses, the control frame, the
acknowledgement's payload, the check of a peer rank, the wording of a message out of step and
where a receiver puts each run (:func:`receive_targets`).
:mod:`kvtvm.transfer` moves the bytes and re-exports these names.

Wire protocol (control messages are one fixed
:data:`MSG_BYTES` buffer each: ``[kind, length, tag]`` and a payload), one round trip:

    lookup:  A->B LOOKUP(hashes)                 B->A ANSWER(count)
    pages:   A->B PAGES(page header without the checksums, run lengths)
                  A computes the checksums    B->A READY (gloo: B posted every receive, or
                  meanwhile                            will drain a refused import's runs)
             A->B one message per run of consecutive cache pages (views: no copy; runs cut
                  at ``CHUNK_BYTES``); B receives each run straight into a run of its fresh pages
                  when it fits (else into a buffer, one copy)
             A->B SUMS(one checksum per page); B computes its own as each run lands, compares,
                  then registers
                                                 B->A ACK(status, pages written or held)

On gloo the runs leave only once B said READY: A hashes while B checks the header and takes
pages (the link is idle then anyway), and the runs then stream into receives already posted,
written by A's thread without A's hashing competing with both sides' socket threads for the
cores (16 MiB on 2 cores: 9.9-10.7 -> 7.0-7.9 ms, docs/PERF.md). Not on NCCL: its p2p ops to
one peer run in order on one stream, so B's READY would wait for the runs it announces (a
deadlock); there A posts the runs first and hashes while they are on the wire.

(An export whose checksums were already computed -- ``export.header`` was read -- carries them
in PAGES and sends no SUMS.)

``status`` 0 is success, 1 "resend from an earlier page" (the peer lacks the prefix the
sender thought it held -- e.g. a hash collision in the lookup), 2 a refused import
(format, capacity, corruption). ACK carries the peer's reason after the two ints: the sender
raises :class:`~kvtvm.errors.FormatMismatchError` or
:class:`~kvtvm.errors.CorruptTransferError` when the peer's error was one (naming the field),
else :class:`~kvtvm.errors.TransferError`. Each send receives its ACK into a buffer of its
own, so several sends may be in flight.

Ordering rules. gloo: A posts the receives of READY and of ACK before PAGES. NCCL: A posts the
receive of each send's ACK right after its data (in the caller's thread, never a helper
thread's), so with several sends and lookups in flight each answer lands in its own receive,
in send order. B keeps the receive of its *next* message (a request, or ints) posted across
:meth:`~kvtvm.transfer.DistributedTransport.handle` calls that ran out of time, waited on by a
thread of its own; until something arrives, lookups and sends to that peer are refused
(:class:`~kvtvm.errors.TransferError`, nothing posted: its answer would land in that receive),
and on NCCL every send to it (it would queue behind the receive). A handle() also returns an
INTS message (``Received("ints")``).

One initiator per rank pair at a time: two ranks that send (or look up) to each other at once
each receive the other's request where their answer was due -- a
:class:`~kvtvm.errors.CorruptTransferError` saying so, and the wire is out of step for good.
Traffic both ways needs one process group (one transport) per direction.
"""

from __future__ import annotations

import numbers
import struct

from .errors import (CorruptTransferError, FormatMismatchError, InvalidArgumentError,
                     TransferError, describe)

# message kinds, and the status of an import plan / acknowledgement
LOOKUP, ANSWER, PAGES, ACK, INTS, CLOSE, SUMS, READY = range(1, 9)
OK, RESEND, REFUSED = 0, 1, 2
KINDS = {LOOKUP: "lookup", ANSWER: "lookup answer", PAGES: "page header", ACK: "acknowledgement",
         INTS: "ints", CLOSE: "close", SUMS: "checksums", READY: "ready"}
#: Bytes of the fixed buffer every control message travels in.
MSG_BYTES = 8192
_FRAME = struct.Struct("<qqq")  # kind, payload length, tag
_MASK = (1 << 64) - 1
_LEN = struct.Struct("<q")
_ACK = struct.Struct("<qq")  # status, pages written or held; the peer's reason follows
_CODES = {OK: "ok", RESEND: "missing prefix, resend", REFUSED: "refused"}
#: Errors of a refused import the sender raises as their own type (else TransferError).
_PEER_ERRORS = {cls.__name__: cls for cls in (FormatMismatchError, CorruptTransferError)}
#: Why a request arrives where an answer was due, or an answer where a request was.
ONE_INITIATOR = ("both ranks initiating at once? One initiator per rank pair at a time (a "
                 "rank that handle()s a peer's messages does not send or look up to it), or "
                 "one process group per direction")


def check_peer(peer, ranks, own: int) -> int:
    """``peer`` as an int if it is a rank of ``ranks`` (the transport's group, global ranks)
    other than ``own``, else :class:`InvalidArgumentError` naming the valid ranks (checked
    before anything is posted: a rank outside the group crashes or hangs inside gloo)."""
    if isinstance(peer, numbers.Integral) and not isinstance(peer, bool) and \
            int(peer) != own and int(peer) in ranks:
        return int(peer)
    ranks = sorted(ranks)
    span = f"{ranks[0]}..{ranks[-1]}" if ranks[-1] - ranks[0] + 1 == len(ranks) else ranks
    raise InvalidArgumentError(describe(
        "peer", f"an int rank of the transport's group ({span}) other than its own ({own})",
        repr(peer)))


def out_of_step(what: str, want: int, got: int) -> str:
    """The message for a control message of kind ``got`` where ``what`` (kind ``want``, 0:
    any request) was due, naming the likely cause."""
    name = f"{KINDS[got]} (kind {got})" if got in KINDS else f"kind {got}"
    text = (f"expected {what} (kind {want}), got {name}" if want else
            f"unexpected message {name} where a request was due")
    requests, answers = (LOOKUP, PAGES, INTS, CLOSE), (ANSWER, READY, ACK)
    if (want in answers and got in requests) or (want == 0 and got in answers):
        text += f" -- {ONE_INITIATOR}"
    return text


def _import_status(err: BaseException) -> int:
    return RESEND if type(err) is TransferError else REFUSED


def _ack_payload(status: int, n: int, err: BaseException | None = None) -> bytes:
    """An acknowledgement: status, pages, and why the import was refused (short: the whole
    message fits one control buffer)."""
    why = f"{type(err).__name__}: {err}" if err is not None else ""
    return _ACK.pack(status, n) + why.encode("utf-8", "replace")[:2048]


def _read_ack(payload: bytes) -> int:
    """The pages the peer wrote, or raise its refusal: a :class:`FormatMismatchError` or
    :class:`CorruptTransferError` as the peer named it, else :class:`TransferError`
    (``resend`` set when the peer lacks the prefix)."""
    try:
        st, n = _ACK.unpack_from(payload)
    except struct.error:
        raise CorruptTransferError(f"transport: acknowledgement of {len(payload)} bytes "
                                   "(unreadable)") from None
    if st == OK:
        return n
    why = payload[_ACK.size:].decode("utf-8", "replace")
    cls = TransferError if st == RESEND else _PEER_ERRORS.get(why.partition(":")[0],
                                                              TransferError)
    err = cls(f"transport: the peer did not import the pages ({_CODES.get(st, st)}; it holds "
              f"{n} leading pages)" + (f": {why}" if why else ""))
    err.resend = st == RESEND
    raise err


def receive_targets(dest, lengths, first_row, page_shape, dtype, device, staging):
    """Where each of the sender's runs is received: ``(targets, fixups)``. A run that lands
    in one run of this cache's consecutive fresh pages is received there in place (a
    view); one that straddles two (or holds rows before ``first_row``: pages the sender
    thought missing but this cache holds) goes to a slice of a buffer, and ``fixups``
    lists ``(buffer rows, [fresh page view per row])`` to copy once verified (rows before
    ``first_row`` are dropped). ``(None, [])`` when the pages are not on the transport's
    ``device`` or the cache splits heads (``dest`` None): then all go to a buffer. ``dest``
    is the manager's ``import_runs`` answer; ``staging(shape, dtype)`` lends the buffer."""
    if dest is None or any(v.device != device for _, v in dest):
        return None, []
    out, pending, r = [], [], 0
    for n in lengths:
        rel = r - first_row
        hit = next(((row, v) for row, v in reversed(dest) if row <= rel), None) \
            if rel >= 0 else None
        if hit is not None and rel - hit[0] + n <= hit[1].shape[0]:
            out.append(hit[1][rel - hit[0]:rel - hit[0] + n])
        else:
            pending.append((len(out), n, rel))
            out.append(None)
        r += n
    fixups, s = [], 0
    if pending:
        rows = [v[i] for _, v in dest for i in range(v.shape[0])]  # a view per fresh page
        stage = staging((sum(n for _, n, _ in pending), *page_shape), dtype)
        for k, n, rel in pending:
            out[k] = stage[s:s + n]
            skip = min(max(0, -rel), n)  # a run wholly before first_row: nothing kept
            fixups.append((out[k][skip:], rows[max(0, rel + skip):max(0, rel + n)]))
            s += n
    return out, fixups
