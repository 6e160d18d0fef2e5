"""Two processes over gloo (found by a helper fuzzing the transport): four threads sending
sequences to one peer through one DistributedTransport (was: their messages interleaved and
the peer's gloo aborted the process), and an honest send whose early pages the receiver
already holds, in runs of one page (was: refused with an IndexError)."""

import threading

from helpers import run_gloo_pair

from kvtvm import KVCacheParams
from kvtvm.manager import BatchItem, PagedKVCacheManager

P, N = 4, 4


def _manager():
    return PagedKVCacheManager(KVCacheParams("float32", 2, 8, "paged", page_size=P,
                                             enable_prefix_caching=True), 4, 64, 2,
                               num_pages=48)


def _prompt(k):
    return [1000 * k + j for j in range(10 + k)]


def _fill(mgr, s, k):
    """Sequence ``s``'s pages get values of prompt ``k`` (so the receiver can check them)."""
    for i, p in enumerate(mgr.pages_of(s)):
        mgr.blocks[0][p] = float(100 * k + i)


def _worker(rank, out):
    import torch.distributed as dist

    from kvtvm.transfer import DistributedTransport, send_sequence

    mgr = _manager()
    tr = DistributedTransport(timeout=30.0)
    tr.register(mgr)
    if rank == 0:
        seqs = []
        for k in range(N):
            (s,) = mgr.claim(1)
            mgr.fetch([BatchItem(s, _prompt(k))])
            mgr.step([BatchItem(s, _prompt(k))])
            _fill(mgr, s, k)
            seqs.append(s)
        sent = {}

        def go(k):
            try:
                sent[k] = send_sequence(tr, 1, seqs[k], tag=k, timeout=30)
            except Exception as err:  # noqa: BLE001 - reported to the test
                sent[k] = repr(err)

        threads = [threading.Thread(target=go, args=(k,)) for k in range(N)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        out.put(("sent", sent, len(mgr.active_leases())))
        dist.barrier()
        for s in seqs:
            mgr.release(s)
        # the receiver now holds prompt 0's full pages; send it again from page 0, in
        # runs of one page (scattered pages on this side: every other page)
        (a, b) = mgr.claim(2)
        for i in range(len(_prompt(0))):
            for s in (a, b):
                mgr.fetch([BatchItem(s, [_prompt(0)[i]] if s == a else [7 + i])])
                mgr.step([BatchItem(s, [_prompt(0)[i]] if s == a else [7 + i])])
        _fill(mgr, a, 0)
        ex = mgr.export_pages(a, first_page=0, defer_checksums=True)
        assert len(ex.page_runs(0)) == len(mgr.pages_of(a))  # runs of one page
        out.put(("again", tr.send(1, ex, tag=9).wait(30), None))
        # headers the import refuses (another format version; a token id damaged on the
        # way): refused, the runs drained, the wire still in step for the next send
        import dataclasses

        from kvtvm.errors import TransferError
        for tag, edit in ((10, dict(version=2)),
                          (11, dict(tokens=(5,) + ex.header.tokens[1:]))):
            bad = mgr.export_pages(a, first_page=0)
            bad._wire = bad._full = dataclasses.replace(bad.header, **edit)
            try:
                tr.send(1, bad, tag=tag).wait(30)
                out.put(("refused", tag, None))
            except TransferError as err:
                out.put(("refused", tag, str(err)))
        out.put(("after", send_sequence(tr, 1, a, tag=12, timeout=30), None))
        tr.close(1)
    else:
        got = {}
        while True:
            msg = tr.handle(0, lambda h, tag: mgr.claim(1)[0], timeout=60)
            if msg.kind == "close":
                break
            if msg.kind != "pages":
                continue
            if msg.tag in (10, 11):
                got[msg.tag] = (type(msg.error).__name__, str(msg.error))
                continue
            pages = mgr.pages_of(msg.seq_id) if msg.error is None else []
            k = 0 if msg.tag >= 9 else msg.tag
            want = [float(100 * k + i) for i in range(len(pages))]
            vals = [float(mgr.blocks[0][p].flatten()[0]) for p in pages]
            ok = msg.error is None and vals == want and \
                bool(all((mgr.blocks[0][p] == v).all() for p, v in zip(pages, want)))
            got[msg.tag] = (ok, repr(msg.error) if msg.error else None)
            if msg.tag < 9:
                mgr.release(msg.seq_id)
            if len(got) == N:
                dist.barrier()
        st = mgr.stats()
        out.put(("got", got, st.pages_free + st.pages_used + st.pages_cached
                 + st.pages_leased == st.pages_total and st.pages_leased == 0))


def test_threads_sending_to_one_peer_and_a_resend_of_held_pages():
    got = {kind if kind != "refused" else (kind, a): (a, b)
           for kind, a, b in run_gloo_pair(_worker)}
    sent, leases = got["sent"]
    assert leases == 0 and all(isinstance(sent[k], int) for k in range(N)), sent
    assert got["again"][0] == len(_prompt(0)) // P + 1 - len(_prompt(0)) // P  # the new tail
    received, conserved = got["got"]
    assert conserved
    assert all(received[k] == (True, None) for k in [*range(N), 9, 12]), received
    assert received[10][0] == "FormatMismatchError" and "version" in received[10][1]
    assert received[11][0] == "CorruptTransferError" and "tokens" in received[11][1]
    assert "refused" in got["refused", 10][1] and "refused" in got["refused", 11][1]
    assert got["after"][0] == 1  # the peer held the full pages: the tail, the wire in step
