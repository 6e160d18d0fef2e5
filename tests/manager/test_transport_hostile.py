"""DistributedTransport between two real processes (gloo on 127.0.0.1) under hostile and
careless conditions: a peer killed by SIGKILL mid-transfer (sender side and receiver side),
two sends in flight where the first is refused, a peer of another format, an export whose
lease ended, sequences of 1 token / one page / max_seq_len. Always: a typed error within the
timeout, ``free + used + cached + leased == total`` with no lease left, and a transport that
either keeps working (the wire in step) or says clearly that it cannot."""

import json
import socket
import subprocess
import sys

COMMON = r'''
import json, os, signal, sys, time
import torch, torch.distributed as dist
from kvtvm import KVCacheParams
from kvtvm.errors import *
from kvtvm.manager import BatchItem, PagedKVCacheManager
import kvtvm.transfer as T

scenario, rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2)

def make(dtype="float16", pages=64, max_len=64):
    m = PagedKVCacheManager(KVCacheParams(dtype, 2, 16, "paged", page_size=4,
                                          enable_prefix_caching=True), 2, max_len, 2,
                            num_pages=pages)
    torch.manual_seed(rank + 10)
    m.blocks[0].copy_(torch.randn(m.blocks[0].shape))
    return m

def seq(m, toks):
    (s,) = m.claim(1)
    m.fetch([BatchItem(s, toks)]); m.step([BatchItem(s, toks)])
    return s

def conserved(m):
    st = m.stats()
    return (st.pages_free + st.pages_used + st.pages_cached + st.pages_leased == st.pages_total
            and st.pages_leased == 0 and not m.active_leases())

def kv(m, s):
    return m.blocks[0][m.pages_of(s)].float().sum().item()

def out(**kw):
    print("RESULT " + json.dumps(kw), flush=True)

def err(e):
    return [type(e).__name__, str(e)[:300]]

def die_on(method, nth):
    """Make the nth call of dist.<method> on this process SIGKILL it (mid-transfer)."""
    real, calls = getattr(dist, method), [0]
    def call(*a, **k):
        calls[0] += 1
        if calls[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **k)
    return call
'''

KILLED_SENDER = r'''
T.CHUNK_BYTES = 512  # one page per data message: the kill lands between them
m = make()
tr = T.DistributedTransport(timeout=3.0)
tr.register(m)
if rank == 0:  # lookup (1 isend), header (2), two runs, then killed
    s = seq(m, list(range(41)))
    tr.dist = type("D", (), {"isend": staticmethod(die_on("isend", 5)),
                             "irecv": staticmethod(dist.irecv)})()
    T.send_sequence(tr, 1, s, timeout=3.0)
else:
    claimed = []
    def seq_for(h, tag):
        claimed.append(m.claim(1)[0])
        return claimed[-1]
    assert tr.handle(0, seq_for, timeout=30).kind == "lookup"
    t0 = time.monotonic()
    try:
        tr.handle(0, seq_for, timeout=30)
        first = None
    except Exception as e:
        first = err(e)
    took = time.monotonic() - t0
    for c in claimed:
        m.release(c)
    try:
        tr.handle(0, seq_for, timeout=3)
        again = None
    except Exception as e:
        again = err(e)
    s = seq(m, list(range(9)))  # the cache stays usable
    out(first=first, took=took, again=again, conserved=conserved(m), used=m.stats().pages_used)
'''

KILLED_RECEIVER = r'''
T.CHUNK_BYTES = 512
m = make()
tr = T.DistributedTransport(timeout=3.0)
tr.register(m)
if rank == 0:
    s = seq(m, list(range(41)))
    t0 = time.monotonic()
    try:
        T.send_sequence(tr, 1, s, timeout=3.0)
        first = None
    except Exception as e:
        first = err(e)
    took = time.monotonic() - t0
    leases = len(m.active_leases())
    try:
        tr.lookup(1, m.block_hashes_of(s))
        again = None
    except Exception as e:
        again = err(e)
    m.release(s)
    out(first=first, took=took, leases=leases, again=again, conserved=conserved(m))
else:  # the lookup's answer (1 irecv), the header (2), two runs, then killed
    tr.dist = type("D", (), {"irecv": staticmethod(die_on("irecv", 5)),
                             "isend": staticmethod(dist.isend)})()
    while True:
        tr.handle(0, None, timeout=30)
'''

CARELESS = r'''
m = make(pages=64 if rank == 0 else 17)
tr = T.DistributedTransport(timeout=10.0)
tr.register(m)
LENGTHS = [1, 4, 5, 63, 64]
if rank == 0:
    res = {}
    # two sends in flight; the first refused (11 pages, the peer has 9 free), the second not
    big, small = seq(m, list(range(1000, 1041))), seq(m, list(range(2000, 2005)))
    t1 = tr.send(1, m.export_pages(big, defer_checksums=True), tag=1)
    t2 = tr.send(1, m.export_pages(small, defer_checksums=True), tag=2)
    for name, t in (("t2", t2), ("t1", t1)):  # t1's answer came first, is read last
        try:
            res[name] = t.wait(10)
        except Exception as e:
            res[name] = err(e)
    res["small_kv"] = kv(m, small)
    # a peer of another format: refused with the field named, then the wire is in step
    other = make("float32")
    tr.register(other)
    o = seq(other, list(range(3000, 3009)))
    try:
        res["mismatch"] = T.send_sequence(tr, 1, o, tag=3, timeout=10)
    except Exception as e:
        res["mismatch"] = err(e)
    res["other_conserved"] = conserved(other)
    tr.register(m)
    # an export whose lease ended before the send: refused before anything is sent
    ex = m.export_pages(big, defer_checksums=True, timeout=5)
    m.expire_leases(now=time.monotonic() + 60)
    try:
        res["expired"] = tr.send(1, ex, tag=4).wait(10)
    except Exception as e:
        res["expired"] = err(e)
    m.release(big), m.release(small)
    # lengths off and on the page grid, 1 token, max_seq_len
    res["lengths"] = []
    for i, n in enumerate(LENGTHS):
        s = seq(m, [5000 + 100 * i + j for j in range(n)])
        res["lengths"].append([T.send_sequence(tr, 1, s, tag=10 + i, timeout=10), kv(m, s)])
        m.release(s)
    tr.close(1)
    res["conserved"] = conserved(m)
    out(**res)
else:
    res, got = {"refused": [], "received": {}}, {}
    filler = seq(m, list(range(9000, 9032)))  # 8 of the 17 pages, until the first sends
    while True:
        claimed = []
        def seq_for(h, tag):
            claimed.append(m.claim(1)[0])
            return claimed[-1]
        msg = tr.handle(0, seq_for, timeout=30)
        if msg.kind == "close":
            break
        if msg.kind != "pages":
            continue
        if msg.error is not None:
            res["refused"].append([msg.tag, type(msg.error).__name__])
            for c in claimed:
                m.release(c)
            continue
        s = msg.seq_id
        res["received"][msg.tag] = [kv(m, s)]
        if len(m.pages_of(s)) * 4 > len(msg.header.tokens) or len(msg.header.tokens) < 64:
            m.fetch([BatchItem(s, [7])]); m.step([BatchItem(s, [7])])  # decoding goes on
        m.release(s)
        if msg.tag == 2:
            m.release(filler)
        if not conserved(m):
            res["leak_after"] = msg.tag
    res["conserved"] = conserved(m)
    out(**res)
'''

LATE_PEER = r'''
import threading
T.CHUNK_BYTES = 512
m = make(pages=16 if rank == 1 else 64)
tr = T.DistributedTransport(timeout=10.0)
tr.register(m)
if rank == 0:
    # 1. the runs come late (a reaper on the peer meanwhile)
    s = seq(m, list(range(41)))  # 11 pages, one message each
    real, calls = dist.isend, [0]
    def late(*a, **k):  # the lookup (1), the header (2), then every run comes late
        calls[0] += 1
        if calls[0] == 3:
            time.sleep(1.5)
        return real(*a, **k)
    tr.dist = type("D", (), {"isend": staticmethod(late), "irecv": staticmethod(dist.irecv)})()
    try:
        sent = T.send_sequence(tr, 1, s, timeout=10)
    except Exception as e:
        sent = err(e)
    tr.dist = dist
    res = dict(sent=sent, kv=kv(m, s))
    m.release(s)
    # 2. the acknowledgement comes late: a short wait times out, the transfer goes on
    s = seq(m, list(range(100, 141)))
    t = tr.send(1, m.export_pages(s, defer_checksums=True), tag=1)
    t0 = time.monotonic()
    try:
        res["first"] = t.wait(0.3)
    except Exception as e:
        res["first"] = err(e)
    res["took"] = time.monotonic() - t0
    res["leased"] = m.stats().pages_leased  # still in flight: the lease holds
    res["second"] = t.wait(10)
    res["again"] = tr.lookup(1, m.block_hashes_of(s))  # the wire is in step
    m.release(s)
    out(conserved=conserved(m), **res)
else:
    box = {}
    def meddle():  # while the runs are due: a reaper ends leases, a request takes pages
        time.sleep(0.7)
        box["expired"] = m.expire_leases(now=time.monotonic() + 1000)
        other = seq(m, list(range(700, 720)))  # 5 pages
        m.blocks[0][m.pages_of(other)] = 0
        box["other"] = other
    th = threading.Thread(target=meddle)
    th.start()
    assert tr.handle(0, None, timeout=30).kind == "lookup"
    claimed = []
    msg = tr.handle(0, lambda h, t: claimed.append(m.claim(1)[0]) or claimed[-1], timeout=30)
    th.join()
    other = box["other"]
    res = dict(error=None if msg.error is None else err(msg.error), expired=box["expired"],
               kv=None if msg.error is not None else kv(m, msg.seq_id),
               other_nonzero=int((m.blocks[0][m.pages_of(other)] != 0).sum()))
    m.release(other)
    if msg.seq_id is not None:
        m.release(msg.seq_id)
    finish = m.finish_import
    def slow(*a, **k):  # the import takes a while: the acknowledgement comes late
        time.sleep(1.5)
        return finish(*a, **k)
    m.finish_import = slow
    msg = tr.handle(0, None, timeout=30)
    res["late_ack_error"] = None if msg.error is None else err(msg.error)
    tr.handle(0, None, timeout=30)
    out(**res)
'''


def run_pair(tmp_path, scenario: str, body: str, timeout: float = 90) -> dict:
    """Run ``body`` in two processes (ranks 0 and 1); returns {rank: RESULT dict or None}
    and their exit codes."""
    script = tmp_path / f"{scenario}.py"
    script.write_text(COMMON + body)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(script), scenario, str(r), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    results, codes = {}, {}
    try:
        for r, p in enumerate(procs):
            stdout, stderr = p.communicate(timeout=timeout)
            codes[r] = p.returncode
            lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
            results[r] = json.loads(lines[-1][7:]) if lines else None
            if results[r] is None:
                results[r] = {"stderr": stderr[-3000:]}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results, codes


def test_sender_killed_mid_transfer(tmp_path):
    """Was: nothing wrong on this side, but a second handle() raised gloo's bare
    RuntimeError (untyped) instead of saying the transport is unusable."""
    res, codes = run_pair(tmp_path, "killed_sender", KILLED_SENDER)
    assert codes[0] == -9
    got = res[1]
    assert "first" in got, got
    assert got["first"][0] == "TransferTimeoutError" and got["took"] < 3.5, got
    assert got["again"][0] == "TransferError" and "unusable" in got["again"][1], got
    assert got["conserved"] and got["used"] == 3


def test_receiver_killed_mid_transfer(tmp_path):
    """Was: send() raised out of send_sequence before its lease was in the try, so the
    export lease stayed open (11 pages leased for good), and the next call raised gloo's
    untyped RuntimeError."""
    res, codes = run_pair(tmp_path, "killed_receiver", KILLED_RECEIVER)
    assert codes[1] == -9
    got = res[0]
    assert "first" in got, got
    assert got["first"][0] == "TransferTimeoutError" and got["took"] < 3.5, got
    assert got["leases"] == 0, got
    assert got["again"][0] == "TransferError" and "unusable" in got["again"][1], got
    assert got["conserved"]


def test_refusals_in_flight_other_formats_expired_leases_and_lengths(tmp_path):
    """Was: with two sends in flight both acknowledgements landed in one shared buffer, so
    the refused first send, waited for last, reported the second one's success (2 pages
    written); a refusal
    reached the sender as a bare 'refused' TransferError without the peer's reason."""
    res, codes = run_pair(tmp_path, "careless", CARELESS)
    assert codes == {0: 0, 1: 0}, res
    snd, rcv = res[0], res[1]
    assert "t1" in snd and "refused" in rcv, res
    assert isinstance(snd["t1"], list) and snd["t1"][0] == "TransferError", snd
    assert "KVCacheCapacityError" in snd["t1"][1] and "11 new pages" in snd["t1"][1]
    assert snd["t2"] == 2
    assert rcv["received"]["2"][0] == snd["small_kv"]  # byte sums equal: the right pages
    assert snd["mismatch"][0] == "FormatMismatchError" and "field dtype" in snd["mismatch"][1]
    assert snd["other_conserved"]
    assert snd["expired"][0] == "TransferError" and "lease" in snd["expired"][1]
    assert [t for t, _ in rcv["refused"]] == [1, 3]  # the expired export never went out
    assert [n for n, _ in snd["lengths"]] == [1, 1, 2, 16, 16]
    for i, (_, total) in enumerate(snd["lengths"]):
        assert rcv["received"][str(10 + i)][0] == total
    assert snd["conserved"] and rcv["conserved"] and "leak_after" not in rcv


def test_late_runs_and_a_late_acknowledgement(tmp_path):
    """1. Was: handle() gave the import lease a deadline, so a reaper's expire_leases() ended
    it while the runs were still due: its pages went back to the free list, another sequence
    took them, and the late runs overwrote that sequence's K/V (2560 values here).
    2. Transfer.wait(0.3) on a transport with a 10 s timeout blocked until the late
    acknowledgement (1.5 s) instead of raising after 0.3 s; now the transfer stays in flight
    (its lease held) and a later wait gets the answer, the wire in step."""
    res, codes = run_pair(tmp_path, "late_peer", LATE_PEER)
    assert codes == {0: 0, 1: 0}, res
    snd, rcv = res[0], res[1]
    assert "other_nonzero" in rcv, res
    assert rcv["other_nonzero"] == 0  # nobody else's K/V was written
    assert rcv["expired"] == [] and rcv["error"] is None
    assert snd["sent"] == 11 and rcv["kv"] == snd["kv"]
    assert isinstance(snd["first"], list) and snd["first"][0] == "TransferTimeoutError", snd
    assert snd["took"] < 1.2 and snd["leased"] == 11
    assert snd["second"] == 11 and snd["again"] == 10 and snd["conserved"]
    assert rcv["late_ack_error"] is None


CRAFTED = r'''
import dataclasses
import numpy as np
m = PagedKVCacheManager(KVCacheParams("float16", 2, 16, "paged", page_size=4,
                                      enable_prefix_caching=True, cache_dtype="int8"),
                        2, 64, 2, num_pages=64)  # (8-bit pages travel as bytes)
tr = T.DistributedTransport(timeout=5.0)
tr.register(m)
if rank == 0:
    s = seq(m, list(range(10)))
    ex = m.export_pages(s)
    res = {}
    # (1) checksums after the data, in a message of 7 bytes: not whole uint64 values
    hdr = ex.header._replace_checksums(None)
    raw = hdr.to_bytes()
    tr._send_msg(1, T.PAGES, 0, T._LEN.pack(len(raw)) + raw
                 + np.asarray([hdr.n_carried], np.int64).tobytes(), "header")
    tr._recv_msg(1, "ready")
    for _, v in ex.page_runs(0):
        tr._isend(v, 1, "data").wait()
    tr._send_msg(1, T.SUMS, 0, b"\x01" * 7, "sums")
    try:
        T._read_ack(tr._expect(1, T.ACK, "ack")[1])
        res["sums"] = None
    except Exception as e:
        res["sums"] = err(e)
    # (2) a header whose page size no buffer can hold: the receiver cannot drain the runs
    raw2 = dataclasses.replace(ex.header, page_bytes=1 << 44).to_bytes()
    tr._send_msg(1, T.PAGES, 1, T._LEN.pack(len(raw2)) + raw2
                 + np.asarray([hdr.n_carried], np.int64).tobytes(), "header")
    tr._recv_msg(1, "ready")
    out(**res)
    time.sleep(2)
else:
    r = tr.handle(0, timeout=20)
    got = {"sums": err(r.error) if r.error is not None else None}
    try:
        tr.handle(0, timeout=20)
        got["huge"] = None
    except Exception as e:
        got["huge"] = err(e)
    got["broken"] = bool(tr._broken)
    got["conserved"] = conserved(m)
    out(**got)
'''


def test_crafted_checksums_and_page_sizes_are_typed(tmp_path):
    """A checksum message of 7 bytes was a bare ValueError (the sender's a generic
    TransferError); a header whose page size no buffer holds raised torch's RuntimeError and
    left the wire looking usable."""
    results, _ = run_pair(tmp_path, "crafted", CRAFTED)
    send, recv = results[0], results[1]
    assert recv["sums"][0] == "CorruptTransferError" and "7 bytes" in recv["sums"][1]
    assert send["sums"][0] == "CorruptTransferError"
    assert recv["huge"][0] == "CorruptTransferError" and recv["broken"]
    assert recv["conserved"]
