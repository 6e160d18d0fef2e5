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
from pathlib import Path

import numpy as np

from ..errors import InvalidArgumentError, describe
from .args import INT32_MAX, check_seconds
from .hashing import CHECKSUM_NAME, chain_hash, checksum, fingerprint
from .hosttier import HostTier, counters as _counters

__all__ = ["HostTier", "DiskTier", "TierStore", "TierMixin"]

log = logging.getLogger(__name__)

_MAGIC = b"KVTVMPG1"
_LEN = struct.Struct("<I")


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

    def put_many(self, items: list, rows_of) -> None:
        """Demote pages together: ``items`` = (hash, fingerprint, token bytes, page), oldest
        first; ``rows_of(pages)`` gives their rows. The host tier takes them in one batch
        (:meth:`HostTier.put_many`); the disk tier queues those it lacks, from the host tier's
        slots (or, for pages the host tier did not keep, one more gather to the host)."""
        placed = self.host.put_many(items, rows_of) if self.host is not None else {}
        if self.disk is None:
            return
        todo = [i for i, it in enumerate(items) if it[0] not in self.disk]
        rest = [i for i in todo if i not in placed]
        rows = rows_of([items[i][3] for i in rest]).cpu() if rest else None
        row_of = {i: r for r, i in enumerate(rest)}
        for i in todo:
            h, fp, toks, _ = items[i]
            if h not in self.disk:  # an earlier page of this batch with the same hash
                data = self.host.slot_view(placed[i]) if i in placed else rows[row_of[i]]
                self.disk.put(h, fp, toks, data)

    def put(self, h, fp, token_bytes, data) -> None:
        """Demote one page ``data`` (``[*page_shape]``)."""
        self.put_many([(h, fp, token_bytes, 0)], lambda pages: data[None])

    def find(self, h, fp, token_bytes):
        """A content-verified hit: ``("host", slot)`` or ``("disk", page tensor)``; None on a
        miss in every tier. Counts the hit as a promotion."""
        if self.host is not None:
            slot = self.host.find(h, fp, token_bytes)
            if slot is not None:
                self.host.counters["promotions"] += 1
                return "host", slot
        if self.disk is not None:
            hit = self.disk.get(h, fp, token_bytes, self.page_shape, self.dtype)
            if hit is not None:
                self.disk.counters["promotions"] += 1
                return "disk", hit
        return None

    def get(self, h, fp, token_bytes):
        """The page (a host tensor) of a hit (:meth:`find`), else None."""
        hit = self.find(h, fp, token_bytes)
        if hit is None:
            return None
        return self.host.slot_view(hit[1]) if hit[0] == "host" else hit[1]

    def stage(self, hits: list, device) -> list:
        """Rows of ``hits`` (from :meth:`find`) on ``device``, grouped by tier:
        ``[(positions in hits, [n, *page_shape] rows)]``; host hits in slot order, one copy
        per run of slots."""
        import torch

        out = []
        host = sorted((h[1], i) for i, h in enumerate(hits) if h[0] == "host")
        if host:
            out.append(([i for _, i in host], self.host.read([s for s, _ in host], device)))
        disk = [i for i, h in enumerate(hits) if h[0] == "disk"]
        if disk:
            out.append((disk, torch.stack([hits[i][1] for i in disk])))
        return out

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
        if host_pages > INT32_MAX:
            raise InvalidArgumentError(describe("host_pages", f"at most {INT32_MAX}", host_pages))
        if disk_dir is not None and not isinstance(disk_dir, (str, os.PathLike)):
            raise InvalidArgumentError(describe("disk_dir", "a path (str or os.PathLike)",
                                                type(disk_dir).__name__))
        if disk_dir is not None and not os.fspath(disk_dir):  # Path("") is the current dir
            raise InvalidArgumentError(describe("disk_dir", "a non-empty path", "''"))
        p = self.params
        shape = (2, self.num_layers, self.page_size, p.n_kv_heads, p.head_dim) \
            if not p.quantized else (p.bytes_per_page(self.num_layers),)
        pin = any(getattr(d, "type", str(d)).startswith("cuda") for d in self.devices)
        disk = DiskTier(disk_dir, disk_bytes) if disk_dir is not None else None
        host = HostTier(host_pages, pin_memory=pin, page_shape=shape, dtype=p.tensor_dtype) \
            if host_pages else None
        with self._lock:
            self._tiers = TierStore(host, disk, shape, p.tensor_dtype)
            return self._tiers

    def _page_rows(self, pages: list):
        """``[n, 2, L, P, n_kv_heads, D]`` (``[n, page_bytes]`` quantized) of ``pages``, all
        devices' heads: a view of the cache when they are consecutive on one device."""
        return self._gather(list(pages), (0, self.params.n_kv_heads))

    def _demote(self, pages: list) -> None:
        """Copy cached ``pages`` (about to be evicted, oldest first) to the tiers together:
        one gather, one copy into the host tier, the disk tier's queue. Raises if a copy fails
        (the device pool and the prefix cache unchanged; see :mod:`.hosttier`)."""
        prefix, items = self._prefix, []
        for page in pages:
            key = prefix.page_key[page]
            chain = self._chain_of(prefix.table[key][0])
            if chain is not None:  # a page whose parent chain is gone is unreachable anyway
                items.append((chain[0], chain[1], key[1], page))
        if items:
            self._tiers.put_many(items, self._page_rows)

    def persist_prefix_cache(self) -> int:
        """Write every cached device page the disk tier lacks (so a restart finds it);
        returns the pages written."""
        with self._lock:
            disk = self._tiers.disk if self._tiers is not None else None
            if disk is None:
                return 0
            todo = []
            for key, (kid, page) in sorted(self._prefix.table.items(), key=lambda kv: kv[1][0]):
                chain = self._chain_of(kid)
                if chain is not None and chain[0] not in disk:
                    todo.append((chain[0], chain[1], key[1], page))
            rows = self._page_rows([it[3] for it in todo]).cpu() if todo else None
            n = sum(disk.put(h, fp, toks, rows[i], block=True)
                    for i, (h, fp, toks, _) in enumerate(todo))
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

    def cached_prefix_tokens(self, tokens) -> int:
        """Leading tokens of ``tokens`` (int sequence ``[n]``: the prompt of a fresh
        sequence) that its first fetch would take from the prefix cache instead of computing:
        the full pages of its cached chain in the device pool, then in the lower tiers (by
        hash: "probably"; the fetch checks the tokens). The last token never counts (it is
        always recomputed); 0 without prefix caching. A fetch of only the first ``k`` tokens
        can hit ``(k - 1) // page_size`` pages at most: an engine sizes a prompt's first
        chunk with this so chunked prefill does not recompute what the cache holds."""
        try:
            toks = None if isinstance(tokens, (str, bytes)) else np.array(
                tokens if isinstance(tokens, list) else list(tokens))
        except (TypeError, ValueError):
            toks = None
        if toks is None or toks.ndim != 1 or (toks.size and toks.dtype.kind not in "iu"):
            raise InvalidArgumentError(describe("tokens", "a flat sequence of int token ids",
                                                repr(tokens)[:80]))
        if not self.prefix_caching:
            return 0
        toks = toks.astype(np.int64, copy=False)
        P = self.page_size
        chunks = [toks[i * P:(i + 1) * P].tobytes() for i in range(max(0, toks.size - 1) // P)]
        with self._lock:
            held, kids = self._prefix.lookup(chunks)
            n = len(held)
            chain = None
            if self._tiers is not None and n < len(chunks):
                chain = self._chain_of(kids[-1]) if kids else self._root_chain()
            if chain is not None:
                h, hashes = chain[0], []
                for chunk in chunks[n:]:
                    h = chain_hash(h, chunk, self.hash_bits)
                    hashes.append(h)
                n += self._tiers.count_prefix(hashes)
        return n * P

    def _promote(self, chunks: list, keep=()) -> int:
        """Bring back from the tiers the pages of ``chunks`` (token bytes of full pages, from
        page 0) past the device's longest cached chain, as cached device pages; never evicts
        the pages of ``keep`` or of that chain. The pages found move together: their rows
        are staged on the device (one copy per run of host slots) before any page is taken,
        then written with one scatter per tier. Returns the pages promoted.

        If the scatter fails, nothing is registered and the pages taken go back to the free
        list (pages that were evicted for them stay evicted: they were demoted first)."""
        prefix, tiers = self._prefix, self._tiers
        held, kids = prefix.lookup(chunks)
        if len(held) == len(chunks):
            return 0
        chain = self._chain_of(kids[-1]) if kids else self._root_chain()
        if chain is None:
            return 0
        h, fp = chain
        found = []  # (chunk, hash, fingerprint), (tier, slot or tensor)
        for chunk in chunks[len(held):]:
            h, fp = chain_hash(h, chunk, self.hash_bits), fingerprint(fp, chunk)
            hit = tiers.find(h, fp, chunk)
            if hit is None:
                break
            found.append(((chunk, h, fp), hit))
        n = min(len(found), self._available_pages() - sum(p in prefix.lru for p in
                                                          set(keep) | set(held)))
        if n <= 0:
            return 0
        found = found[:n]
        device = self._blocks[0].device if self.n_devices == 1 else "cpu"
        slots = [hit[1] for _, hit in found if hit[0] == "host"]
        pins = list(dict.fromkeys(list(keep) + list(held)))
        hold = tiers.host.held if tiers.host is not None else set()
        hold.update(slots)  # a demotion below must not give these slots away
        try:
            groups = tiers.stage([hit for _, hit in found], device)
            self._lease_pages(pins)
            try:
                pages = self._take(n)
            finally:
                self._unlease_pages(pins)
            try:
                for pos, rows in groups:
                    self._scatter([pages[i] for i in pos], rows)
            except BaseException:
                self._free.extend(pages)
                raise
        finally:
            hold.difference_update(slots)
        parent = kids[-1] if kids else prefix.root
        for page, ((chunk, h, fp), _) in zip(pages, found):
            parent = prefix.insert(parent, chunk, page)
            self._chain_memo[parent] = (h, fp)
            if page in prefix.page_key:
                prefix.lru[page] = None
            else:
                self._free.append(page)
        return len(pages)
