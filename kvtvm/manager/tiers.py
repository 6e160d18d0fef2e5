"""Host and disk tiers under the paged manager's prefix cache (plain torch, numpy and files).

When the device pool evicts a cached page it is *demoted*: its bytes go to a bounded host tier
(a preallocated pool of pages, pinned when the cache lives on CUDA) and, if a directory was
given, to a bounded disk tier (written through, so a restarted process finds its long system
prompts warm). A fresh sequence whose prefix misses on the device but hits a lower tier gets
those pages *promoted* back (new device pages, registered as cached) before the fetch plans.

Entries are keyed by the page's chained block hash (:mod:`.hashing`) and carry the page's
token ids and an independent 64-bit fingerprint of its whole prefix; a hit must match both
(content-verified: a hash collision or a stale entry is a miss, counted as ``rejected``).

Disk entries: one file per hash, ``<hash>.kvp`` = magic, JSON meta (tokens, fingerprint,
dtype, shape, checksum), raw bytes. Written to a temp name in the same directory (mode 0600)
then ``os.replace``-d, so a process killed mid-write leaves only complete entries visible; the
checksum is verified on every read and a corrupt or truncated entry is a logged miss (and
removed). The directory is created 0700; one owned by someone else, group/other-writable or
not writable is refused. A ``filelock`` serialises writers of a shared directory; LRU order is
the files' mtimes (touched on a hit), so it survives restarts too.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import struct
import queue
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ..errors import InvalidArgumentError, describe
from .args import check_seconds
from .hashing import CHECKSUM_NAME, chain_hash, checksum, fingerprint

__all__ = ["HostTier", "DiskTier", "TierStore", "TierMixin"]

log = logging.getLogger(__name__)

_MAGIC = b"KVTVMPG1"
_LEN = struct.Struct("<I")


def _counters(capacity, unit) -> dict:
    return {"capacity": capacity, "unit": unit, "entries": 0, "bytes": 0, "hits": 0,
            "misses": 0, "demotions": 0, "promotions": 0, "rejected": 0, "evictions": 0}


class HostTier:
    """At most ``capacity`` pages in host memory, LRU.

    Parameters
    ----------
    capacity : int
        Pages held (a pool ``[capacity, 2, num_layers, page_size, n_kv_heads, head_dim]`` is
        allocated on the first demotion).
    pin_memory : bool
        Pin the pool (for a CUDA cache: faster, asynchronous copies).
    """

    def __init__(self, capacity: int, pin_memory: bool = False):
        self.capacity, self.pin_memory = int(capacity), bool(pin_memory)
        self._pool = None
        self._slots: list[int] = list(range(self.capacity - 1, -1, -1))
        self._index: OrderedDict[int, tuple] = OrderedDict()  # hash -> (slot, tokens, fp)
        self.counters = _counters(self.capacity, "pages")

    def __contains__(self, h: int) -> bool:
        return h in self._index

    def put(self, h: int, fp: int, token_bytes: bytes, data) -> None:
        """Store page ``data`` ``[2, L, P, H, D]`` under hash ``h`` (replacing an entry with
        that hash); the least recently used entry makes room."""
        import torch

        if self.capacity <= 0:
            return
        if self._pool is None:
            self._pool = torch.empty((self.capacity, *data.shape), dtype=data.dtype,
                                     pin_memory=self.pin_memory)
        old = self._index.pop(h, None)
        if old is not None:
            self._slots.append(old[0])
        elif not self._slots:
            _, (slot, _, _) = self._index.popitem(last=False)
            self._slots.append(slot)
            self.counters["evictions"] += 1
        slot = self._slots.pop()
        self._pool[slot].copy_(data)
        self._index[h] = (slot, token_bytes, fp)
        self.counters["demotions"] += 1

    def get(self, h: int, fp: int, token_bytes: bytes):
        """The page under ``h`` if its tokens and prefix fingerprint match, else None."""
        hit = self._index.get(h)
        if hit is None:
            self.counters["misses"] += 1
            return None
        slot, toks, efp = hit
        if toks != token_bytes or efp != fp:
            self.counters["rejected"] += 1
            self.counters["misses"] += 1
            return None
        self._index.move_to_end(h)
        self.counters["hits"] += 1
        return self._pool[slot]

    def stats(self) -> dict:
        c = dict(self.counters)
        c["entries"] = len(self._index)
        c["bytes"] = 0 if self._pool is None else \
            len(self._index) * self._pool[0].numel() * self._pool.element_size()
        return c


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
        self.counters = _counters(self.capacity, "bytes")
        self.counters.update(dropped=0, write_errors=0)
        for tmp in self.dir.glob(".tmp-*"):  # a writer killed mid-write; never visible
            try:
                if tmp.stat().st_mtime < time.time() - 60:
                    tmp.unlink()
            except OSError:
                pass
        self._pending: dict[int, tuple] = {}  # hash -> (fp, token bytes, meta, raw)
        self._guard = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, int(max_pending)))
        self._thread = threading.Thread(target=_writer,
                                        args=(self._queue, weakref.WeakMethod(self._write)),
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
        ``block``: wait for room in the queue instead of dropping. True if queued."""
        import torch

        if self._finalizer.alive is False:
            raise InvalidArgumentError(describe("disk tier", "open", "closed"))
        raw = data.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().copy()
        meta = {"tokens": np.frombuffer(token_bytes, np.int64).tolist(), "fp": fp,
                "dtype": str(data.dtype).removeprefix("torch."), "shape": list(data.shape),
                "checksum": CHECKSUM_NAME, "nbytes": raw.nbytes}
        with self._guard:
            if h in self._pending:
                return False
            self._pending[h] = (fp, token_bytes, meta, raw)
        try:
            self._queue.put(h, block=block)
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
            with self._lock:
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
                self._trim()
        except OSError as err:
            log.warning("disk tier: writing entry %016x failed: %s", h, err)
            self.counters["write_errors"] += 1
        finally:
            with self._guard:
                self._pending.pop(h, None)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued entry is written (or failed); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._pending:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def close(self) -> None:
        """Flush and stop the writer thread (later puts are refused)."""
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

    def _trim(self) -> None:
        entries = self._entries()
        total = sum(e[2] for e in entries)
        for _, p, size in entries:
            if total <= self.capacity:
                break
            try:
                p.unlink()
                total -= size
                self.counters["evictions"] += 1
            except OSError:
                pass

    def _miss(self, path: Path, why: str, drop: bool) -> None:
        log.warning("disk tier: entry %s is a miss: %s", path.name, why)
        self.counters["misses"] += 1
        self.counters["rejected"] += 1
        if drop:
            try:
                path.unlink()
            except OSError:
                pass

    def get(self, h: int, fp: int, token_bytes: bytes, page_shape=None, dtype=None):
        """The page under ``h`` (a CPU tensor) if it reads back whole, its checksum holds and
        its tokens and fingerprint match; else None (logged when the entry is bad)."""
        import torch

        with self._guard:
            queued = self._pending.get(h)
        if queued is not None:  # not on disk yet: the complete entry from the queue
            efp, toks, meta, raw = queued
            if toks != token_bytes or efp != fp:
                self.counters["misses"] += 1
                self.counters["rejected"] += 1
                return None
            self.counters["hits"] += 1
            return torch.from_numpy(raw.copy()).view(getattr(torch, meta["dtype"])).view(
                *meta["shape"])
        path = self._path(h)
        try:
            blob = path.read_bytes()
        except OSError:
            self.counters["misses"] += 1
            return None
        try:
            if blob[:len(_MAGIC)] != _MAGIC:
                raise ValueError("bad magic")
            (n,) = _LEN.unpack_from(blob, len(_MAGIC))
            off = len(_MAGIC) + _LEN.size
            meta = json.loads(blob[off:off + n])
            raw = np.frombuffer(blob, dtype=np.uint8, offset=off + n)
            if raw.nbytes != meta["nbytes"] or checksum(raw) != meta["sum"]:
                raise ValueError("truncated or checksum mismatch")
        except (ValueError, KeyError, struct.error, TypeError) as err:
            self._miss(path, str(err), drop=True)
            return None
        if np.asarray(meta["tokens"], np.int64).tobytes() != token_bytes or meta["fp"] != fp:
            self._miss(path, "tokens differ (hash collision or stale entry)", drop=False)
            return None
        if (page_shape is not None and tuple(meta["shape"]) != tuple(page_shape)) or \
                (dtype is not None and meta["dtype"] != dtype):
            self._miss(path, f"shape/dtype {meta['shape']} {meta['dtype']} differ", drop=False)
            return None
        try:
            os.utime(path)  # most recently used
        except OSError:
            pass
        self.counters["hits"] += 1
        t = torch.from_numpy(raw.copy()).view(getattr(torch, meta["dtype"]))
        return t.view(*meta["shape"])

    def stats(self) -> dict:
        c = dict(self.counters)
        c["pending"] = len(self._pending)
        entries = self._entries()
        c["entries"], c["bytes"] = len(entries), sum(e[2] for e in entries)
        return c


def _writer(q, write_ref) -> None:
    """The disk tier's writer thread: entries in queue order until a None (or the tier is
    gone)."""
    while True:
        h = q.get()
        try:
            write = write_ref()
            if h is None or write is None:
                return
            write(h)
            del write
        except BaseException as err:  # noqa: BLE001 - the thread must keep serving
            log.error("disk tier: writer: %s", err)
        finally:
            q.task_done()


def _stop(q, thread) -> None:
    """Flush and stop a disk tier's writer (close(), garbage collection or exit)."""
    if thread is threading.current_thread():  # collected on the writer itself: it stops
        try:                                   # at its next item (the tier is gone)
            q.put_nowait(None)
        except queue.Full:
            pass
        return
    q.put(None)
    thread.join()


class TierStore:
    """The lower tiers of one cache: host, then disk (either may be absent)."""

    def __init__(self, host: HostTier | None, disk: DiskTier | None, page_shape, dtype: str):
        self.host, self.disk, self.page_shape, self.dtype = host, disk, tuple(page_shape), dtype

    def put(self, h, fp, token_bytes, data) -> None:
        if self.host is not None:
            self.host.put(h, fp, token_bytes, data)
        if self.disk is not None and h not in self.disk:
            self.disk.put(h, fp, token_bytes, data)

    def get(self, h, fp, token_bytes):
        if self.host is not None:
            hit = self.host.get(h, fp, token_bytes)
            if hit is not None:
                self.host.counters["promotions"] += 1
                return hit
        if self.disk is not None:
            hit = self.disk.get(h, fp, token_bytes, self.page_shape, self.dtype)
            if hit is not None:
                self.disk.counters["promotions"] += 1
                return hit
        return None

    def count_prefix(self, hashes) -> int:
        n = 0
        for h in hashes:
            if not ((self.host is not None and h in self.host)
                    or (self.disk is not None and h in self.disk)):
                break
            n += 1
        return n

    def stats(self) -> dict:
        out = {}
        if self.host is not None:
            out["host"] = self.host.stats()
        if self.disk is not None:
            out["disk"] = self.disk.stats()
        return out


class TierMixin:
    """Demotion and promotion of the paged manager's cached pages (see the module doc)."""

    def attach_tiers(self, host_pages: int = 0, disk_dir=None,
                     disk_bytes: int = 1 << 30) -> TierStore:
        """Give the prefix cache lower tiers.

        Parameters
        ----------
        host_pages : int
            Pages the host tier holds (0: none).
        disk_dir : str or Path, optional
            Directory of the disk tier (none if omitted).
        disk_bytes : int
            Size bound of the disk tier.

        Raises
        ------
        InvalidArgumentError
            Prefix caching is off, a size is negative, or ``disk_dir`` is refused.
        """
        if not self.prefix_caching:
            raise InvalidArgumentError(describe("attach_tiers: params.enable_prefix_caching",
                                                True, False))
        for name, v in (("host_pages", host_pages), ("disk_bytes", disk_bytes)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise InvalidArgumentError(describe(name, "an int >= 0", repr(v)))
        if disk_dir is not None and not isinstance(disk_dir, (str, os.PathLike)):
            raise InvalidArgumentError(describe("disk_dir", "a path (str or os.PathLike)",
                                                type(disk_dir).__name__))
        p = self.params
        shape = (2, self.num_layers, self.page_size, p.n_kv_heads, p.head_dim) \
            if not p.quantized else (p.bytes_per_page(self.num_layers),)
        pin = any(getattr(d, "type", str(d)).startswith("cuda") for d in self.devices)
        disk = DiskTier(disk_dir, disk_bytes) if disk_dir is not None else None
        host = HostTier(host_pages, pin_memory=pin) if host_pages else None
        with self._lock:
            self._tiers = TierStore(host, disk, shape, p.tensor_dtype)
            return self._tiers

    def _page_bytes(self, page: int):
        """``[2, L, P, n_kv_heads, D]`` of one page, all devices' heads, on the host."""
        return self._gather([page], (0, self.params.n_kv_heads))[0].cpu()

    def _demote(self, page: int) -> None:
        """Copy cached ``page`` (about to be evicted) to the tiers."""
        key = self._prefix.page_key[page]
        kid = self._prefix.table[key][0]
        chain = self._chain_of(kid)
        if chain is not None:  # a page whose parent chain is gone is unreachable anyway
            self._tiers.put(chain[0], chain[1], key[1], self._page_bytes(page))

    def persist_prefix_cache(self) -> int:
        """Write every cached device page the disk tier lacks (so a restart finds it);
        returns the pages written."""
        with self._lock:
            disk = self._tiers.disk if self._tiers is not None else None
            if disk is None:
                return 0
            n = 0
            for key, (kid, page) in sorted(self._prefix.table.items(), key=lambda kv: kv[1][0]):
                chain = self._chain_of(kid)
                if chain is not None and chain[0] not in disk:
                    n += disk.put(chain[0], chain[1], key[1], self._page_bytes(page),
                                  block=True)
        disk.flush()  # on disk when this returns (the lock is not held while waiting)
        return n

    def flush_tiers(self, timeout: float | None = None) -> bool:
        """Wait until the disk tier's queued writes are on disk; False on timeout."""
        timeout = check_seconds("timeout", timeout)
        tiers = self._tiers
        return tiers is None or tiers.disk is None or tiers.disk.flush(timeout)

    def close_tiers(self) -> None:
        """Flush the disk tier and stop its writer thread (also done at interpreter exit)."""
        tiers = self._tiers
        if tiers is not None and tiers.disk is not None:
            tiers.disk.close()

    def _promote(self, chunks: list, keep=()) -> int:
        """Bring back from the tiers the pages of ``chunks`` (token bytes of full pages, from
        page 0) past the device's longest cached chain, as cached device pages; never evicts
        the pages of ``keep`` or of that chain. Returns the pages promoted."""
        prefix = self._prefix
        held, kids = prefix.lookup(chunks)
        if len(held) == len(chunks):
            return 0
        chain = self._chain_of(kids[-1]) if kids else self._root_chain()
        if chain is None:
            return 0
        h, fp = chain
        found = []
        for chunk in chunks[len(held):]:
            h, fp = chain_hash(h, chunk, self.hash_bits), fingerprint(fp, chunk)
            data = self._tiers.get(h, fp, chunk)
            if data is None:
                break
            found.append((chunk, data, h, fp))
        pins = list(dict.fromkeys(list(keep) + list(held)))
        self._lease_pages(pins)
        try:
            n = min(len(found), self._available_pages())
            pages = self._take(n)
        finally:
            self._unlease_pages(pins)
        parent = kids[-1] if kids else prefix.root
        for page, (chunk, data, h, fp) in zip(pages, found):
            self._scatter([page], data[None])
            parent = prefix.insert(parent, chunk, page)
            self._chain_memo[parent] = (h, fp)
            if page in prefix.page_key:
                prefix.lru[page] = None
            else:
                self._free.append(page)
        return len(pages)
