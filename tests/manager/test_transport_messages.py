"""DistributedTransport reading malformed control messages (a peer of another version, a
corrupt wire), in one process: torch.distributed's point-to-point calls are replaced by a
scripted peer. A malformed message is a CorruptTransferError, after which the transport says
it is unusable -- never an IndexError / ValueError from numpy. Bad timeouts are refused by
name; an InProcessTransport send that raises ends its lease."""

import struct
import threading

import numpy as np
import pytest
import torch

from kvtvm import KVCacheParams
from kvtvm.errors import CorruptTransferError, InvalidArgumentError, TransferError
from kvtvm.manager import PagedKVCacheManager
from kvtvm.transfer import ANSWER, INTS, LOOKUP, DistributedTransport


class _Done:
    def wait(self, timeout=None):
        return True


class ScriptedPeer:
    """``isend`` swallows; ``irecv`` fills the buffer with the next scripted message."""

    def __init__(self, messages):
        self.messages = list(messages)

    def isend(self, tensor, peer, group=None):
        return _Done()

    def irecv(self, tensor, peer, group=None):
        kind, payload = self.messages.pop(0)
        raw = struct.pack("<qqq", kind, len(payload), 0) + payload
        tensor.zero_()
        tensor[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return _Done()


def transport(messages):
    tr = DistributedTransport.__new__(DistributedTransport)  # no process group needed
    tr.dist, tr.group, tr.timeout = ScriptedPeer(messages), None, 1.0
    tr.device, tr._gloo_order, tr._broken = torch.device("cpu"), True, None
    tr._pool = None
    tr._local = threading.local()  # (the control and staging buffers: made per thread)
    tr._peer_locks, tr._peer_locks_guard = {}, threading.Lock()
    tr._rank, tr._ranks, tr._group_key = 0, frozenset({0, 1}), object()
    tr.register(PagedKVCacheManager(KVCacheParams("float32", 2, 4, "paged", page_size=4,
                                                  enable_prefix_caching=True), 2, 32, 2,
                                    num_pages=8))
    return tr


def ints(*values):
    return np.asarray(values, np.int64).tobytes()


@pytest.mark.parametrize("payload, why", [
    (b"", "0 bytes"),                      # was IndexError
    (ints(5), "answer 5 for 2 hashes"),    # more pages than were asked about
    (ints(-1), "answer -1"),
    (b"abc", "3 bytes")], ids=["empty", "too many", "negative", "odd size"])
def test_bad_lookup_answer(payload, why):
    tr = transport([(ANSWER, payload)])
    with pytest.raises(CorruptTransferError, match=why):
        tr.lookup(1, [11, 12])
    with pytest.raises(TransferError, match="unusable"):
        tr.lookup(1, [11, 12])


def test_good_lookup_answer_and_ints():
    tr = transport([(ANSWER, ints(2)), (INTS, ints(7, 8, 9))])
    assert tr.lookup(1, [11, 12]) == 2
    assert tr.recv_ints(1, 3) == [7, 8, 9]


def test_bad_ints_and_lookup_payloads():
    tr = transport([(INTS, b"\0" * 12)])  # was ValueError (not a multiple of 8)
    with pytest.raises(CorruptTransferError, match="ints: 12 bytes"):
        tr.recv_ints(1, 1)
    tr = transport([(INTS, ints(1, 2))])
    with pytest.raises(CorruptTransferError, match="ints: 16 bytes, expected 8"):
        tr.recv_ints(1, 1)
    tr = transport([(LOOKUP, b"\0" * 5)])  # was ValueError out of handle()
    with pytest.raises(CorruptTransferError, match="lookup: 5 bytes"):
        tr.handle(1)
    with pytest.raises(TransferError, match="unusable"):
        tr.handle(1)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), 0, True, "5"])
def test_bad_timeouts_are_refused_by_name(bad):
    """Were accepted: a NaN or negative timeout failed inside gloo's wait (an untyped error
    that also ends the connection), 0 made every wait fail; Transfer.wait(nan) spun for
    ever."""
    with pytest.raises(InvalidArgumentError, match="timeout"):
        DistributedTransport(timeout=bad)
    tr = transport([])
    with pytest.raises(InvalidArgumentError, match="timeout"):
        tr.handle(1, timeout=bad if bad != 0 else -0.5)
    assert tr._broken is None and tr.dist.messages == []  # nothing was received
    from kvtvm.transfer import Transfer
    with pytest.raises(InvalidArgumentError, match="timeout"):
        Transfer(export=None, _step=lambda: False).wait(bad if bad != 0 else -0.5)


def test_in_process_send_that_raises_ends_its_lease():
    """InProcessTransport (auto): a peer whose seq_for raised made send() raise with the
    export's lease left open (its pages leased for good)."""
    from kvtvm.manager import BatchItem
    from kvtvm.transfer import InProcessTransport

    def make():
        return PagedKVCacheManager(KVCacheParams("float32", 2, 4, "paged", page_size=4,
                                                 enable_prefix_caching=True), 2, 32, 2,
                                   num_pages=8)

    a, b = make(), make()

    def seq_for(header, tag):
        raise RuntimeError("application bug")

    ta, _ = InProcessTransport.pair(a, b, auto=True, seq_for=seq_for)
    (s,) = a.claim(1)
    a.fetch([BatchItem(s, list(range(9)))])
    a.step([BatchItem(s, list(range(9)))])
    with pytest.raises(RuntimeError, match="application bug"):
        ta.send(1, a.export_pages(s))
    assert a.active_leases() == {} and a.stats().pages_leased == 0


def test_polls_of_one_peer_post_one_receive_whatever_the_threads():
    """Two threads polling one peer each posted a receive (a check, then a post, unlocked):
    one took a message nobody read. kvtvm.transferwait posts one per (group, peer); the
    thread that finds it taken by another is told so."""
    import threading

    from kvtvm import transferwait as polls

    class Work:
        def __init__(self):
            self.go = threading.Event()

        def wait(self, timeout=None):
            self.go.wait(10)

    posts, works, key = [], [], (object(), 1)

    def post():
        posts.append(1)
        works.append(Work())
        return "buf", works[-1]

    got = []
    start = threading.Barrier(4)

    def poll():
        start.wait()
        got.append(polls.posted(key, post))

    threads = [threading.Thread(target=poll) for _ in range(4)]
    [t.start() for t in threads]
    [t.join(10) for t in threads]
    assert len(posts) == 1 and len({id(g[1]) for g in got}) == 1
    works[0].go.set()
    done = got[0][1]
    done.result(10)
    assert polls.take(key, done) and not polls.take(key, done)
    assert polls.pending(key) is None


def test_a_send_interrupted_midway_marks_the_wire_unusable(monkeypatch):
    """An exception that is not kvtvm's (Ctrl-C while hashing the pages, a torch error) left
    the header (and, on gloo, the answers' receives) posted with the wire thought usable: the
    next call waited a whole timeout. Now it says the wire is out of step at once; the
    export's lease ended."""
    from kvtvm.manager import BatchItem
    from kvtvm.manager.pageio import PageExport

    from kvtvm.transfer import ACK, READY

    tr = transport([(READY, b""), (ACK, b"")])  # (the answers' receives, posted first)
    mgr = tr.manager
    (s,) = mgr.claim(1)
    mgr.fetch([BatchItem(s, list(range(9)))])
    mgr.step([BatchItem(s, list(range(9)))])
    export = mgr.export_pages(s, defer_checksums=True)

    def interrupted(self, *args):
        raise KeyboardInterrupt
    monkeypatch.setattr(PageExport, "row_checksums", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tr.send(1, export)
    assert export.lease_id not in mgr.active_leases()
    with pytest.raises(TransferError, match="stopped midway"):
        tr.lookup(1, [11])
