"""The disk tier under hostile and careless conditions: entries replaced (while the process
runs) by a FIFO, a symlink, a directory or a file of another layout; a disk that refuses
writes; the directory removed or opened to others while the process runs; two processes
sharing one directory at once. Always a logged miss or a typed answer,
never a hang, a crash in a fetch or wrong KV."""

import errno
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from kvtvm.errors import InvalidArgumentError, TransferError
from kvtvm.manager import BatchItem, disktier
from kvtvm.manager.hashing import checksum

from test_manager_tiers import SYS, P, make, serve


def _fresh(tmp_path):
    """A cache whose 3 system-prompt pages are on disk only (a restarted process); returns
    (cache, the pages' files oldest first, their K/V)."""
    a = make()
    a.attach_tiers(disk_dir=tmp_path, disk_bytes=1 << 20)
    _, want = serve(a, SYS + [1])
    assert a.persist_prefix_cache() == 3
    a.close_tiers()
    files = sorted(tmp_path.glob("*.kvp"), key=lambda p: p.stat().st_mtime_ns)
    b = make()
    b.attach_tiers(disk_dir=tmp_path, disk_bytes=1 << 20)
    return b, files, want


def _serve_bounded(mgr, toks, seconds=10.0):
    """serve() on a thread: a hang fails the test instead of blocking it."""
    box = {}
    t = threading.Thread(target=lambda: box.update(r=serve(mgr, toks)), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "the fetch hung on a disk entry"
    return box["r"]


def _rewrite_meta(path, edit):
    """Rewrite entry ``path`` with its JSON meta changed by ``edit(meta, raw) -> raw`` (the
    checksum recomputed: only the meta is wrong, as a file of another layout would be)."""
    blob = path.read_bytes()
    (n,) = struct.unpack_from("<I", blob, 8)
    meta = json.loads(blob[12:12 + n])
    raw = edit(meta, np.frombuffer(blob, np.uint8, offset=12 + n).copy())
    meta["nbytes"], meta["sum"] = raw.nbytes, checksum(raw)
    text = json.dumps(meta).encode()
    path.write_bytes(blob[:8] + struct.pack("<I", len(text)) + text + raw.tobytes())


def _short_bytes(meta, raw):  # same shape and dtype, fewer bytes than they need
    return raw[:raw.nbytes // 2]


def _huge_token(meta, raw):  # a token id no int64 holds
    meta["tokens"][0] = 1 << 70
    return raw


def _odd_dtype(meta, raw):
    meta["dtype"] = "not_a_dtype"
    return raw


def _other_checksum(meta, raw):  # written where xxhash was missing (blake2b_64)
    return raw


def _no_fp(meta, raw):  # one flipped bit in the key: "fp" -> "gp" (the checksum covers bytes)
    meta["gp"] = meta.pop("fp")
    return raw


def _deep_meta(path):
    """Replace the meta of entry ``path`` by JSON nested too deeply for the parser."""
    blob = path.read_bytes()
    (n,) = struct.unpack_from("<I", blob, 8)
    text = b"[" * 50000
    path.write_bytes(blob[:8] + struct.pack("<I", len(text)) + text + blob[12 + n:])


@pytest.mark.parametrize("damage", ["fifo", "symlink", "directory", "short bytes",
                                    "huge token", "odd dtype", "other checksum", "no fp",
                                    "deep meta"])
def test_replaced_entry_is_a_logged_miss(tmp_path, caplog, damage):
    """Was: a FIFO under an entry's name hung the fetch for good (the manager's lock held);
    a meta whose shape needs more bytes than the entry has, or a token past int64, raised
    RuntimeError / OverflowError out of fetch; a symlink was followed; a meta without its
    "fp" or nested too deeply raised KeyError / RecursionError out of every fetch of that
    prefix, for good."""
    mgr, files, want = _fresh(tmp_path)
    victim = files[1]  # the second page: the first still rises
    if damage == "fifo":
        victim.unlink()
        os.mkfifo(victim)
    elif damage == "symlink":  # to a complete entry of the same tier: never read through
        victim.unlink()
        os.symlink(files[0], victim)
    elif damage == "directory":
        victim.unlink()
        victim.mkdir()
    elif damage == "deep meta":
        _deep_meta(victim)
    else:
        _rewrite_meta(victim, {"short bytes": _short_bytes, "huge token": _huge_token,
                               "odd dtype": _odd_dtype, "other checksum": _other_checksum,
                               "no fp": _no_fp}[damage])
        if damage == "other checksum":  # its sum by the other algorithm, named in the meta
            blob = victim.read_bytes()
            (n,) = struct.unpack_from("<I", blob, 8)
            meta = json.loads(blob[12:12 + n])
            raw = blob[12 + n:]
            meta["checksum"] = "blake2b_64"
            meta["sum"] = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
            text = json.dumps(meta).encode()
            victim.write_bytes(blob[:8] + struct.pack("<I", len(text)) + text + raw)
    try:
        with caplog.at_level("WARNING", logger="kvtvm.manager.tiers"):
            hit, got = _serve_bounded(mgr, SYS + [3])
    finally:
        if damage == "fifo":  # a reader stuck opening the FIFO gets an end of file
            try:
                os.close(os.open(victim, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
    assert hit == P and torch.equal(got[0], want[0])  # page 0 rose; page 1 is a miss
    assert "is a miss" in caplog.text and victim.name in caplog.text
    disk = mgr.stats().tiers["disk"]
    assert disk["rejected"] == 1 and disk["hits"] == 1
    if damage in ("fifo", "symlink"):  # the odd entry is gone, its target untouched
        assert not os.path.lexists(victim) and files[0].is_file()
    if damage == "other checksum":  # kept: the other process can read it (was deleted)
        assert victim.is_file()
    mgr.check_invariants()
    st = mgr.stats()
    assert st.pages_free + st.pages_used + st.pages_cached + st.pages_leased == st.pages_total


def test_disk_refusing_writes_persists_nothing_and_says_so(tmp_path, monkeypatch, caplog):
    """Was: persist_prefix_cache returned 3 ("pages written") with no file written (it
    counted the queued pages)."""
    mgr = make()
    mgr.attach_tiers(disk_dir=tmp_path, disk_bytes=1 << 20)
    _, want = serve(mgr, SYS + [1])

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disktier.tempfile, "mkstemp", full)
    with caplog.at_level("WARNING", logger="kvtvm.manager.tiers"):
        assert mgr.persist_prefix_cache() == 0
    assert "No space left" in caplog.text
    disk = mgr.stats().tiers["disk"]
    assert disk["write_errors"] == 3 and disk["entries"] == 0 and disk["pending"] == 0
    assert not list(tmp_path.iterdir()) or not list(tmp_path.glob("*.kvp"))
    hit, got = serve(mgr, SYS + [2])  # the device copy serves on
    assert hit == 12 and torch.equal(got, want)
    monkeypatch.undo()
    assert mgr.persist_prefix_cache() == 3  # the disk takes writes again
    mgr.close_tiers()


SHARER = r"""
import sys, zlib, numpy as np, torch
sys.path.insert(0, sys.argv[3])
from test_manager_tiers import make, P
from kvtvm.manager import BatchItem

def kv_for(prefix):  # the K/V of a page is a function of its whole prefix (one model)
    g = torch.Generator().manual_seed(zlib.crc32(np.asarray(prefix, np.int64).tobytes()))
    return torch.randn((2, 2, P, 2, 4), generator=g)

mgr = make(pages=4)
mgr.attach_tiers(disk_dir=sys.argv[1], disk_bytes=int(sys.argv[2]))
rng = np.random.default_rng(int(sys.argv[4]))
system = list(range(500, 512))
prompts = [system + [int(x)] for x in range(3)] + \
    [rng.integers(0, 40, size=int(rng.integers(5, 14))).tolist() for _ in range(6)]
hits = bad = 0
for rnd in range(int(sys.argv[5])):
    for toks in prompts:
        (s,) = mgr.claim(1)
        (inp,) = mgr.fetch([BatchItem(s, toks)])[:1]
        hit = int(inp.num_cached_tokens[0]) // P
        pages = mgr.pages_of(s)
        for i in range(hit):
            bad += not torch.equal(mgr.blocks[0][pages[i]], kv_for(toks[:(i + 1) * P]))
        for i in range(hit, len(pages)):
            mgr.blocks[0][pages[i]].copy_(kv_for(toks[:(i + 1) * P]))
        mgr.step([BatchItem(s, toks)])
        mgr.release(s)
        hits += hit
    if rnd % 2 == 1:
        mgr.persist_prefix_cache()
    print("round", rnd, flush=True)
mgr.close_tiers()
print("RESULT", hits, bad, mgr.stats().tiers["disk"]["hits"], flush=True)
"""


def test_processes_share_one_directory_one_killed_mid_write(tmp_path):
    """Three processes demote, persist, trim (a 24-entry bound) and promote in one directory
    at once, one of them SIGKILLed while it writes: every page that rises in the two others
    (from their own entries, each other's, or the killed one's) holds the K/V of its
    tokens."""
    here = os.path.dirname(os.path.abspath(__file__))
    entry = 2 * 2 * P * 2 * 4 * 4 + 300  # bytes of one file, about

    def start(seed, rounds):
        return subprocess.Popen([sys.executable, "-c", SHARER, str(tmp_path), str(24 * entry),
                                 here, str(seed), str(rounds)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    procs = [start(seed, 3) for seed in (1, 2, 3)]
    victim = procs.pop()
    try:
        assert victim.stdout.readline().startswith("round")  # it has written: kill it
        time.sleep(0.05)
        victim.kill()
    finally:
        victim.communicate(timeout=60)
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        outs.append(next(ln for ln in out.splitlines() if ln.startswith("RESULT")).split())
    for _, hits, bad, disk_hits in outs:
        assert int(bad) == 0
        assert int(hits) > 0 and int(disk_hits) > 0


def test_directory_removed_while_running_comes_back_private(tmp_path):
    """Was: filelock recreated a removed directory 0755 and the entries went there."""
    disk = tmp_path / "kv"
    mgr = make()
    mgr.attach_tiers(disk_dir=disk, disk_bytes=1 << 20)
    serve(mgr, SYS + [1])
    shutil.rmtree(disk)
    assert mgr.persist_prefix_cache() == 3
    assert oct(disk.stat().st_mode & 0o777) == "0o700"
    mgr.close_tiers()


def test_directory_opened_to_others_while_running_is_not_trusted(tmp_path, caplog):
    """Was: a directory made group/other-writable after attach_tiers (where anyone could
    plant an entry with the right tokens and a valid checksum) was still read -- the planted
    page rose as a hit, wrong K/V -- and written to."""
    mgr, files, want = _fresh(tmp_path)
    _rewrite_meta(files[0], lambda meta, raw: np.zeros_like(raw))  # planted: zeros
    os.chmod(tmp_path, 0o777)
    try:
        with caplog.at_level("WARNING", logger="kvtvm.manager.tiers"):
            hit, got = serve(mgr, SYS + [3])
            assert hit == 0  # never the planted page
            assert "group or others" in caplog.text
            assert mgr.persist_prefix_cache() == 0  # nor written to
    finally:
        os.chmod(tmp_path, 0o700)
    mgr.close_tiers()


def _entry_of_page(files, k):
    """The entry file of the system prompt's page ``k``."""
    for f in files:
        blob = f.read_bytes()
        (n,) = struct.unpack_from("<I", blob, 8)
        if json.loads(blob[12:12 + n])["tokens"] == SYS[k * P:(k + 1) * P]:
            return f
    raise AssertionError(f"no entry holds page {k}")


def _plant_in_last_page(tmp_path, caplog, spoil, why):
    """Page 2's entry planted (zeros, valid checksum) then ``spoil``-ed: a logged miss naming
    ``why``, the file removed; pages 0 and 1 still rise with their own K/V."""
    mgr, files, want = _fresh(tmp_path)
    last = _entry_of_page(files, 2)
    _rewrite_meta(last, lambda meta, raw: np.zeros_like(raw))
    spoil(last)
    with caplog.at_level("WARNING", logger="kvtvm.manager.tiers"):
        hit, got = serve(mgr, SYS + [3])
    assert hit == 2 * P  # never the planted third page
    assert why in caplog.text
    assert not last.exists()
    assert torch.equal(got[:2], want[:2])
    mgr.check_invariants()
    mgr.close_tiers()


@pytest.mark.parametrize("mode", [0o666, 0o620, 0o602])
def test_entry_file_writable_by_others_is_not_trusted(tmp_path, caplog, mode):
    """Was: an entry file others could write (in a private directory; say, copied there by a
    tool that kept its mode) was read and promoted: whoever can write it can plant K/V with a
    valid checksum."""
    _plant_in_last_page(tmp_path, caplog, lambda f: os.chmod(f, mode), "group/other-writable")


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_entry_file_of_another_user_is_not_trusted(tmp_path, caplog):
    """Was: an entry file owned by another uid was read and promoted."""
    _plant_in_last_page(tmp_path, caplog, lambda f: os.chown(f, 12345, -1), "owned by uid 12345")


def test_cache_goes_on_after_close_tiers(tmp_path):
    """Was: once close_tiers() had run (or the interpreter's exit hook), every fetch that had
    to evict a cached page failed with 'disk tier: expected open, got closed'."""
    mgr = make(pages=4)
    mgr.attach_tiers(host_pages=4, disk_dir=tmp_path, disk_bytes=1 << 20)
    _, want = serve(mgr, SYS + [1])
    assert mgr.persist_prefix_cache() == 3
    mgr.close_tiers()
    serve(mgr, list(range(900, 913)))  # evicts the system prompt: host tier only
    assert mgr.stats().tiers["host"]["demotions"] == 3
    hit, got = serve(mgr, SYS + [2])  # rises again (host tier, or the files on disk)
    assert hit == 12 and torch.equal(got, want)
    mgr.check_invariants()
    with pytest.raises(InvalidArgumentError, match="closed"):
        mgr.persist_prefix_cache()


HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)  # what filelock takes: a process stuck while holding it
print("locked", flush=True)
time.sleep(60)
"""


def test_lock_held_by_a_stuck_process_fails_writes_instead_of_hanging(tmp_path, monkeypatch):
    """Was: the writer waited for the directory's lock for ever, so persist_prefix_cache()
    (and Engine.close) hung while another process sharing the directory held it."""
    monkeypatch.setattr(disktier, "LOCK_TIMEOUT", 0.3)
    mgr = make()
    mgr.attach_tiers(disk_dir=tmp_path, disk_bytes=1 << 20)
    serve(mgr, SYS + [1])
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / ".lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        box = {}
        t = threading.Thread(target=lambda: box.update(n=mgr.persist_prefix_cache()),
                             daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), "persist_prefix_cache hung on the lock"
        assert box["n"] == 0 and mgr.stats().tiers["disk"]["write_errors"] == 3
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.35)  # past the fail-fast window; the dead holder's lock is gone
    assert mgr.persist_prefix_cache() == 3
    mgr.close_tiers()


@pytest.mark.parametrize("full_pool", [False, True])
def test_import_refused_over_a_damaged_entry_promotes_nothing(tmp_path, full_pool):
    """The peer counted three pages on our disk (the files exist) and sent from page 3, but
    page 2's entry is damaged: the import is refused ("resend from page 2") and changes
    nothing -- no page promoted, none evicted for it, no promotion counted; the resend from
    page 2 then goes through with the right bytes."""
    rx, files, want = _fresh(tmp_path)
    blob = bytearray(files[-1].read_bytes())  # the newest: page 2
    blob[-1] ^= 0xFF
    files[-1].write_bytes(bytes(blob))
    if full_pool:  # every device page cached: a promotion would have to evict
        serve(rx, list(range(900, 909)))
        serve(rx, list(range(950, 959)))
    src = make()
    (s,) = src.claim(1)
    src.fetch([BatchItem(s, SYS + [1])])
    src.step([BatchItem(s, SYS + [1])])
    assert rx.held_prefix_pages(src.block_hashes_of(s)) == 3  # by file name only
    st0, bytes0 = rx.stats(), [b.clone() for b in rx.blocks]
    ex = src.export_pages(s, first_page=3)
    with pytest.raises(TransferError, match="resend from page 2"):
        rx.import_pages(ex.header, ex.data)
    st1 = rx.stats()
    assert (st1.pages_free, st1.pages_cached) == (st0.pages_free, st0.pages_cached)
    assert st1.tiers["disk"]["promotions"] == st0.tiers["disk"]["promotions"]
    # the look ahead counted no hit (pages 0-1 were read, not used; it counted 2 before)
    assert st1.tiers["disk"]["hits"] == st0.tiers["disk"]["hits"]
    assert all(torch.equal(a, b) for a, b in zip(bytes0, rx.blocks))
    rx.check_invariants()
    ex = src.export_pages(s, first_page=2)
    assert rx.import_pages(ex.header, ex.data) == 2  # page 2 (damaged on disk) and page 3
    st2 = rx.stats().tiers["disk"]
    assert st2["hits"] - st0.tiers["disk"]["hits"] == 2 == \
        st2["promotions"] - st0.tiers["disk"]["promotions"]   # pages 0-1, counted once
    (t,) = rx.claim(1)
    (inp,) = rx.fetch([BatchItem(t, SYS + [1])])
    assert int(inp.num_cached_tokens[0]) == 12
    got = rx.blocks[0][rx.pages_of(t)[:3]]
    assert torch.equal(got[:2], want[:2])  # pages 0-1 from the disk tier
    assert torch.equal(got[2], src.blocks[0][src.pages_of(s)[2]])  # page 2 from the peer
    rx.check_invariants()
