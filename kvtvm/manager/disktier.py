"""The disk tier under the paged manager's prefix cache (see :mod:`.tiers`): one file per page
in a private directory, written on a background thread to a temp name then renamed, read back
only from a regular file (never through a symlink, never a FIFO or a device), checksummed,
content-checked; a bad entry is a logged miss."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import queue
import stat
import struct
import tempfile
import threading
import time
import weakref
from pathlib import Path

import numpy as np

from ..errors import InvalidArgumentError, describe
from .hashing import CHECKSUM_NAME, checksum
from .hosttier import counters as _counters

__all__ = ["DiskTier", "check_private_dir"]

# a child of the tiers' logger: configuring (or capturing) "kvtvm.manager.tiers" covers it
log = logging.getLogger("kvtvm.manager.tiers.disk")

_MAGIC = b"KVTVMPG1"
_LEN = struct.Struct("<I")
#: Bytes an entry's JSON meta may take at most (tokens of one page, a few numbers).
_META_MAX = 1 << 20
#: Seconds a write waits for the directory's lock (another process writing or trimming);
#: then it fails (a write error), and so do the writes of the next as many seconds at once,
#: so a process stopped while it holds the lock does not stall this one's queue for good.
LOCK_TIMEOUT = 10.0


def check_private_dir(path) -> Path:
    """``path`` as a directory only this user can write: created 0700 if missing; refused
    (InvalidArgumentError naming ``disk_dir``) if owned by someone else, group/other-writable
    or not writable."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError as err:
        raise InvalidArgumentError(describe("disk_dir", "a directory that can be created",
                                            f"{path} ({err})")) from None
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidArgumentError(describe("disk_dir", "a directory", str(path)))
    if st.st_uid != os.getuid():
        raise InvalidArgumentError(describe("disk_dir", f"a directory owned by uid "
                                            f"{os.getuid()}", f"{path} owned by {st.st_uid}"))
    if st.st_mode & 0o022:
        raise InvalidArgumentError(describe("disk_dir", "a directory not writable by group or "
                                            "others", f"{path} mode {oct(st.st_mode & 0o777)}"))
    if not os.access(path, os.W_OK | os.X_OK):
        raise InvalidArgumentError(describe("disk_dir", "a writable directory", str(path)))
    return path


def _mtime(path) -> int | None:
    """``path``'s modification time (ns), None if it cannot be read."""
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


#: A trim of a full disk tier goes down to this share of its capacity (see ``DiskTier._trim``).
LOW_WATER = 0.9
#: Writes between two scans of the directory at most (other processes' entries).
SCAN_EVERY = 64


class DiskTier:
    """Pages in a directory, at most ``capacity_bytes`` of entries, LRU by mtime.

    Writes happen on one background thread (a demotion under the manager's lock only copies
    the page into a bounded queue): until its file is in place a queued entry is served from
    the queue (complete, content-checked like a file), so a read sees the complete entry or a
    miss, never a partial file. :meth:`flush` waits for the queue; :meth:`close` (also run at
    interpreter exit) flushes and stops the thread. A full queue drops the demotion (counted
    as ``dropped``: the disk tier is a cache).

    Parameters
    ----------
    directory : str or Path
        Created 0700 if missing; see :func:`check_private_dir`.
    capacity_bytes : int
        Bound on the entries' total size; the oldest are removed past it.
    max_pending : int
        Pages queued for writing at most.
    """

    def __init__(self, directory, capacity_bytes: int, max_pending: int = 256):
        from filelock import FileLock

        self.dir = check_private_dir(directory)
        self.capacity = int(capacity_bytes)
        self._lock = FileLock(str(self.dir / ".lock"), mode=0o600)
        self._lock_busy_until = 0.0  # monotonic time: writes fail at once until then
        self.counters = _counters(self.capacity, "bytes")
        self.counters.update(dropped=0, write_errors=0)
        for tmp in self.dir.glob(".tmp-*"):  # a writer killed mid-write; never visible
            try:
                if tmp.stat().st_mtime < time.time() - 60:
                    tmp.unlink()
            except OSError:
                pass
        self._pending: dict[int, tuple] = {}  # hash -> (fp, token bytes, meta, raw)
        self._on_disk: int | None = None  # bytes in the directory at the last scan + writes
        self._writes = 0
        self._dir_mtime = None  # the directory's mtime after this tier's last change
        self._guard = threading.Lock()
        #: held from a put's "still open?" to its entry queued, and by close(): a page is
        #: never queued behind the writer's stop (it was, pending for good, flush() hanging)
        self._open_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, int(max_pending)))
        self._thread = threading.Thread(target=_writer, args=(self._queue,),
                                        name="kvtvm-disk-tier", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop, self._queue, self._thread)

    def _path(self, h: int) -> Path:
        return self.dir / f"{h:016x}.kvp"

    def __contains__(self, h: int) -> bool:
        return h in self._pending or self._path(h).exists()

    def put(self, h: int, fp: int, token_bytes: bytes, data, block: bool = False) -> bool:
        """Queue the page under ``h`` for writing (a copy of its bytes; the file is written to
        a temp name then renamed, then the tier is trimmed to capacity, on the writer).
        ``block``: wait for room in the queue instead of dropping. True if queued; False if
        the queue was full, ``h`` was queued already, or the tier is :attr:`closed`."""
        import torch

        if self.closed:
            return False
        raw = data.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().copy()
        meta = {"tokens": np.frombuffer(token_bytes, np.int64).tolist(), "fp": fp,
                "dtype": str(data.dtype).removeprefix("torch."), "shape": list(data.shape),
                "checksum": CHECKSUM_NAME, "nbytes": raw.nbytes}
        with self._open_lock:
            if self.closed:  # closed meanwhile (close_tiers on another thread)
                return False
            with self._guard:
                if h in self._pending:
                    return False
                self._pending[h] = (fp, token_bytes, meta, raw)
            try:  # the entry holds the tier: queued writes outlive a dropped manager
                self._queue.put((h, self), block=block)
            except queue.Full:
                with self._guard:
                    self._pending.pop(h, None)
                self.counters["dropped"] += 1
                return False
        return True

    def _write(self, h: int) -> None:
        """On the writer thread: the file of queued entry ``h``, then it leaves the queue."""
        with self._guard:
            fp, token_bytes, meta, raw = self._pending[h]
        try:
            blob = json.dumps(dict(meta, sum=checksum(raw))).encode()
            # the directory again (it may have been removed -- filelock would recreate it
            # 0755 -- or replaced by one others can write, who could plant entries)
            self._private("writing entry")
            with self._locked():
                if _mtime(self.dir) != self._dir_mtime:  # another tier or process wrote or
                    self._on_disk = None                 # removed entries: scan at the trim
                fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.dir)  # mode 0600
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(_MAGIC + _LEN.pack(len(blob)) + blob)
                        f.write(memoryview(raw))
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, self._path(h))
                except BaseException:
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
                    raise
                self.counters["demotions"] += 1
                self._trim(os.stat(self._path(h)).st_size)
        except (OSError, InvalidArgumentError) as err:
            log.warning("disk tier: writing entry %016x failed: %s", h, err)
            self.counters["write_errors"] += 1
        finally:
            with self._guard:
                self._pending.pop(h, None)

    def _locked(self):
        """The directory's lock, acquired within :data:`LOCK_TIMEOUT` (else OSError)."""
        from filelock import Timeout

        if time.monotonic() < self._lock_busy_until:
            raise OSError(errno.EBUSY, "the directory's lock is held by another process "
                          f"(waited {LOCK_TIMEOUT} s for it moments ago)")
        try:
            return self._lock.acquire(timeout=LOCK_TIMEOUT)
        except Timeout:
            self._lock_busy_until = time.monotonic() + LOCK_TIMEOUT
            raise OSError(errno.EBUSY, f"the directory's lock is held by another process "
                          f"(waited {LOCK_TIMEOUT} s)") from None

    def _private(self, doing: str) -> None:
        """Raise InvalidArgumentError unless the directory is still private (see
        :func:`check_private_dir`; recreated 0700 if it was removed)."""
        try:
            check_private_dir(self.dir)
        except InvalidArgumentError as err:
            raise InvalidArgumentError(f"disk tier: {doing}: {err}") from None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued entry is written (or failed); False on timeout, or when no
        writer is left to write them (a process forked from the tier's: its parent's)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._pending:
            if deadline is not None and time.monotonic() > deadline:
                return False
            if not self._thread.is_alive():  # (a forked child's: the writer is the parent's)
                return not self._pending
            time.sleep(0.001)
        return True

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (or the interpreter is exiting), and in a process
        forked from the tier's (its writer thread stayed with the parent): puts are refused."""
        return not self._finalizer.alive or not self._thread.is_alive()

    def close(self) -> None:
        """Flush and stop the writer thread (later puts are refused). In a process forked from
        the tier's, only marks it closed (:func:`_stop`: no writer here to stop)."""
        with self._open_lock:
            self._finalizer()

    def _entries(self):
        out = []
        for p in self.dir.glob("*.kvp"):
            try:
                st = p.stat()
            except OSError:
                continue
            out.append((st.st_mtime_ns, p, st.st_size))
        return sorted(out)

    def _trim(self, written: int) -> None:
        """Keep the directory within ``capacity`` bytes, oldest entries first, after a write of
        ``written`` bytes. Its bytes are known from the last scan plus this tier's writes
        since: the directory is scanned only when that may pass the capacity, when its
        modification time says another tier or process changed it (checked under the lock
        before each write), or every :data:`SCAN_EVERY` writes, and a trim goes down to
        :data:`LOW_WATER` of it -- so a full tier scans about once per tenth of its capacity
        written, not at every write (a glob and a stat of every entry: writes slowed as the
        directory grew, and the queue overflowed)."""
        self._writes += 1
        if self._on_disk is not None:
            self._on_disk += written
            if self._on_disk <= self.capacity and self._writes % SCAN_EVERY:
                self._dir_mtime = _mtime(self.dir)  # (this write's change; under the lock)
                return
        entries = self._entries()
        total = sum(e[2] for e in entries)
        if total > self.capacity:
            goal = int(self.capacity * LOW_WATER)
            for _, p, size in entries:
                if total <= goal:
                    break
                try:
                    p.unlink()
                    total -= size
                    self.counters["evictions"] += 1
                except OSError:
                    pass
        self._on_disk = total
        self._dir_mtime = _mtime(self.dir)

    def _miss(self, path: Path, why: str, drop: bool) -> None:
        log.warning("disk tier: entry %s is a miss: %s", path.name, why)
        self.counters["misses"] += 1
        self.counters["rejected"] += 1
        if drop:
            try:
                path.unlink()
            except OSError:
                pass

    def on_disk(self, h: int) -> bool:
        """Whether the file of entry ``h`` is in place (not only queued)."""
        return self._path(h).is_file()

    @staticmethod
    def _read_entry(path: Path, limit: int | None) -> bytes:
        """The bytes of entry file ``path``: a regular file of this user's that group and
        others cannot write, not reached through a symlink, of at most ``limit`` bytes.
        Raises OSError, or ValueError for anything else (a FIFO or a device would block or
        never end; a file another user could have written is not trusted)."""
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_NONBLOCK", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"not a regular file (mode {oct(st.st_mode)})")
            # entries are written 0600 by this user (mkstemp): any other is not ours
            if st.st_uid != os.getuid():
                raise ValueError(f"owned by uid {st.st_uid}, not {os.getuid()}")
            if st.st_mode & 0o022:
                raise ValueError(f"group/other-writable (mode {oct(st.st_mode & 0o777)})")
            if limit is not None and st.st_size > limit:
                raise ValueError(f"{st.st_size} bytes, more than an entry's {limit}")
            chunks, left = [], st.st_size
            while left > 0:
                chunk = os.read(fd, left)
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def get(self, h: int, fp: int, token_bytes: bytes, page_shape=None, dtype=None,
            touch: bool = True):
        """The page under ``h`` (a CPU tensor) if it reads back whole, its checksum holds and
        its tokens and fingerprint match (a hit, counted and made the most recently used
        unless ``touch`` is False: a look ahead, :meth:`touch` once it is used); else None
        (logged when the entry is bad: corrupt, truncated, of another format, not a regular
        file or a symlink -- never read)."""
        import torch

        with self._guard:
            queued = self._pending.get(h)
        if queued is not None:  # not on disk yet: the complete entry from the queue
            efp, toks, meta, raw = queued
            if toks != token_bytes or efp != fp:
                self.counters["misses"] += 1
                self.counters["rejected"] += 1
                return None
            self.counters["hits"] += touch
            return torch.from_numpy(raw.copy()).view(getattr(torch, meta["dtype"])).view(
                *meta["shape"])
        path = self._path(h)
        try:  # entries in a directory others can write could be planted: not read
            self._private("reading")
        except InvalidArgumentError as err:
            self._miss(path, str(err), drop=False)
            return None
        limit = None
        if page_shape is not None and dtype is not None:  # an entry of this format's size
            limit = len(_MAGIC) + _LEN.size + _META_MAX + math.prod(page_shape) \
                * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        try:
            blob = self._read_entry(path, limit)
        except FileNotFoundError:
            self.counters["misses"] += 1
            return None
        except (OSError, ValueError) as err:  # a symlink (ELOOP), a FIFO, too big...
            self._miss(path, f"unreadable ({err})", drop=not isinstance(err, PermissionError))
            return None
        foreign = False
        try:
            if blob[:len(_MAGIC)] != _MAGIC:
                raise ValueError("bad magic")
            (n,) = _LEN.unpack_from(blob, len(_MAGIC))
            off = len(_MAGIC) + _LEN.size
            if n > _META_MAX:
                raise ValueError(f"meta of {n} bytes")
            meta = json.loads(blob[off:off + n])
            raw = np.frombuffer(blob, dtype=np.uint8, offset=off + n)
            if meta["checksum"] != CHECKSUM_NAME:  # another process's algorithm (no xxhash
                foreign = True                     # there): not checkable here, not corrupt
                raise ValueError(f"checksum {meta['checksum']!r}, this process checks "
                                 f"{CHECKSUM_NAME!r}")
            if raw.nbytes != meta["nbytes"] or checksum(raw) != meta["sum"]:
                raise ValueError("truncated or checksum mismatch")
            # the checksum covers the bytes only: a damaged meta must be a miss, not a crash
            toks = np.asarray(meta["tokens"], np.int64)
            entry_fp, shape = meta["fp"], tuple(meta["shape"])
            tdtype = getattr(torch, meta["dtype"])
            if not isinstance(tdtype, torch.dtype) or toks.ndim != 1 \
                    or not all(type(d) is int and d >= 0 for d in shape) \
                    or math.prod(shape) * tdtype.itemsize != raw.nbytes:
                raise ValueError(f"meta shape {shape} / dtype {meta['dtype']} do not match "
                                 f"its {raw.nbytes} bytes")
        except (ValueError, KeyError, struct.error, TypeError, OverflowError,
                AttributeError, RecursionError) as err:  # (a meta nested too deep for json)
            self._miss(path, f"{type(err).__name__}: {str(err)[:200]}", drop=not foreign)
            return None
        if toks.tobytes() != token_bytes or entry_fp != fp:
            self._miss(path, "tokens differ (hash collision or stale entry)", drop=False)
            return None
        if (page_shape is not None and shape != tuple(page_shape)) or \
                (dtype is not None and meta["dtype"] != dtype):
            self._miss(path, f"shape/dtype {meta['shape']} {meta['dtype']} differ", drop=False)
            return None
        if touch:
            self.touch(h)
        return torch.from_numpy(raw.copy()).view(tdtype).view(*shape)

    def touch(self, h: int) -> None:
        """Count a hit on entry ``h`` (read with ``touch=False``) and make it the most
        recently used (its file's time)."""
        self.counters["hits"] += 1
        try:
            os.utime(self._path(h))
        except OSError:  # (still queued, or gone since)
            pass

    def stats(self) -> dict:
        c = dict(self.counters)
        c["pending"] = len(self._pending)
        entries = self._entries()
        c["entries"], c["bytes"] = len(entries), sum(e[2] for e in entries)
        return c


def _writer(q) -> None:
    """The disk tier's writer thread: entries ``(hash, tier)`` in queue order until a None.
    Each entry holds its tier, so a tier dropped with writes queued is collected (and its
    writer stopped) only once they are written."""
    while True:
        item = q.get()
        try:
            if item is None:
                return
            h, tier = item
            del item
            tier._write(h)
        except BaseException as err:  # noqa: BLE001 - the thread must keep serving
            log.error("disk tier: writer: %s", err)
        finally:
            tier = None  # the last reference may go here: _stop then runs on this thread
            q.task_done()


def _stop(q, thread) -> None:
    """Flush and stop a disk tier's writer (close(), garbage collection or exit); nothing to do
    when it is gone (a forked child's exit: its queue, perhaps full, has no reader)."""
    if not thread.is_alive():
        return
    if thread is threading.current_thread():  # collected on the writer itself: it stops
        try:                                   # at its next item (the tier is gone)
            q.put_nowait(None)
        except queue.Full:
            pass
        return
    q.put(None)
    thread.join()
