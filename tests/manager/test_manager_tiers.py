"""Host and disk tiers of the prefix cache (issue 17): eviction demotes, a prefix hit promotes
the same bytes back, the disk tier survives a restart, corrupt / truncated / colliding entries
are misses (never wrong KV), a refused directory, and a writer killed by a signal mid-write
leaves only complete entries."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from kvtvm import KVCacheParams
from kvtvm.errors import InvalidArgumentError, KVCacheCapacityError
from kvtvm.manager import BatchItem, PagedKVCacheManager
from kvtvm.manager.hashing import chain_hash, fingerprint
from kvtvm.manager.tiers import DiskTier

H, D, L, P = 2, 4, 2, 4


def make(pages=6, devices=("cpu",)):
    mgr = PagedKVCacheManager(
        KVCacheParams("float32", H, D, "paged", page_size=P, enable_prefix_caching=True),
        2, 32, L, devices, num_pages=pages)
    for b in mgr.blocks:
        b.copy_(torch.randn(b.shape))
    return mgr


def kv_of(mgr, s, n_pages):
    parts = [b[mgr.pages_of(s)[:n_pages]] for b in mgr.blocks]
    return (torch.cat(parts, dim=4) if len(parts) > 1 else parts[0]).clone()


def serve(mgr, toks):
    """Prefill ``toks`` (writing fresh random K/V into the pages it computes), release it;
    returns (prefix hit tokens, the K/V of its full pages)."""
    (s,) = mgr.claim(1)
    (inp,) = mgr.fetch([BatchItem(s, toks)])[:1]
    hit = int(inp.num_cached_tokens[0])
    for p in mgr.pages_of(s)[hit // P:]:
        for b in mgr.blocks:
            b[p].copy_(torch.randn(b[p].shape))
    mgr.step([BatchItem(s, toks)])
    kv = kv_of(mgr, s, len(toks) // P)
    mgr.release(s)
    mgr.check_invariants()
    return hit, kv


SYS = list(range(500, 512))  # 3 full pages


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu")])
def test_host_tier_demotes_and_promotes_the_same_bytes(devices):
    mgr = make(devices=devices)
    mgr.attach_tiers(host_pages=8)
    _, want = serve(mgr, SYS + [1])
    for k in range(3):  # other prompts push the system prompt out of the 6-page pool
        serve(mgr, list(range(100 * k, 100 * k + 13)))
    st = mgr.stats()
    assert st.evictions >= 3 and st.tiers["host"]["demotions"] >= 3
    hit, got = serve(mgr, SYS + [2])
    assert hit == 12
    assert torch.equal(got, want)
    assert mgr.stats().tiers["host"]["hits"] >= 3
    assert mgr.stats().tiers["host"]["promotions"] >= 3


def test_disk_tier_survives_a_restart(tmp_path):
    a = make()
    a.attach_tiers(disk_dir=tmp_path / "kv", disk_bytes=1 << 20)
    _, want = serve(a, SYS + [1])
    assert a.persist_prefix_cache() == 3
    assert oct((tmp_path / "kv").stat().st_mode & 0o777) == "0o700"
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in (tmp_path / "kv").glob("*.kvp"))
    b = make()  # "restarted": a fresh cache, same directory
    b.attach_tiers(disk_dir=tmp_path / "kv", disk_bytes=1 << 20)
    hit, got = serve(b, SYS + [3])
    assert hit == 12 and torch.equal(got, want)
    assert b.stats().tiers["disk"]["hits"] == 3


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_corrupt_disk_entry_is_a_logged_miss(tmp_path, caplog, damage):
    a = make()
    a.attach_tiers(disk_dir=tmp_path, disk_bytes=1 << 20)
    serve(a, SYS + [1])
    a.persist_prefix_cache()
    files = sorted(tmp_path.glob("*.kvp"), key=lambda p: p.stat().st_mtime_ns)
    victim = files[1]  # the second page of the chain
    blob = bytearray(victim.read_bytes())
    if damage == "flip":
        blob[-5] ^= 0xFF
    elif damage == "truncate":
        blob = blob[:len(blob) // 2]
    else:
        blob = bytearray(b"not an entry")
    victim.write_bytes(bytes(blob))
    b = make()
    b.attach_tiers(disk_dir=tmp_path, disk_bytes=1 << 20)
    with caplog.at_level("WARNING", logger="kvtvm.manager.tiers"):
        hit, _ = serve(b, SYS + [3])
    pages_hit = hit // P
    assert pages_hit in (0, 1)  # whichever page of the chain was hit
    assert "is a miss" in caplog.text
    assert b.stats().tiers["disk"]["rejected"] == 1


def test_tiny_hash_range_in_tiers_is_a_miss_never_wrong_kv(tmp_path):
    mgr = make(pages=4)
    mgr.hash_bits = 1  # two hash values: entries overwrite each other
    mgr.attach_tiers(host_pages=2, disk_dir=tmp_path, disk_bytes=1 << 20)
    truth = {}
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 9, size=9).tolist() for _ in range(6)]
    for rnd in range(3):
        for toks in prompts:
            hit, kv = serve(mgr, toks)
            key = tuple(toks[:8])
            if hit:  # whatever tier served it, the bytes are the ones computed for it
                assert torch.equal(kv[:hit // P], truth[key][:hit // P])
            else:
                truth[key] = kv
            truth.setdefault(key, kv)
    tiers = mgr.stats().tiers
    assert tiers["host"]["rejected"] + tiers["disk"]["rejected"] > 0


def test_refused_directories(tmp_path, monkeypatch):
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    os.chmod(open_dir, 0o777)
    with pytest.raises(InvalidArgumentError, match="disk_dir.*group or others"):
        make().attach_tiers(disk_dir=open_dir)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    uid = theirs.stat().st_uid
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    with pytest.raises(InvalidArgumentError, match="disk_dir.*owned by"):
        make().attach_tiers(disk_dir=theirs)
    monkeypatch.undo()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(InvalidArgumentError, match="disk_dir"):
        make().attach_tiers(disk_dir=a_file)
    mgr = make()
    with pytest.raises(InvalidArgumentError, match="host_pages"):
        mgr.attach_tiers(host_pages=-1)
    assert mgr.stats().tiers == {}


WRITER = """
import sys, torch
from kvtvm.manager.hashing import chain_hash, fingerprint
from kvtvm.manager.tiers import DiskTier
tier = DiskTier(sys.argv[1], 1 << 40)
i = 0
while True:
    data = torch.full((2, 8, 64, 8, 64), float(i))  # 2 MiB per entry
    tier.put(i, i, torch.tensor([i], dtype=torch.int64).numpy().tobytes(), data, block=True)
    if i < 3:  # three entries surely complete; later ones still queued or being written
        tier.flush()  # by the background writer when the kill lands
    print(i, flush=True)
    i += 1
"""


def test_writer_killed_mid_write_leaves_only_complete_entries(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(3):  # a few complete entries, then a kill at an arbitrary point
            assert proc.stdout.readline()
        time.sleep(0.013)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    tier = DiskTier(tmp_path, 1 << 40)
    names = sorted(p.name for p in tmp_path.glob("*.kvp"))
    assert len(names) >= 3
    for name in names:
        i = int(name.split(".")[0], 16)
        got = tier.get(i, i, np.array([i], np.int64).tobytes())
        assert got is not None and torch.equal(got, torch.full((2, 8, 64, 8, 64), float(i)))
    assert tier.stats()["rejected"] == 0


def test_quantized_cache_demotes_and_promotes_its_byte_rows(tmp_path):
    mgr = PagedKVCacheManager(
        KVCacheParams("float16", H, 16, "paged", page_size=P, enable_prefix_caching=True,
                      cache_dtype="int8"), 2, 32, L, num_pages=6)
    mgr.blocks[0].copy_(torch.randint(0, 256, mgr.blocks[0].shape, dtype=torch.uint8))
    mgr.attach_tiers(host_pages=8, disk_dir=tmp_path, disk_bytes=1 << 20)
    _, want = serve(mgr, SYS + [1])
    for k in range(3):
        serve(mgr, list(range(100 * k, 100 * k + 13)))
    hit, got = serve(mgr, SYS + [2])
    assert hit == 12 and torch.equal(got, want)
    assert mgr.stats().tiers["host"]["hits"] >= 3


def test_disk_writes_happen_off_the_lock_and_reads_see_whole_entries(tmp_path, monkeypatch):
    gate = __import__("threading").Event()
    real_fsync = os.fsync

    def slow_fsync(fd):  # the writer thread stalls inside the write until the test lets go
        gate.wait(10)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    mgr = make(pages=4)
    mgr.attach_tiers(disk_dir=tmp_path, disk_bytes=1 << 20)
    _, want = serve(mgr, SYS + [1])  # 3 full pages cached
    t0 = time.perf_counter()
    serve(mgr, list(range(900, 913)))  # evicts them: demoted to disk while the writer stalls
    assert time.perf_counter() - t0 < 5  # the demotion did not wait for the disk
    disk = mgr.stats().tiers["disk"]
    assert disk["pending"] == 3 and disk["demotions"] == 0
    other = DiskTier(tmp_path, 1 << 20)  # another process's view: a miss, never a part
    toks = np.asarray(SYS[:P], np.int64).tobytes()
    root_h, root_fp = mgr._root_chain()
    h0, fp0 = chain_hash(root_h, toks), fingerprint(root_fp, toks)
    assert h0 in mgr._tiers.disk and not list(tmp_path.glob("*.kvp"))
    assert other.get(h0, fp0, toks) is None
    hit, got = serve(mgr, SYS + [2])  # served whole from the write queue
    assert hit == 12 and torch.equal(got, want)
    gate.set()
    assert mgr.flush_tiers(timeout=30)
    assert mgr.stats().tiers["disk"]["pending"] == 0
    assert len(list(tmp_path.glob("*.kvp"))) >= 3
    assert torch.equal(other.get(h0, fp0, toks), want[0])  # now on disk, whole
    fresh = make(pages=4)  # a restart reads the written files
    fresh.attach_tiers(disk_dir=tmp_path, disk_bytes=1 << 20)
    hit, got = serve(fresh, SYS + [3])
    assert hit == 12 and torch.equal(got, want)
    mgr.close_tiers()
    assert mgr._tiers.disk.put(1, 1, b"x" * 8, torch.zeros(2)) is False  # closed: not queued
    other.close(), fresh.close_tiers()


def test_full_write_queue_drops_and_counts(tmp_path, monkeypatch):
    gate = __import__("threading").Event()
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (gate.wait(10), real_fsync(fd)))
    tier = DiskTier(tmp_path, 1 << 30, max_pending=2)
    queued = [tier.put(i, i, np.array([i], np.int64).tobytes(), torch.full((4,), float(i)))
              for i in range(6)]
    assert queued[:2] == [True, True] and not all(queued)
    assert tier.stats()["dropped"] == queued.count(False)
    gate.set()
    tier.close()
    for i, q in enumerate(queued):
        got = tier.get(i, i, np.array([i], np.int64).tobytes())
        assert (got is not None and torch.equal(got, torch.full((4,), float(i)))) == q


def test_host_tier_too_big_for_the_host_is_refused_at_attach():
    """The host pool is allocated by attach_tiers: one that cannot be (here about a petabyte)
    is a KVCacheCapacityError naming host_pages there -- not an untyped error in a later fetch
    that demotes -- and a count past int32 is refused before anything is allocated."""
    mgr = PagedKVCacheManager(KVCacheParams("float32", 2, 256, "paged", page_size=64,
                                            enable_prefix_caching=True), 2, 128, 2, num_pages=2)
    with pytest.raises(KVCacheCapacityError, match="host_pages"):
        mgr.attach_tiers(host_pages=(1 << 31) - 1)
    with pytest.raises(InvalidArgumentError, match="host_pages"):
        mgr.attach_tiers(host_pages=1 << 40)
    assert mgr._tiers is None
    host = mgr.attach_tiers(host_pages=3).host
    assert host._pool is not None and tuple(host._pool.shape) == (3, 2, 2, 64, 2, 256)


def test_fetch_without_room_promotes_nothing():
    """A fetch that cannot fit fails before any page rises from a tier: the device pool,
    the prefix cache, the cache bytes and the tiers' counters are as they were (a page
    promoted costs the page it saves, so the room is known from the device's hits)."""
    mgr = make()
    mgr.attach_tiers(host_pages=16)
    serve(mgr, SYS + [1])
    for k in range(3):  # the system prompt goes down to the host tier
        serve(mgr, list(range(100 * k, 100 * k + 13)))
    (a,) = mgr.claim(1)
    mgr.fetch([BatchItem(a, [7] * 9)])  # 3 of the 6 pages held
    mgr.step([BatchItem(a, [7] * 9)])
    (b,) = mgr.claim(1)
    before = (mgr.stats(), list(mgr._free), dict(mgr._prefix.table),
              [x.clone() for x in mgr.blocks])
    with pytest.raises(KVCacheCapacityError):
        mgr.fetch([BatchItem(b, SYS + list(range(20)))])  # 3 tier hits + 5 pages: 8 > 6
    after = (mgr.stats(), list(mgr._free), dict(mgr._prefix.table), mgr.blocks)
    assert before[:3] == after[:3]
    assert all(torch.equal(x, y) for x, y in zip(before[3], after[3]))
    mgr.check_invariants()
    mgr.release(a), mgr.release(b)
    hit, _ = serve(mgr, SYS + [2])  # with room, the same prefix rises and hits
    assert hit == 12


def test_import_without_room_promotes_nothing():
    """Same for an import: refused for room before any page of its prefix rises."""
    a, b = make(pages=12), make()
    b.attach_tiers(host_pages=16)
    serve(b, SYS + [1])
    for k in range(3):  # b's copy of the system prompt goes down to its host tier
        serve(b, list(range(100 * k, 100 * k + 13)))
    (s,) = a.claim(1)
    toks = SYS + list(range(20))  # 8 pages: 3 b holds in its tier, 5 new
    a.fetch([BatchItem(s, toks)])
    a.step([BatchItem(s, toks)])
    ex = a.export_pages(s)
    (t,) = b.claim(1)
    b.fetch([BatchItem(t, [7] * 9)])  # 3 of b's 6 pages held
    b.step([BatchItem(t, [7] * 9)])
    before = (b.stats(), list(b._free), dict(b._prefix.table), [x.clone() for x in b.blocks])
    with pytest.raises(KVCacheCapacityError, match="import"):
        b.import_pages(ex.header, ex.data)
    after = (b.stats(), list(b._free), dict(b._prefix.table), b.blocks)
    assert before[:3] == after[:3]
    assert all(torch.equal(x, y) for x, y in zip(before[3], after[3]))
    b.check_invariants()


def test_cached_prefix_tokens_is_what_the_first_fetch_hits(tmp_path):
    """``cached_prefix_tokens`` (the engine sizes a prompt's first chunk with it) equals the
    ``num_cached_tokens`` of a fetch of the whole prompt, in the device pool and through the
    host tier; the prompt's last token never counts, nothing changes in the manager."""
    mgr = make(pages=6)
    assert mgr.cached_prefix_tokens(SYS + [1]) == 0
    serve(mgr, SYS + [1, 2])                               # 3 full pages cached
    for toks, want in [(SYS + [7], 12), (SYS, 8), (SYS[:9], 8), (SYS[:5], 4), (SYS[:4], 0),
                       ([], 0), ([3] + SYS, 0), (SYS[:4] + [0] * 8, 4)]:
        before = mgr.stats()
        assert mgr.cached_prefix_tokens(toks) == want, toks
        assert mgr.stats() == before
        if toks:
            (s,) = mgr.claim(1)
            assert int(mgr.fetch([BatchItem(s, toks)])[0].num_cached_tokens[0]) == want
            mgr.release(s)
            mgr.check_invariants()
    tiered = make(pages=4)
    tiered.attach_tiers(host_pages=8)
    serve(tiered, SYS + [1])
    serve(tiered, [9] * 13)                                 # evicts SYS's pages to the host
    assert tiered.stats().tiers["host"]["entries"] == 3
    assert tiered.cached_prefix_tokens(SYS + [2]) == 12
    assert serve(tiered, SYS + [2])[0] == 12
    off = PagedKVCacheManager(KVCacheParams("float32", H, D, "paged", page_size=P), 2, 32, L)
    assert off.cached_prefix_tokens(SYS + [1]) == 0


def _import_setup():
    """A receiver whose host tier holds the first 7 pages of a 10-page sequence, with 9 pages
    in use and 7 cached ones; the export a peer sends after its lookup (from page 7)."""
    def make():
        m = PagedKVCacheManager(KVCacheParams("float16", 2, 16, "paged", page_size=4,
                                              enable_prefix_caching=True), 8, 64, 2,
                                num_pages=16)
        m.blocks[0].copy_(torch.randn(m.blocks[0].shape))
        return m

    def seq(m, toks):
        (s,) = m.claim(1)
        m.fetch([BatchItem(s, toks)])
        m.step([BatchItem(s, toks)])
        return s

    a_mgr, b_mgr = make(), make()
    b_mgr.attach_tiers(host_pages=16)
    base = list(range(300, 329))
    a = seq(a_mgr, base)
    ex = a_mgr.export_pages(a)
    b_mgr.import_pages(ex.header, ex.data)
    a_mgr.end_lease(ex.lease_id)
    for i in range(3):  # pushes the 7 imported pages to the host tier
        b_mgr.release(seq(b_mgr, [7000 + 100 * i + j for j in range(28 if i < 2 else 8)]))
    busy = seq(b_mgr, [6000 + j for j in range(33)])
    b = seq(a_mgr, base + list(range(900, 911)))
    held = b_mgr.held_prefix_pages(a_mgr.block_hashes_of(b))
    return a_mgr, b_mgr, a_mgr.export_pages(b, first_page=held), held, busy


@pytest.mark.parametrize("room", [False, True])
def test_an_import_that_cannot_fit_promotes_nothing(room):
    """The room check before promoting counted the pages before first_page (in the host tier,
    counted by the peer's lookup) as held: a refused import had promoted them, evicting 7
    other cached pages. With room, the promoted and the sent pages make the sequence."""
    a_mgr, b_mgr, ex, held, busy = _import_setup()
    assert held == 7
    if room:
        b_mgr.release(busy)
    before, saved = b_mgr.stats(), b_mgr.blocks[0].clone()
    if not room:
        with pytest.raises(KVCacheCapacityError, match="import"):
            b_mgr.import_pages(ex.header, ex.data)
        after = b_mgr.stats()
        assert after.tiers == before.tiers and after.evictions == before.evictions
        assert torch.equal(b_mgr.blocks[0], saved)
    else:
        b_mgr.import_pages(ex.header, ex.data)
        host = b_mgr.stats().tiers["host"]
        assert host["promotions"] == 7
        assert host["hits"] - before.tiers["host"]["hits"] == 7   # each counted once
        assert b_mgr.held_prefix_pages(ex.header.block_hashes) == 10
    b_mgr.check_invariants()
    a_mgr.end_lease(ex.lease_id)


def test_attaching_again_closes_the_replaced_disk_tier(tmp_path):
    """A second attach_tiers left the first disk tier's writer thread running (its pending
    writes never flushed by close_tiers, which closes only the current tier)."""
    a = make()
    first = a.attach_tiers(disk_dir=tmp_path / "one", disk_bytes=1 << 20)
    serve(a, SYS + [1])
    second = a.attach_tiers(disk_dir=tmp_path / "two", disk_bytes=1 << 20)
    assert a._tiers is second is not first
    assert not first.disk._thread.is_alive() and second.disk._thread.is_alive()
    a.close_tiers()
    assert not second.disk._thread.is_alive()


def test_a_promotion_that_fits_in_part_counts_only_the_pages_it_brings_back():
    """A fetch's promotion found 4 pages in the host tier with room for 2: it counted (and
    made recently used) all 4 (a review, 2026-11-28); now the 2 it promotes."""
    mgr = make(pages=6)
    mgr.attach_tiers(host_pages=8)
    sys_prompt = SYS[:4 * P]
    serve(mgr, sys_prompt + [1])
    serve(mgr, [7000 + i for i in range(5 * P)] + [1])   # SYS's pages go down
    (busy,) = mgr.claim(1)
    mgr.fetch([BatchItem(busy, list(range(8000, 8000 + 4 * P)))])  # 4 of the 6 pages held
    before = mgr.stats().tiers["host"]
    chunks = [np.asarray(sys_prompt[i * P:(i + 1) * P], np.int64).tobytes() for i in range(4)]
    assert mgr._promote(chunks) == 2
    after = mgr.stats().tiers["host"]
    assert after["hits"] - before["hits"] == 2 == after["promotions"] - before["promotions"]
    mgr.check_invariants()
