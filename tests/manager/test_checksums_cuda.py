"""The device page checksum on a CUDA cache (issue 17): the same values as on the CPU, a
CUDA cache's headers name it, no page byte is copied to the host to compute it, and an
import into a CUDA cache verifies it on the device (a corrupt page is refused)."""

import pytest
import torch
from helpers import retokened

from kvtvm import KVCacheParams
from kvtvm.errors import CorruptTransferError
from kvtvm.manager import BatchItem, PagedKVCacheManager
from kvtvm.manager.checksums import DEVICE, HOST, page_checksums

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def make(device):
    mgr = PagedKVCacheManager(KVCacheParams("float16", 4, 64, "paged", page_size=16,
                                            enable_prefix_caching=True),
                              2, 256, 4, (device,), num_pages=32)
    g = torch.Generator(device="cpu").manual_seed(0)
    mgr.blocks[0].copy_(torch.randn(mgr.blocks[0].shape, generator=g).to(device))
    return mgr


def test_device_checksum_on_cuda_equals_cpu_and_stays_on_device(monkeypatch):
    x = torch.randn(8, 2, 4, 16, 4, 64, dtype=torch.float16)
    want = page_checksums(x, DEVICE)
    copies = []
    real = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: copies.append(t.shape)
                        or real(t, *a, **k))
    assert page_checksums(x.cuda(), DEVICE) == want
    assert copies == []  # only the 64-bit results come back (through .tolist())


def test_cuda_cache_exports_device_checksums_and_verifies_imports():
    a, b = make("cuda"), make("cuda")
    assert a.checksum_algorithm == DEVICE
    toks = list(range(100, 170))
    (s,) = a.claim(1)
    a.fetch([BatchItem(s, toks)])
    a.step([BatchItem(s, toks)])
    ex = a.export_pages(s)
    assert ex.header.checksum == DEVICE
    assert list(ex.header.checksums) == page_checksums(ex.data.cpu(), DEVICE)
    (t,) = b.claim(1)
    assert b.import_pages(ex.header, ex.data, seq_id=t) == 5
    assert torch.equal(b.blocks[0][b.pages_of(t)], a.blocks[0][a.pages_of(s)])
    bad = ex.data.cpu().clone()  # a host copy, as gloo delivers it: checked on the device
    bad[3].view(-1)[77] += 1
    with pytest.raises(CorruptTransferError, match=f"page 3 fails its {DEVICE}"):
        b.import_pages(retokened(b, ex.header, range(300, 370)), bad)
    c = make("cpu")  # a CPU peer verifies the CUDA cache's pages, and the other way round
    assert c.checksum_algorithm == HOST
    c.import_pages(ex.header, ex.data.cpu())
    a.end_lease(ex.lease_id)
    for m in (a, b, c):
        m.check_invariants()
