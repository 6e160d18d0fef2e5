"""DistributedTransport between two processes (gloo on 127.0.0.1), one run shared by the tests:
bad peer ranks refused by name before anything is posted, an idle ``handle()`` that times out
and keeps working, the peer's ints returned by ``handle()``, the ``seq_id`` of a refused
import, NCCL's order of operations (emulated on gloo) with several sends and a lookup in
flight, and two ranks sending to each other at once (a process group of its own, which that
breaks), and an exit with a handle() receive still posted while the peer exits. Each phase
ends with the wire in step, checked by a good transfer."""

import pytest
from test_transport_hostile import COMMON, run_pair

N_BAD = 7  # peers 5, -1, the own rank, "1", True, 1.0, None

PEERS = r'''
import atexit
import gc
FLAG = sys.argv[0] + ".exiting"
if rank == 1:  # the last exit handler: the peer exits (closes the connections) then
    atexit.register(lambda: open(FLAG, "w").close())
m = make(pages=64 if rank == 0 else 17)
tr = T.DistributedTransport(timeout=5.0)
tr.register(m)
side = dist.new_group([0, 1])  # for the last phase, whose two-way sends break its wire
BAD = [5, -1, rank, "1", True, 1.0, None]

def attempt(f):
    try:
        return f()
    except Exception as e:
        return err(e)

if rank == 0:
    res = {"refused": [], "after": []}
    s = seq(m, list(range(9)))
    hashes = m.block_hashes_of(s)
    calls = {
        "send": lambda p: tr.send(p, m.export_pages(s, defer_checksums=True)).wait(5),
        "lookup": lambda p: tr.lookup(p, hashes),
        "handle": lambda p: tr.handle(p, timeout=1),
        "send_ints": lambda p: tr.send_ints(p, [1]),
        "recv_ints": lambda p: tr.recv_ints(p, 1, timeout=1),
        "close": lambda p: tr.close(p),
        "send_sequence": lambda p: T.send_sequence(tr, p, s, timeout=5),
    }
    for name, call in calls.items():
        for bad in BAD:
            got = attempt(lambda: call(bad))
            res["refused"].append([name, repr(bad), got, tr._broken, len(m.active_leases())])
        res["after"].append(tr.lookup(1, hashes))  # a good round trip after the refusals
    res["sent"] = T.send_sequence(tr, 1, s, tag=1, timeout=5)
    tr.close(1)
    m.release(s)
    # (2) the peer polls while nothing comes; then ints, a refused import, a good one
    dist.barrier(group=side)
    tr.send_ints(1, [7, 8, 9])
    big = seq(m, list(range(500, 564)))  # 16 pages: more than the peer has room for
    res["big"] = attempt(lambda: tr.send(1, m.export_pages(big, defer_checksums=True),
                                         tag=5).wait(5))
    res["big_again"] = attempt(lambda: T.send_sequence(tr, 1, big, tag=6, timeout=5))
    tr.close(1)
    m.release(big)
    # (3) NCCL's order (no READY, the acknowledgement's receive posted after the data)
    tn = T.DistributedTransport(timeout=5.0)
    tn._gloo_order = False
    tn.register(m)
    big, small = seq(m, list(range(1000, 1041))), seq(m, list(range(2000, 2005)))
    t1 = tn.send(1, m.export_pages(big, defer_checksums=True), tag=1)  # refused (room)
    t2 = tn.send(1, m.export_pages(small, defer_checksums=True), tag=2)
    res["t2"] = attempt(lambda: t2.wait(5))  # waited first: was t1's refusal
    res["t1"] = attempt(lambda: t1.wait(5))
    m.release(big), m.release(small)
    s3 = seq(m, list(range(3000, 3009)))
    t3 = tn.send(1, m.export_pages(s3, defer_checksums=True), tag=3)
    res["lookup_in_flight"] = attempt(lambda: tn.lookup(1, m.block_hashes_of(s3)))  # was ACK
    polls = 0
    while not t3.poll():  # the acknowledgement awaited on the helper thread
        polls += 1
        time.sleep(0.001)
    res["t3"] = attempt(lambda: t3.wait(5))
    m.release(s3)
    tn.close(1)
    res["nccl_leases"] = len(m.active_leases())
else:
    res = {}
    claimed = []
    def seq_for(h, tag):
        claimed.append(m.claim(1)[0])
        return claimed[-1]
    def serve(t, filler=None):
        log = []
        while True:
            r = t.handle(0, seq_for, timeout=5)
            if r.kind == "close":
                return log
            log.append([r.kind, r.tag, r.pages_written,
                        None if r.error is None else type(r.error).__name__])
            if r.error is not None and filler is not None:
                m.release(filler)
                filler = None
            if r.seq_id is not None:
                m.release(r.seq_id)
    res["served"] = serve(tr)
    # (2) nothing comes: each poll times out, the transport stays usable
    res["polls"] = [attempt(lambda: tr.handle(0, seq_for, timeout=0.2)),
                    attempt(lambda: tr.recv_ints(0, 3, timeout=0.2))]
    res["pending_lookup"] = attempt(lambda: tr.lookup(0, [1, 2]))  # its answer would be lost
    res["broken_after_polls"] = tr._broken
    del tr  # dropped with its poll posted: a new transport of the group takes the poll over
    gc.collect()
    tr = T.DistributedTransport(timeout=5.0)
    tr.register(m)
    dist.barrier(group=side)
    r = tr.handle(0, seq_for, timeout=5)
    res["ints"] = [r.kind, r.ints]
    filler = seq(m, list(range(9000, 9032)))  # 8 of the 17 pages
    claimed.clear()
    r = tr.handle(0, seq_for, timeout=5)
    res["refused_import"] = [type(r.error).__name__, r.seq_id, list(claimed),
                             r.seq_id is not None and m.contains(r.seq_id)
                             and not m.pages_of(r.seq_id)]
    m.release(filler)
    if r.seq_id is not None:
        m.release(r.seq_id)
    res["served2"] = serve(tr)
    # (3) NCCL's order; its small sends complete at once (the ACK does not wait for the
    # sender's receive)
    tn = T.DistributedTransport(timeout=5.0)
    tn._gloo_order = False
    tn.register(m)
    keep = []
    tn._ack = lambda peer, status, n, e=None: keep.append(tn._send_msg(
        peer, T.ACK, 0, T._ack_payload(status, n, e), "ack", wait=False))
    res["nccl"] = serve(tn, seq(m, list(range(9100, 9132))))  # 8 of the 17 pages
res["conserved"] = conserved(m)
res["broken"] = tr._broken
# (4) both ranks send to each other at once, on a group of their own
tb = T.DistributedTransport(side, timeout=5.0)
tb.register(m)
s = seq(m, [7000 + 100 * rank + j for j in range(10)])
ex = m.export_pages(s, defer_checksums=True)
dist.barrier(group=side)
res["both"] = attempt(lambda: tb.send(1 - rank, ex, tag=9).wait(5))
res["both_leases"] = len(m.active_leases())
m.release(s)
if rank == 1:  # (5) exits with a handle() receive still posted; the peer exits meanwhile
    res["last_poll"] = attempt(lambda: tr.handle(0, timeout=0.2))
out(**res)
dist.barrier()
if rank == 0:  # (woken after the interpreter's exit handlers, the receive's thread aborted
    # the process: "terminate called without an active exception")
    deadline = time.monotonic() + 20
    while not os.path.exists(FLAG) and time.monotonic() < deadline:
        time.sleep(0.001)
    os._exit(0)
'''


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    res, codes = run_pair(tmp_path_factory.mktemp("peers"), "peers", PEERS, timeout=60)
    assert codes == {0: 0, 1: 0}, res
    assert "refused" in res[0] and "served" in res[1], res
    return res[0], res[1]


def test_bad_peer_is_refused_by_name_before_anything_is_posted(peers):
    """Was: peer 5 segfaulted inside gloo, -1 and the own rank hung in irecv (or sent to
    itself and called the peer gone, the transport disabled), "1" a bare TypeError."""
    snd, rcv = peers
    assert len(snd["refused"]) == 7 * N_BAD
    for name, bad, got, broken, leases in snd["refused"]:
        assert got is not None and got[0] == "InvalidArgumentError", (name, bad, got)
        assert got[1].startswith("peer: ") and "(0..1) other than its own (0)" in got[1]
        assert broken is None and leases == 0, (name, bad)  # usable; the export's lease ended
    assert snd["after"] == [0] * 7  # a good lookup after each call's refusals
    assert snd["sent"] == 3
    assert rcv["served"] == [["lookup", 0, 0, None]] * 8 + [["pages", 1, 3, None]]


def test_idle_handle_times_out_and_the_transport_stays_usable(peers):
    """Was: handle(peer, timeout=0.2) with nothing arriving timed out inside gloo, which
    closed the connection: the transport was unusable for good."""
    snd, rcv = peers
    for got in rcv["polls"]:
        assert got[0] == "TransferTimeoutError" and "stays usable" in got[1], got
    assert rcv["pending_lookup"][0] == "TransferError"
    assert "handle() of its messages is pending" in rcv["pending_lookup"][1]
    assert rcv["broken_after_polls"] is None
    # the ints a later handle took -- of a transport made after the polling one was dropped
    # (the dropped one's receive, left posted, took them before)
    assert rcv["ints"] == ["ints", [7, 8, 9]]


def test_handle_returns_ints_and_a_refused_import_names_its_sequence(peers):
    """Was: ints where handle() waited raised 'unexpected message kind 5' (the wire broken);
    a refused import's Received had seq_id None although seq_for had claimed one."""
    snd, rcv = peers
    error, seq_id, claimed, empty = rcv["refused_import"]
    assert error == "KVCacheCapacityError" and claimed == [seq_id] and empty
    assert snd["big"][0] == "TransferError" and "KVCacheCapacityError" in snd["big"][1]
    assert snd["big_again"] == 16
    assert rcv["served2"] == [["lookup", 0, 0, None], ["pages", 6, 16, None]]


def test_nccl_order_each_acknowledgement_lands_in_its_own_receive(peers):
    """Was (NCCL, emulated): the acknowledgement's receive was posted when first waited on,
    so t2 (waited first) took t1's refusal, and a lookup while a send was unacknowledged
    took the acknowledgement ('expected lookup answer (kind 2), got kind 4')."""
    snd, rcv = peers
    assert snd["t2"] == 2
    assert snd["t1"][0] == "TransferError" and "KVCacheCapacityError" in snd["t1"][1]
    assert snd["lookup_in_flight"] == 2 and snd["t3"] == 3
    assert [m[0] for m in rcv["nccl"]] == ["pages", "pages", "pages", "lookup"]
    assert snd["nccl_leases"] == 0 and snd["conserved"] and rcv["conserved"]
    assert snd["broken"] is None and rcv["broken"] is None


def test_both_ranks_sending_at_once_names_the_cause(peers):
    """Was: 'expected ready (kind 8), got kind 3', no hint of the cause."""
    for side in peers:
        assert side["both"][0] == "CorruptTransferError", side["both"]
        assert "One initiator per rank pair" in side["both"][1]
        assert side["both_leases"] == 0
    assert peers[1]["last_poll"][0] == "TransferTimeoutError"
