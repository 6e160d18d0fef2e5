"""The disk tier's writer across close, garbage collection and fork:

- a page queued while ``close_tiers()`` runs on another thread is written or refused, never left
  pending (it was queued behind the writer's stop: pending for good, ``flush_tiers()`` hung);
  a demotion racing the close no longer fails the fetch;
- a manager dropped (garbage-collected) with writes queued still writes them all (the writer
  used to stop at the first entry after the tier was collected, dropping the rest);
- in a process forked from the tier's, the tier is closed (its writer thread is the parent's):
  ``flush_tiers()`` returns, ``persist_prefix_cache()`` is a typed error, the parent's tier
  goes on (it hung in ``flush()``).
"""

import gc
import os
import threading
import time

import pytest

from kvtvm.errors import InvalidArgumentError

from test_manager_tiers import SYS, make, serve


def _cached(mgr, n_prompts):
    for i in range(n_prompts):
        serve(mgr, list(range(1000 * (i + 1), 1000 * (i + 1) + 13)))


@pytest.mark.parametrize("trial", range(6))
def test_close_racing_persist_leaves_nothing_pending(tmp_path, trial):
    mgr = make(pages=24)
    mgr.attach_tiers(disk_dir=tmp_path, disk_bytes=1 << 24)
    _cached(mgr, 6)
    box = {}
    t = threading.Thread(target=lambda: box.update(n=mgr.persist_prefix_cache()), daemon=True)
    t.start()
    time.sleep(0.0005 * trial)
    mgr.close_tiers()
    t.join(20)
    assert not t.is_alive()
    disk = mgr.stats().tiers["disk"]
    assert disk["pending"] == 0, disk
    assert mgr.flush_tiers(5.0)
    assert len(list(tmp_path.glob("*.kvp"))) == disk["demotions"]


def test_put_after_close_is_refused_quietly(tmp_path):
    mgr = make(pages=4)
    mgr.attach_tiers(disk_dir=tmp_path, disk_bytes=1 << 20)
    mgr.close_tiers()
    disk = mgr._tiers.disk
    assert disk.put(123, 0, b"", mgr.blocks[0][0]) is False
    assert disk.flush(1.0) and mgr.stats().tiers["disk"]["pending"] == 0
    serve(mgr, SYS + [1])
    serve(mgr, list(range(900, 913)))  # evicts past the closed disk tier: no error


def test_a_dropped_manager_still_writes_its_queued_pages(tmp_path, monkeypatch):
    gate = threading.Event()  # the writer stalls until the manager is gone
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (gate.wait(20), real_fsync(fd)))
    mgr = make(pages=6)
    mgr.attach_tiers(disk_dir=tmp_path, disk_bytes=1 << 24)
    for i in range(8):  # every prompt evicts the one before it
        serve(mgr, list(range(1000 * (i + 1), 1000 * (i + 1) + 13)))
    counters = mgr._tiers.disk.counters  # (the tier's own dict: read after it is gone)
    writer = mgr._tiers.disk._thread
    assert mgr.stats().tiers["disk"]["pending"] > 0  # writes still queued when it is dropped
    del mgr
    gc.collect()
    gate.set()
    writer.join(20)  # the tier goes once its last entry is written; then its writer stops
    assert not writer.is_alive()
    assert counters["dropped"] == counters["write_errors"] == 0
    assert len(list(tmp_path.glob("*.kvp"))) == counters["demotions"] >= 18


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_sees_the_tier_closed(tmp_path):
    mgr = make(pages=6)
    mgr.attach_tiers(disk_dir=tmp_path, disk_bytes=1 << 24)
    _, want = serve(mgr, SYS + [1])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never hang (killed by the parent after 30 s)
        code = 1
        try:
            os.close(r)
            ok = mgr.flush_tiers() is not None and mgr._tiers.disk.closed
            try:
                mgr.persist_prefix_cache()
            except InvalidArgumentError as err:
                ok = ok and "closed" in str(err)
            else:
                ok = False
            serve(mgr, list(range(900, 913)))  # evicting skips the disk
            code = 0 if ok else 2
        finally:
            os.write(w, bytes([code]))
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.read(r, 1) == b"\x00" and os.waitstatus_to_exitcode(status) == 0
    os.close(r)
    assert mgr.persist_prefix_cache() == 3  # the parent's tier goes on


def _wait_child(pid, seconds=30):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_closes_a_tier_whose_queue_was_full(tmp_path, monkeypatch):
    """The parent's writer stalled and its queue full at the fork: the child's close() (and its
    exit) waited for good to queue the writer's stop."""
    import torch

    from kvtvm.manager.disktier import DiskTier

    gate = threading.Event()
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (gate.wait(20), real_fsync(fd)))
    tier = DiskTier(tmp_path, 1 << 20, max_pending=1)
    page = torch.arange(16, dtype=torch.float32)
    assert tier.put(1, 1, b"\0" * 8, page)              # taken by the writer, stalled
    deadline = time.monotonic() + 10
    while tier._queue.qsize() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tier.put(2, 2, b"\1" * 8, page, block=True)  # fills the queue
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            tier.close()
            code = 0 if tier.closed else 2
        finally:
            os._exit(code)
    assert _wait_child(pid) == 0
    gate.set()
    tier.close()
    assert len(list(tmp_path.glob("*.kvp"))) == 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_an_engine_closes_in_a_forked_child(tmp_path):
    from kvtvm.engine import Engine, Request, build_toy_model

    e = Engine(build_toy_model(num_layers=2), "paged", max_batch_size=2, max_seq_len=48,
               page_size=8, disk_tier_dir=tmp_path)
    e.log = lambda s: None
    e.serve([Request(0, list(range(5, 30)), 2)])
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if e.close() == 0 else 2
        finally:
            os._exit(code)
    assert _wait_child(pid) == 0
    assert e.close() > 0  # the parent's tier persists its pages


def test_a_full_disk_tier_scans_its_directory_rarely_and_stays_bounded(tmp_path, monkeypatch):
    """Each write globbed and stat'ed every entry to trim the directory (writes slowed as it
    grew, and a busy tier's queue overflowed). Now it scans when its known bytes may pass
    the capacity, trims to LOW_WATER of it, or every SCAN_EVERY writes; never past capacity."""
    import torch

    from kvtvm.manager import disktier
    from kvtvm.manager.disktier import DiskTier

    page = torch.arange(64, dtype=torch.float32)      # 256 bytes of data an entry
    tier = DiskTier(tmp_path, 40 * 400)
    scans = []
    real = tier._entries
    monkeypatch.setattr(tier, "_entries", lambda: scans.append(1) or real())
    sizes = []
    for i in range(400):
        assert tier.put(i, i, i.to_bytes(8, "little"), page, block=True)
        tier.flush()
        sizes.append(sum(p.stat().st_size for p in tmp_path.glob("*.kvp")))
    assert max(sizes) <= tier.capacity
    assert min(sizes[100:]) >= disktier.LOW_WATER * tier.capacity - 2 * sizes[0]
    assert len(scans) <= 400 // disktier.SCAN_EVERY + 400 // 3, len(scans)   # was 400
    assert tier.counters["evictions"] > 300
    tier.close()


def test_two_disk_tiers_on_one_directory_stay_within_its_bound(tmp_path):
    """Two tiers (or processes) writing one directory: each knew only its own writes, so the
    directory grew to about twice disk_bytes (a review, 2026-11-28). A tier now scans when
    the directory's mtime says someone else changed it."""
    import torch

    from kvtvm.manager.disktier import DiskTier

    page = torch.arange(64, dtype=torch.float32)
    a, b = DiskTier(tmp_path, 40 * 400), DiskTier(tmp_path, 40 * 400)
    most = 0
    for i in range(300):
        tier = (a, b)[i % 2]
        assert tier.put(i, i, i.to_bytes(8, "little"), page, block=True)
        tier.flush()
        most = max(most, sum(p.stat().st_size for p in tmp_path.glob("*.kvp")))
    assert most <= a.capacity, most
    a.close()
    b.close()
