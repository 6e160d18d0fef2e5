"""Page export/import and leases of the paged manager (issue 17): round trips with resharding,
header checks field by field, corrupt and truncated data, capacity, unknown sequences, leases
that outlive a release and end exactly once, copy-on-write of leased pages, and a narrow hash
range whose collisions cost a resend, never wrong KV (content-verified imports)."""

import dataclasses

import numpy as np
import pytest
import torch
from helpers import run_prompt

from kvtvm import KVCacheParams
from kvtvm.errors import (CorruptTransferError, DeviceMismatchError, FormatMismatchError,
                          InvalidArgumentError, KVCacheCapacityError, SequenceStateError,
                          TransferError, UnknownSequenceError)
from kvtvm.manager import BatchItem, PagedKVCacheManager
from kvtvm.manager.pageformat import FORMAT_VERSION, tokens_checksum
from kvtvm.manager.pageio import PageHeader
from kvtvm.transfer import InProcessTransport, send_sequence

H, D, L, P = 2, 4, 2, 4


def torch_copier(blocks, src, dst):
    for s, d in zip(src.tolist(), dst.tolist()):
        blocks[d].copy_(blocks[s])


def make(devices=("cpu",), pages=16, dtype="float32", prefix=True, page_size=P, layers=L,
         heads=H, head_dim=D):
    mgr = PagedKVCacheManager(
        KVCacheParams(dtype, heads, head_dim, "paged", page_size=page_size,
                      enable_prefix_caching=prefix),
        4, 64, layers, devices, num_pages=pages, page_copier=torch_copier)
    for b in mgr.blocks:
        b.copy_(torch.randn(b.shape))
    return mgr


def kv_of(mgr, s, n):
    """[pages, 2, L, P, H, D] of the pages covering the first n tokens of s (all heads)."""
    pages = mgr.pages_of(s)[:-(-n // mgr.page_size)]
    return torch.cat([b[pages] for b in mgr.blocks], dim=4)


def stats(mgr):
    st = mgr.stats()
    return (st.pages_free, st.pages_used, st.pages_cached, st.pages_leased, st.pages_shared)


def conserved(mgr):
    st = mgr.stats()
    assert st.pages_free + st.pages_used + st.pages_cached + st.pages_leased == st.pages_total
    mgr.check_invariants()


@pytest.mark.parametrize("src_devs,dst_devs", [(1, 2), (2, 1), (1, 1)])
def test_round_trip_into_sequence_reshards(src_devs, dst_devs):
    a, b = make(("cpu",) * src_devs), make(("cpu",) * dst_devs)
    toks = list(range(3, 14))  # 2 full pages + 3 tokens
    s = run_prompt(a, toks)
    ex = a.export_pages(s)
    assert ex.header.n_pages == 3 and ex.header.tokens == tuple(toks)
    assert tuple(ex.data.shape) == (3, 2, L, P, H, D)
    assert len(ex.header.block_hashes) == 2 and len(ex.header.checksums) == 3
    (t,) = b.claim(1)
    assert b.import_pages(ex.header, ex.data, seq_id=t) == 3
    assert b.cache_length(t) == len(toks)
    assert torch.equal(kv_of(b, t, len(toks)), kv_of(a, s, len(toks)))
    conserved(a), conserved(b)
    # the decode side continues the sequence: one more token goes to slot 11 of page 2
    inp = b.fetch([BatchItem(t, [99])])[0]
    assert inp.cache_lengths_host.tolist() == [len(toks)]
    b.step([BatchItem(t, [99])])
    conserved(b)
    assert a.end_lease(ex.lease_id) and not a.end_lease(ex.lease_id)
    conserved(a)


def test_import_registers_pages_for_a_later_prefix_hit():
    a, b = make(), make()
    toks = list(range(40, 53))  # 3 full pages + 1
    ex = a.export_pages(run_prompt(a, toks))
    b.import_pages(ex.header, ex.data)
    assert stats(b)[2] == 3  # the full pages are cached, the partial one went back
    (t,) = b.claim(1)
    (inp,) = b.fetch([BatchItem(t, toks + [7])])
    assert list(inp.num_cached_tokens) == [12]
    assert torch.equal(kv_of(b, t, 12), ex.data[:3])
    assert b.held_prefix_pages(ex.header.block_hashes) == 3
    conserved(b)


def test_export_by_block_hashes_and_partial_send():
    a, b = make(), make()
    sys_prompt = list(range(100, 108))  # 2 full pages shared by two requests
    s1 = run_prompt(a, sys_prompt + [1, 2, 3, 4, 5])
    ex = a.export_pages(block_hashes=a.block_hashes_of(s1)[:2])
    assert ex.header.tokens == tuple(sys_prompt)
    b.import_pages(ex.header, ex.data)
    a.end_lease(ex.lease_id)
    s2 = run_prompt(a, sys_prompt + [9, 9, 9, 9, 9, 9])
    hashes = a.block_hashes_of(s2)
    assert b.held_prefix_pages(hashes) == 2
    ex2 = a.export_pages(s2, first_page=2)
    assert ex2.header.n_carried == 2  # only the pages the peer lacks travel
    (t,) = b.claim(1)
    assert b.import_pages(ex2.header, ex2.data, seq_id=t) == 2
    assert torch.equal(kv_of(b, t, 14), kv_of(a, s2, 14))
    with pytest.raises(InvalidArgumentError, match=r"block_hashes\[0\]"):
        a.export_pages(block_hashes=[12345])
    conserved(a), conserved(b)


FIELDS = [("dtype", dict(dtype="float16"), "'float32'"), ("page_size", dict(page_size=8), "4"),
          ("num_layers", dict(layers=3), "2"), ("n_kv_heads", dict(heads=4), "2"),
          ("head_dim", dict(head_dim=8), "4")]


@pytest.mark.parametrize("field,kwargs,mine", FIELDS)
def test_header_field_mismatch_names_field_and_both_values(field, kwargs, mine):
    a, b = make(), make(**kwargs)
    ex = a.export_pages(run_prompt(a, list(range(9))))
    before = stats(b)
    (t,) = b.claim(1)
    with pytest.raises(FormatMismatchError) as err:
        b.import_pages(ex.header, ex.data, seq_id=t)
    msg = str(err.value)
    assert field in msg and str(getattr(ex.header, field)) in msg
    assert stats(b) == before and b.cache_length(t) == 0


@pytest.mark.parametrize("field,value", [("version", 99), ("storage", "int8-per-page-scale"),
                                         ("layout", "page,layer,kv,slot,head,dim"),
                                         ("head_range", (0, 1))])
def test_header_other_fields(field, value):
    a, b = make(), make()
    ex = a.export_pages(run_prompt(a, list(range(9))), heads=(0, 1) if field == "head_range"
                        else None)
    hdr = dataclasses.replace(ex.header, **{field: value})
    with pytest.raises(FormatMismatchError, match=field):
        b.import_pages(hdr, ex.data)
    conserved(b)
    assert stats(b)[0] == 16


INCONSISTENT = [("first_page", -1), ("first_page", 5), ("first_page", True),
                ("first_page", "1"), ("checksums", (1,)), ("checksums", (1, 2, 3, 4)),
                ("checksums", ("a", "b")), ("checksums", 5), ("checksums", None),
                ("tokens", (0.5,) + tuple(range(1, 13))),
                ("tokens", tuple(str(t) for t in range(13))),
                ("tokens", (2 ** 70,) + tuple(range(1, 13))), ("tokens", None),
                ("block_hashes", ()), ("head_range", (0, 2, 1)), ("page_size", 0)]


@pytest.mark.parametrize("field,value", INCONSISTENT)
def test_header_built_inconsistently_is_refused_by_name_and_changes_nothing(field, value):
    """A header made in Python (dataclasses.replace, not from_bytes) whose fields disagree
    with each other is a CorruptTransferError naming the field, before any lease is taken."""
    a, b = make(), make()
    toks = list(range(13))
    ex = a.export_pages(run_prompt(a, toks), first_page=1)
    first = a.export_pages(block_hashes=a.block_hashes_of(0)[:1])
    b.import_pages(first.header, first.data)  # b holds page 0: the header starts at page 1
    hdr = dataclasses.replace(ex.header, **{field: value})
    (t,) = b.claim(1)
    before, leases, blocks = stats(b), b.active_leases(), [x.clone() for x in b.blocks]
    with pytest.raises(CorruptTransferError, match=field):
        b.import_pages(hdr, ex.data, seq_id=t)
    assert stats(b) == before and b.active_leases() == leases and b.cache_length(t) == 0
    assert all(torch.equal(x, y) for x, y in zip(blocks, b.blocks))
    conserved(b)
    assert b.import_pages(ex.header, ex.data, seq_id=t) == 3  # the consistent one imports


@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
@pytest.mark.parametrize("which", [0, 5, 9])  # in full page 0, full page 1, the partial page
def test_a_damaged_token_id_in_the_header_is_refused(cache_dtype, which):
    """Was: the page checksums cover the data only, so a header whose token id was damaged on
    the way imported: the pages entered the prefix cache under the damaged tokens and a later
    prompt starting with them was served the K/V of other tokens. Now the header carries its
    tokens' checksum: on the wire and built in Python, a CorruptTransferError naming
    ``tokens``, nothing changed."""
    params = KVCacheParams("float32", H, D, "paged", page_size=P, enable_prefix_caching=True,
                           cache_dtype=cache_dtype)
    a, b = (PagedKVCacheManager(params, 4, 64, L, num_pages=16) for _ in range(2))
    toks = list(range(10, 20))  # 2 full pages + 2 tokens
    ex = a.export_pages(run_prompt(a, toks))
    bad = list(toks)
    bad[which] ^= 0x40
    raw = ex.header.to_bytes()
    at = raw.index(np.asarray(toks, "<i8").tobytes())
    damaged = bytearray(raw)
    damaged[at + 8 * which] ^= 0x40
    with pytest.raises(CorruptTransferError, match="tokens"):
        PageHeader.from_bytes(bytes(damaged))
    (t,) = b.claim(1)
    before, blocks = stats(b), [x.clone() for x in b.blocks]
    with pytest.raises(CorruptTransferError, match="tokens"):
        b.import_pages(dataclasses.replace(ex.header, tokens=tuple(bad)), ex.data, seq_id=t)
    assert stats(b) == before and b.cache_length(t) == 0 and b.active_leases() == {}
    assert all(torch.equal(x, y) for x, y in zip(blocks, b.blocks))
    (u,) = b.claim(1)
    (inp,) = b.fetch([BatchItem(u, bad[:8] + [99])])
    assert int(inp.num_cached_tokens[0]) == 0  # never the K/V of the other tokens
    conserved(b)


def test_block_hashes_that_are_not_the_tokens_are_refused():
    """A header whose block hashes are not the chained hashes of its tokens (built
    inconsistently, or by a cache of another storage format) imports nothing; a header of
    another format version is a FormatMismatchError naming the version."""
    a, b = make(), make()
    ex = a.export_pages(run_prompt(a, list(range(10, 20))))
    hashes = list(ex.header.block_hashes)
    hashes[1] ^= 1
    (t,) = b.claim(1)
    before = stats(b)
    with pytest.raises(CorruptTransferError, match=r"block_hashes: \[1\]"):
        b.import_pages(dataclasses.replace(ex.header, block_hashes=tuple(hashes)), ex.data,
                       seq_id=t)
    with pytest.raises(FormatMismatchError, match="version: this kvtvm reads "
                       f"{FORMAT_VERSION}, the peer sent 2"):
        b.import_pages(dataclasses.replace(ex.header, version=2), ex.data, seq_id=t)
    assert stats(b) == before and b.cache_length(t) == 0
    assert b.import_pages(ex.header, ex.data, seq_id=t) == 3


def test_corrupt_and_truncated_data_write_nothing():
    a, b = make(), make()
    ex = a.export_pages(run_prompt(a, list(range(13))))
    snapshot = [x.clone() for x in b.blocks]
    bad = ex.data.clone()
    bad[1, 0, 0, 0, 0, 0] += 1.0
    with pytest.raises(CorruptTransferError, match="page 1"):
        b.import_pages(ex.header, bad)
    with pytest.raises(CorruptTransferError, match="import data"):
        b.import_pages(ex.header, ex.data[:2])
    # data of the right shape and dtype on no device the cache reads (a meta tensor: torch's
    # NotImplementedError from the checksum), both ways in
    meta = torch.empty(ex.data.shape, dtype=ex.data.dtype, device="meta")
    with pytest.raises(DeviceMismatchError, match="import data.*meta"):
        b.import_pages(ex.header, meta)
    (t,) = b.claim(1)
    with pytest.raises(DeviceMismatchError, match="import data.*meta"):
        b.finish_import(b.begin_import(ex.header, t)[0], meta)
    b.release(t)
    with pytest.raises(CorruptTransferError):
        PageHeader.from_bytes(ex.header.to_bytes()[:-7])
    with pytest.raises(CorruptTransferError):
        PageHeader.from_bytes(ex.header.to_bytes().replace(b'"first_page":0', b'"first_page":9'))
    assert stats(b) == (16, 0, 0, 0, 0)
    assert all(torch.equal(x, y) for x, y in zip(snapshot, b.blocks))
    assert not b.active_leases()
    conserved(b)


def test_corrupt_import_into_a_full_prefix_cache_evicts_nothing():
    """Every page cached and unreferenced: a corrupt import is refused before a page is
    taken, so no cached page is evicted for it (it flushed the receiver's warm prefix cache),
    and the prompts it held still hit."""
    a, b = make(), make(pages=4)
    prompts = [list(range(100 + 10 * i, 108 + 10 * i)) for i in range(2)]  # 2 full pages each
    for toks in prompts:
        b.release(run_prompt(b, toks))
    assert stats(b) == (0, 0, 4, 0, 0)
    snapshot = [x.clone() for x in b.blocks]
    ex = a.export_pages(run_prompt(a, list(range(13))))
    for i in range(ex.data.shape[0]):
        bad = ex.data.clone()
        bad[i].view(-1)[i * 7] += 1.0
        with pytest.raises(CorruptTransferError, match=f"page {i}"):
            b.import_pages(ex.header, bad)
        assert stats(b) == (0, 0, 4, 0, 0)
        assert b.stats().evictions == 0
        assert [b.cached_prefix_tokens(t + [1]) for t in prompts] == [8, 8]
    assert all(torch.equal(x, y) for x, y in zip(snapshot, b.blocks))
    conserved(b)


def test_import_into_full_cache_and_unknown_sequences():
    a, b = make(), make(pages=2)
    s = run_prompt(a, list(range(13)))
    ex = a.export_pages(s)
    with pytest.raises(KVCacheCapacityError, match="needs 4 new pages"):
        b.import_pages(ex.header, ex.data)
    assert stats(b) == (2, 0, 0, 0, 0)
    with pytest.raises(UnknownSequenceError):
        a.export_pages(3)
    a.release(s)
    with pytest.raises(UnknownSequenceError):
        a.export_pages(s)
    (t,) = a.claim(1)
    a.fetch([BatchItem(t, [1, 2])])
    with pytest.raises(SequenceStateError, match="in flight"):
        a.export_pages(t)
    with pytest.raises(InvalidArgumentError, match="prefix_caching"):
        make(prefix=False).export_pages(0)
    with pytest.raises(SequenceStateError):
        b.finish_import(1234, ex.data)


def test_lease_outlives_release_and_blocks_eviction():
    a = make(pages=4)
    s = run_prompt(a, list(range(12)))  # 3 pages, all full
    ex = a.export_pages(s, timeout=5.0)
    a.release(s)  # preempted while its transfer still reads the pages
    assert stats(a) == (1, 0, 0, 3, 0)
    conserved(a)
    (t,) = a.claim(1)
    with pytest.raises(KVCacheCapacityError):  # leased pages are not evictable
        a.fetch([BatchItem(t, list(range(50, 58)))])
    assert a.expire_leases(now=0.0) == []          # not yet due
    assert a.expire_leases(now=1e18) == [ex.lease_id]
    assert not a.end_lease(ex.lease_id)            # ended once, by the timeout
    assert stats(a) == (1, 0, 3, 0, 0)             # back to cached: evictable again
    a.fetch([BatchItem(t, list(range(50, 58)))])
    conserved(a)


def test_leased_tail_page_is_copied_before_a_write():
    a = make()
    s = run_prompt(a, list(range(6)))  # page 1 is partial (2 tokens)
    ex = a.export_pages(s)
    sent = ex.data.clone()
    tail = a.pages_of(s)[1]
    a.fetch([BatchItem(s, [42])])
    assert a.pages_of(s)[1] != tail  # copy-on-write: the leased page is not rewritten
    a.blocks[0][a.pages_of(s)[1]].fill_(7.0)
    a.step([BatchItem(s, [42])])
    assert torch.equal(ex.data, sent)
    conserved(a)
    a.end_lease(ex.lease_id)
    conserved(a)


def test_tiny_hash_range_collisions_cost_a_resend_never_wrong_kv():
    a, b = make(pages=48), make(pages=48)
    a.hash_bits = b.hash_bits = 1  # 2 possible hashes: collisions everywhere
    box = {}
    ta, tb = InProcessTransport.pair(a, b, auto=True, seq_for=lambda hdr, tag: box["t"])
    rng = np.random.default_rng(0)
    resends = 0
    for tag in range(8):
        toks = rng.integers(0, 50, size=int(rng.integers(5, 13))).tolist()
        s = run_prompt(a, toks)
        (box["t"],) = (t,) = b.claim(1)
        said = b.held_prefix_pages(a.block_hashes_of(s))
        chunks = [np.asarray(toks[i * P:(i + 1) * P], np.int64).tobytes()
                  for i in range(len(toks) // P)]
        really = len(b._prefix.lookup(chunks)[0])
        resends += said > really  # the hashes lied: the import asks for the whole prefix
        send_sequence(ta, 1, s, tag=tag)
        assert b.cache_length(t) == len(toks)
        assert torch.equal(kv_of(b, t, len(toks)), kv_of(a, s, len(toks))), tag
        a.release(s), b.release(t)
        conserved(a), conserved(b)
        assert not a.active_leases() and not b.active_leases()
    assert resends >= 2


def make_quant(pages=16, cache_dtype="int8", devices=("cpu",)):
    mgr = PagedKVCacheManager(
        KVCacheParams("float16", H, 16, "paged", page_size=P, enable_prefix_caching=True,
                      cache_dtype=cache_dtype),
        4, 64, L, devices, num_pages=pages, page_copier=torch_copier)
    for b in mgr.blocks:
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8))
    return mgr


def test_quantized_pages_travel_as_byte_rows_and_formats_never_mix():
    a, b = make_quant(), make_quant()
    s = run_prompt(a, list(range(11)))
    ex = a.export_pages(s)
    assert ex.header.storage.startswith("quant:") and "int8" in ex.header.storage
    assert ex.header.page_shape == (a.params.bytes_per_page(L),)
    (t,) = b.claim(1)
    b.import_pages(ex.header, ex.data, seq_id=t)
    assert torch.equal(b.blocks[0][b.pages_of(t)], a.blocks[0][a.pages_of(s)])
    conserved(b)
    # another storage format (fp8, or full precision) refuses it by name
    for other in (make_quant(cache_dtype="float8_e4m3fn"), make_quant(cache_dtype=None)):
        with pytest.raises(FormatMismatchError, match="storage"):
            other.import_pages(ex.header, ex.data)
        conserved(other)
    # the hashes are seeded by the format: the same tokens are other names in another format
    c = make_quant(cache_dtype="float8_e4m3fn")
    assert c.block_hashes_of(run_prompt(c, list(range(11)))) != a.block_hashes_of(s)


@pytest.mark.parametrize("src_devs,dst_devs", [(2, 2), (1, 2), (2, 1)])
def test_quantized_export_of_no_pages_between_split_caches(src_devs, dst_devs):
    """first_page == n_pages (the peer holds every page): nothing is carried, and a cache that
    splits the heads of its byte rows exports and imports the empty run."""
    a, b = make_quant(devices=("cpu",) * src_devs), make_quant(devices=("cpu",) * dst_devs)
    toks = list(range(11))
    s = run_prompt(a, toks)
    ex = a.export_pages(s)
    b.import_pages(ex.header, ex.data)  # b now holds the 2 full pages
    a.end_lease(ex.lease_id)
    s2 = run_prompt(a, toks[:8])  # exactly 2 full pages, both held by b
    ex2 = a.export_pages(s2, first_page=2)
    assert ex2.header.n_carried == 0 and tuple(ex2.data.shape) == (0, ex.header.page_bytes)
    assert b.import_pages(ex2.header, ex2.data) == 0
    a.end_lease(ex2.lease_id)
    conserved(a), conserved(b)


@pytest.mark.parametrize("export", ["x", None, 5, object()])
def test_transport_send_names_a_bad_export(export):
    a, b = make(), make()
    ta, _ = InProcessTransport.pair(a, b, auto=True)
    with pytest.raises(InvalidArgumentError, match="export"):
        ta.send(0, export)
    conserved(a), conserved(b)


def test_import_in_flight_never_lands_in_the_next_owner_of_its_slot():
    """The sequence an import targets is released while the pages are in flight and its slot
    is claimed again by another request: finish_import registers the pages in the prefix
    cache only; the new owner keeps its own tokens and pages (they were overwritten and
    leaked). A target that took tokens itself meanwhile refuses the import by name."""
    a, b = make(), make()
    toks = list(range(10))
    ex = a.export_pages(run_prompt(a, toks))
    (t,) = b.claim(1)
    lid, _ = b.begin_import(ex.header, seq_id=t)
    b.release(t)
    assert b.claim(1) == [t]  # the same slot, another request
    b.fetch([BatchItem(t, [7] * 5)])
    b.step([BatchItem(t, [7] * 5)])
    mine, kv = b.pages_of(t), kv_of(b, t, 5).clone()
    assert b.finish_import(lid, ex.data) == 3
    assert b.pages_of(t) == mine and b.cache_length(t) == 5
    assert torch.equal(kv_of(b, t, 5), kv)
    conserved(b)
    assert stats(b)[2] == 2  # the two full pages imported are cached
    (u,) = b.claim(1)
    lid, _ = b.begin_import(ex.header, seq_id=u)
    b.fetch([BatchItem(u, [1, 2, 3])])
    b.step([BatchItem(u, [1, 2, 3])])
    with pytest.raises(SequenceStateError, match=f"seq_id {u}"):
        b.finish_import(lid, ex.data[2:])
    assert b.cache_length(u) == 3 and not b.active_leases()
    conserved(b)


def test_transport_refuses_an_import_into_a_busy_sequence_and_stays_in_step():
    """seq_for names a sequence that already holds tokens: the receiver refuses the import
    (the error in what handle returns, nothing written), the sender's wait raises instead of
    waiting forever, its lease ends, and the next transfer goes through."""
    a, b = make(), make()
    ta, tb = InProcessTransport.pair(a, b)
    busy = run_prompt(b, [5, 6, 7])
    s = run_prompt(a, list(range(10)))
    ex = a.export_pages(s)
    transfer = ta.send(0, ex)
    got = tb.handle(0, lambda header, tag: busy)
    assert isinstance(got.error, SequenceStateError) and b.cache_length(busy) == 3
    with pytest.raises(SequenceStateError):
        transfer.wait(5.0)
    assert not a.active_leases()
    conserved(a), conserved(b)
    (t,) = b.claim(1)
    transfer = ta.send(0, a.export_pages(s))
    assert tb.handle(0, lambda header, tag: t).error is None
    assert transfer.wait(5.0) == 3 and b.cache_length(t) == 10
    conserved(a), conserved(b)


def test_header_wire_encoding_round_trips_and_refuses_damage():
    """Fields as JSON, token ids / hashes / checksums as int64 / uint64 arrays: a long prompt's
    header round-trips exactly (64-bit hashes and checksums, absent checksums too), and any
    damage -- magic, an announced length, bytes missing or left over -- is a
    CorruptTransferError, never a partly read header."""
    import dataclasses
    import struct

    rng = np.random.default_rng(5)
    n = 8192 + 5
    tokens = tuple(int(t) for t in rng.integers(-2**63, 2**63 - 1, n))
    hdr = PageHeader(version=FORMAT_VERSION, dtype="float16", storage="dense", layout="x",
                     page_size=16, n_kv_heads=4, head_range=(1, 3), head_dim=64, num_layers=2,
                     tokens=tokens, tokens_checksum=tokens_checksum(tokens),
                     first_page=3, block_hashes=tuple(int(h) for h in rng.integers(
                         0, 2**63, n // 16, dtype=np.uint64) * 2 + 1),
                     hash_bits=64, checksum="xxh3_64",
                     checksums=tuple(range(2**64 - 508, 2**64)) + (0,) * 2, page_bytes=8)
    assert len(hdr.checksums) == hdr.n_carried
    for h, deferred in ((hdr, False), (dataclasses.replace(hdr, checksums=None), True)):
        raw = h.to_bytes()
        back = PageHeader.from_bytes(raw, deferred=deferred)
        assert back == h
        # the tokens' int64 array (kept from the wire, and through with_checksums) is
        # theirs exactly, and read-only: the header stays immutable
        for arr in (back.token_array(), h.token_array(),
                    back.with_checksums(hdr.checksums).token_array()):
            assert arr.dtype == np.int64 and arr.tolist() == list(hdr.tokens)
            with pytest.raises(ValueError):
                arr[0] = 1
    raw = hdr.to_bytes()
    (jlen,) = struct.unpack_from("<I", raw, 4)
    damaged = [raw[:-8], raw + b"\0" * 8, b"XXXX" + raw[4:], raw[:6], b"",
               raw.replace(b'"n_tokens":%d' % n, b'"n_tokens":%d' % (n + 1)),
               raw.replace(b'"n_tokens":%d' % n, b'"n_tokens":-2'),
               raw[:4] + struct.pack("<I", jlen + 3) + raw[8:]]
    # -1 ("absent") is for deferred checksums only: for the other arrays (none sent) a
    # TypeError escaped before
    empty = dataclasses.replace(hdr, tokens=(), block_hashes=(), checksums=()).to_bytes()
    for name in (b"tokens", b"block_hashes"):
        fields = empty[8:].replace(b'"n_%s":0' % name, b'"n_%s":-1' % name)
        damaged.append(empty[:4] + struct.pack("<I", len(fields)) + fields)
    for bad in damaged:
        assert bad != raw and bad != empty
        for deferred in (False, True):
            with pytest.raises(CorruptTransferError):
                PageHeader.from_bytes(bad, deferred=deferred)
    with pytest.raises(CorruptTransferError, match="block_hashes"):
        dataclasses.replace(hdr, block_hashes=(-1,) + hdr.block_hashes[1:]).to_bytes()


def test_a_lease_id_means_nothing_to_another_manager():
    """Lease ids are unique in the process: ending another manager's export lease here is a
    no-op (False), not the end of this manager's lease with the same number."""
    a, b = make(), make()
    ex_a = a.export_pages(run_prompt(a, list(range(9))))
    ex_b = b.export_pages(run_prompt(b, list(range(9))))
    assert ex_a.lease_id != ex_b.lease_id
    assert b.end_lease(ex_a.lease_id) is False
    assert b.active_leases() == {ex_b.lease_id: "export"} and a.active_leases() == {ex_a.lease_id: "export"}
    with pytest.raises(SequenceStateError, match="not an open"):
        b.import_runs(ex_a.lease_id)
    assert a.end_lease(ex_a.lease_id) and b.end_lease(ex_b.lease_id)
