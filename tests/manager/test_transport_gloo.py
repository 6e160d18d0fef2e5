"""DistributedTransport between two processes over gloo (issue 17): the checksums sent after
the data (computed while it is on the wire) or with the header, the device checksum algorithm
on CPU caches, and a corrupt checksum message refused with nothing registered or leaked."""

import hashlib

import pytest
import torch
from helpers import run_gloo_pair

from kvtvm import KVCacheParams
from kvtvm.manager import BatchItem, PagedKVCacheManager

# every case: (checksum algorithm, checksums computed at export (in the header) rather than
# while the data is on the wire (a message after it), corrupt the checksum message)
CASES = [("xxh3", False, False), ("xxh3", True, False), ("device", False, False),
         ("device", False, True)]


def _manager():
    mgr = PagedKVCacheManager(KVCacheParams("float16", 4, 32, "paged", page_size=4,
                                            enable_prefix_caching=True),
                              2, 128, 2, num_pages=64)
    torch.manual_seed(0)
    mgr.blocks[0].copy_(torch.randn(mgr.blocks[0].shape))
    return mgr


def _digest(t) -> str:
    """The bytes' sha256 (small: a full pipe would block the worker before the join)."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _worker(rank, out):
    import torch.distributed as dist

    from kvtvm.errors import TransferError
    from kvtvm.manager.checksums import DEVICE
    from kvtvm.transfer import DistributedTransport

    mgr = _manager()
    tr = DistributedTransport(timeout=60.0)
    tr.register(mgr)
    for i, (alg, early, corrupt) in enumerate(CASES):
        toks = [1000 * i + j for j in range(41)]  # 10 full pages + 1 token
        if alg == "device":
            mgr.checksum_algorithm = DEVICE
        if rank == 0:
            (s,) = mgr.claim(1)
            mgr.fetch([BatchItem(s, toks)])
            mgr.step([BatchItem(s, toks)])
            ex = mgr.export_pages(s, defer_checksums=not early)
            assert (ex.wire_header.checksums is None) != early
            if corrupt:
                real = ex.row_checksums
                ex.row_checksums = lambda row, run: [c ^ 1 for c in real(row, run)]
            try:
                n = tr.send(1, ex, tag=i).wait(60.0)
                out.put(("sent", i, n, None))
            except TransferError as err:
                out.put(("sent", i, -1, str(err)))
            kv = _digest(mgr.blocks[0][mgr.pages_of(s)])
            out.put(("kv", i, kv, None))
            mgr.release(s)
            mgr.end_lease(ex.lease_id)
        else:
            msg = tr.handle(0, lambda h, tag: mgr.claim(1)[0])
            kv = None
            if msg.error is None:
                kv = _digest(mgr.blocks[0][mgr.pages_of(msg.seq_id)])
                assert msg.header.checksum == mgr.checksum_algorithm
                mgr.release(msg.seq_id)
            st = mgr.stats()
            out.put(("got", i, kv, (type(msg.error).__name__ if msg.error else None,
                                    st.pages_leased, st.pages_cached,
                                    st.pages_free + st.pages_used + st.pages_cached
                                    + st.pages_leased == st.pages_total)))
        dist.barrier()


@pytest.mark.slow
def test_gloo_transfer_checksums_after_data_device_algorithm_and_corruption():
    got = {(kind, i): (a, b) for kind, i, a, b in run_gloo_pair(_worker)}
    cached = 0
    for i, (alg, early, corrupt) in enumerate(CASES):
        n, err = got["sent", i]
        kv, (error, leased, now_cached, conserved) = got["got", i]
        assert conserved and leased == 0, i
        if corrupt:
            assert n == -1 and "refused" in err and error == "CorruptTransferError"
            assert now_cached == cached  # nothing registered
        else:
            assert n == 11 and err is None and error is None, i
            assert kv == got["kv", i][0], i  # byte-exact
            cached += 10
            assert now_cached == cached
