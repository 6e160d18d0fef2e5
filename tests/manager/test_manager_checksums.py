"""Page checksums (issue 17): the device algorithm ``poly16-m31x2`` against a pure-Python
reference, its detection of single-word errors, run on CPU caches through the same code path a
CUDA cache uses (header names it, import verifies it, a mismatch is refused and writes
nothing), and quantized pages resharded over a different head split byte for byte."""

import dataclasses

import numpy as np
import pytest
import torch
from helpers import retokened, run_prompt

from kvtvm import KVCacheParams
from kvtvm.errors import CorruptTransferError, FormatMismatchError, InvalidArgumentError
from kvtvm.manager import BatchItem, PagedKVCacheManager
from kvtvm.manager.checksums import DEVICE, HOST, algorithm_for, page_checksums
from kvtvm.manager.pagelayout import join_quant_rows, split_quant_rows

P, L = 4, 2
MOD = (1 << 31) - 1


def reference(page: torch.Tensor) -> int:
    """The documented formula, in Python integers."""
    raw = page.contiguous().view(torch.uint8).flatten().numpy().tobytes()
    if len(raw) % 2:
        raw += b"\0"
    words = np.frombuffer(raw, "<u2").tolist()
    out = []
    for g in (7, 16807):
        h, gp = 0, g
        for w in words:
            h, gp = (h + w * gp) % MOD, gp * g % MOD
        out.append(h)
    return out[0] << 32 | out[1]


def test_device_checksum_matches_the_formula_and_sees_every_word():
    rng = np.random.default_rng(1)
    pages = torch.from_numpy(rng.standard_normal((3, 2, L, P, 2, 5)).astype(np.float16))
    assert page_checksums(pages, DEVICE) == [reference(p) for p in pages]
    odd = torch.from_numpy(rng.integers(0, 256, (2, 9), dtype=np.uint8))  # odd byte count
    assert page_checksums(odd, DEVICE) == [reference(p) for p in odd]
    assert page_checksums(list(pages), DEVICE) == page_checksums(pages, DEVICE)
    base = page_checksums(pages[:1], DEVICE)[0]
    words = pages[:1].clone().view(torch.int16).view(-1)
    for i in rng.choice(words.numel(), 40, replace=False):  # any single-word error is seen
        bad = words.clone()
        bad[i] ^= int(rng.integers(1, 1 << 15))
        assert page_checksums(bad.view(pages[:1].shape), DEVICE)[0] != base
    assert algorithm_for("cuda:0") == DEVICE and algorithm_for("cpu") == HOST
    with pytest.raises(ValueError, match="unknown"):
        page_checksums(pages, "crc7")


def make(devices=("cpu",), pages=16, **params):
    kw = dict(dtype="float32", n_kv_heads=4, head_dim=8)
    kw.update(params)
    mgr = PagedKVCacheManager(
        KVCacheParams(kw.pop("dtype"), kw.pop("n_kv_heads"), kw.pop("head_dim"), "paged",
                      page_size=P, enable_prefix_caching=True, **kw),
        4, 64, L, devices, num_pages=pages)
    for b in mgr.blocks:
        if b.dtype == torch.uint8:
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8))
        else:
            b.copy_(torch.randn(b.shape))
    return mgr


def conserved(mgr):
    st = mgr.stats()
    assert st.pages_free + st.pages_used + st.pages_cached + st.pages_leased == st.pages_total
    mgr.check_invariants()


def test_device_algorithm_on_cpu_caches_named_verified_and_refused_on_mismatch():
    a, b = make(), make()
    a.checksum_algorithm = DEVICE  # what a CUDA cache uses, here on CPU tensors
    assert b.checksum_algorithm == HOST
    s = run_prompt(a, list(range(10)))
    ex = a.export_pages(s, defer_checksums=True)
    assert ex.wire_header.checksums is None  # computed when needed
    assert ex.header.checksum == DEVICE
    assert list(ex.header.checksums) == [reference(p) for p in ex.data]
    assert ex.wire_header == ex.header
    # a receiver on the host algorithm verifies whichever known algorithm the header names
    (t,) = b.claim(1)
    assert b.import_pages(ex.header, ex.data, seq_id=t) == 3
    assert torch.equal(b.blocks[0][b.pages_of(t)], a.blocks[0][a.pages_of(s)])
    conserved(b)
    snapshot = [x.clone() for x in b.blocks]
    before = b.stats()
    # the same bytes under another (known) algorithm name: the sums do not match -> refused
    other = dataclasses.replace(retokened(b, ex.header, range(50, 60)), checksum=HOST)
    with pytest.raises(CorruptTransferError, match=HOST):
        b.import_pages(other, ex.data)
    # a corrupt page under the device algorithm: refused, named
    bad = ex.data.clone()
    bad[2].view(-1)[5] += 1.0
    with pytest.raises(CorruptTransferError, match=f"page 2 fails its {DEVICE}"):
        b.import_pages(retokened(b, ex.header, range(70, 80)), bad)
    # an unknown algorithm: a format mismatch naming the field and the value
    with pytest.raises(FormatMismatchError, match="checksum.*crc7"):
        b.import_pages(dataclasses.replace(ex.header, checksum="crc7"), ex.data)
    assert all(torch.equal(x, y) for x, y in zip(snapshot, b.blocks))
    assert b.stats() == before and not b.active_leases()
    conserved(b)
    with pytest.raises(InvalidArgumentError, match="checksum_algorithm"):
        a.checksum_algorithm = "crc7"
    a.end_lease(ex.lease_id)
    conserved(a)


@pytest.mark.parametrize("quant", [dict(cache_dtype="int8"),
                                   dict(k_cache_dtype="float8_e4m3fn"),  # mixed rows
                                   dict(cache_dtype="int8", skip_layers=(1,))])
@pytest.mark.parametrize("src,dst", [(1, 2), (2, 1), (2, 4), (4, 1)])
def test_quantized_pages_reshard_byte_exact(quant, src, dst):
    kw = dict(dtype="float16", n_kv_heads=4, head_dim=16, **quant)
    a, b = make(("cpu",) * src, **kw), make(("cpu",) * dst, **kw)
    toks = list(range(5, 19))  # 3 full pages + 2 tokens
    s = run_prompt(a, toks)
    ex = a.export_pages(s)
    pages = a.pages_of(s)
    # the full-head byte rows the header describes, joined from the source's devices
    full = join_quant_rows([blk[pages] for blk in a.blocks], a.params, L)
    assert tuple(ex.data.shape) == (4, a.params.bytes_per_page(L)) == tuple(full.shape)
    assert torch.equal(ex.data, full)
    (t,) = b.claim(1)
    assert b.import_pages(ex.header, ex.data, seq_id=t) == 4
    parts = split_quant_rows(full, b.params, L, dst)
    got = [blk[b.pages_of(t)] for blk in b.blocks]
    assert all(torch.equal(x, y) for x, y in zip(got, parts))
    assert torch.equal(join_quant_rows(got, b.params, L), full)
    # and back: the destination's export is the source's bytes
    ex2 = b.export_pages(t)
    assert ex2.header.checksums == ex.header.checksums
    c = make(("cpu",) * src, **kw)
    (u,) = c.claim(1)
    c.import_pages(ex2.header, ex2.data, seq_id=u)
    assert all(torch.equal(x[c.pages_of(u)], y[pages]) for x, y in zip(c.blocks, a.blocks))
    # a (token, head) row moves whole: values, scale and padding of head h of device d
    if src == 1 and dst == 2 and "cache_dtype" in quant:
        row = b.params.row_bytes("int8")
        seg = full[0, :P * 4 * row].view(P, 4, row)
        assert torch.equal(got[1][0, :P * 2 * row].view(P, 2, row), seg[:, 2:4])
    for m in (a, b, c):
        conserved(m)


def test_quantized_tiers_on_split_heads_round_trip():
    kw = dict(dtype="float16", n_kv_heads=4, head_dim=16, cache_dtype="int8")
    a = make(("cpu", "cpu"), pages=5, **kw)
    a.attach_tiers(host_pages=8)
    toks = list(range(100, 116))  # 4 full pages
    s = run_prompt(a, toks + [1])
    want = [blk[a.pages_of(s)[:4]].clone() for blk in a.blocks]
    a.release(s)
    (t,) = a.claim(1)
    a.fetch([BatchItem(t, list(range(300, 320)))])  # evicts the cached pages: demoted
    a.step([BatchItem(t, list(range(300, 320)))])
    a.release(t)
    assert a.stats().tiers["host"]["demotions"] >= 4
    (u,) = a.claim(1)
    inp = a.fetch([BatchItem(u, toks + [2])])[0]  # promoted back from the host tier
    assert list(inp.num_cached_tokens) == [16]
    got = [blk[a.pages_of(u)[:4]] for blk in a.blocks]
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    conserved(a)


def test_deferred_checksums_refused_once_the_lease_ended():
    a = make()
    s = run_prompt(a, list(range(9)))
    ex = a.export_pages(s, defer_checksums=True)
    assert ex.wire_header.checksums is None
    first = ex.row_checksums(0, ex.data[:1])  # under the lease: fine
    assert a.end_lease(ex.lease_id)
    from kvtvm.errors import TransferError
    with pytest.raises(TransferError, match="lease"):
        ex.row_checksums(1, ex.data[1:])  # the pages may be reused by now
    assert ex.row_checksums(0, ex.data[:1]) == first  # computed before: kept
    conserved(a)


@pytest.mark.parametrize("lengths,first_row,staged", [([3, 3, 2], 0, 3), ([8], 0, 1),
                                                      ([2, 6], 2, 2), ([1, 1, 6], 0, 1),
                                                      ([5, 3], 3, 1), ([2, 3, 2], 0, 0)])
def test_receive_targets_in_place_or_staged_then_copied(lengths, first_row, staged):
    """The gloo receiver's plan: runs that fit a run of fresh pages land in place, the others
    in a buffer copied to the right pages afterwards; every row ends where it belongs."""
    from kvtvm.transferwire import receive_targets

    cache = torch.zeros(12, 3)
    fresh = [9, 10, 2, 3, 4, 7, 8, 0][:sum(lengths) - first_row]
    if staged == 0:
        fresh = [0, 1, 5, 6, 7, 10, 11][:sum(lengths)]  # this cache's new pages
    dest, r = [], 0
    while r < len(fresh):  # import_runs: runs of consecutive pages
        e = r + 1
        while e < len(fresh) and fresh[e] == fresh[e - 1] + 1:
            e += 1
        dest.append((r, cache[fresh[r]:fresh[r] + e - r]))
        r = e
    targets, fixups = receive_targets(dest, lengths, first_row, (3,), torch.float32,
                                      torch.device("cpu"),
                                      lambda shape, dtype: torch.empty(shape, dtype=dtype))
    sent = torch.randn(sum(lengths), 3)
    r = 0
    for n, t in zip(lengths, targets):  # what the irecvs do
        assert t.shape[0] == n
        t.copy_(sent[r:r + n])
        r += n
    for buf, rows in fixups:
        for i, row in enumerate(rows):
            row.copy_(buf[i])
    for j, page in enumerate(fresh):
        assert torch.equal(cache[page], sent[first_row + j]), j
    assert len(fixups) == staged
    in_place = [t for t in targets if t.untyped_storage().data_ptr()
                == cache.untyped_storage().data_ptr()]
    assert len(in_place) == len(lengths) - staged


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8])
def test_host_checksums_of_a_run_equal_each_page_hashed_alone(dtype):
    """A run is hashed through one numpy view (no torch view per page): same values as
    hashing each page on its own, for strided runs and pages of a few bytes too."""
    from kvtvm.manager.hashing import checksum

    gen = torch.Generator().manual_seed(3)
    for shape in [(7, 2, 3, 4, 5), (300, 1, 1, 1, 2), (1, 3)]:
        run = (torch.randn(shape, generator=gen) * 40).to(dtype)
        for pages in (run, run.transpose(-1, -2), run[:, ..., :1]):
            assert page_checksums(pages, HOST) == [checksum(p) for p in pages]
    assert page_checksums(torch.empty((3, 0), dtype=dtype), HOST) == \
        [checksum(p) for p in torch.empty((3, 0), dtype=dtype)]


@pytest.mark.parametrize("bits", [3, 20, 64])
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_block_hashes_chain_chain_hash_over_full_pages(bits, page_size):
    """block_hashes (the inlined loop every export and lookup runs) is chain_hash applied
    page after page from the seed; the partial last page has no hash."""
    from kvtvm.manager.hashing import HASH_SEED, block_hashes, chain_hash

    rng = np.random.default_rng(bits * 100 + page_size)
    for n in (0, page_size - 1, page_size, 3 * page_size + 2):
        toks = rng.integers(-2**40, 2**40, n)
        want, h = [], HASH_SEED
        for i in range(n // page_size):
            h = chain_hash(h, toks[i * page_size:(i + 1) * page_size].astype(np.int64).tobytes(),
                           bits)
            want.append(h)
        assert block_hashes(list(toks), page_size, bits) == want
        assert all(0 <= x < 2**bits for x in want)
