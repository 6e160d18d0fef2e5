"""Per-step table buffers: fixed, preallocated, updated in place, one host-to-device copy a step.

A table-based manager (CONTINUOUS, PAGED) hands the kernels three int32 tables each step:
``cache_lengths [batch]``, ``qo_indptr [batch + 1]`` and ``lookup_table [batch, width]``. They
live in one host buffer (pinned when a CUDA device is used) and one buffer per device, both
allocated once at construction, so the tensors a model captures in a CUDA graph keep their
addresses. A step fills the host buffer, then copies its used prefix to each non-CPU device in
one copy; on a CPU device the host buffer *is* the device buffer.
"""

from __future__ import annotations

from .args import allocate

__all__ = ["StepTables", "table_elems"]


def table_elems(max_batch_size: int, width: int) -> int:
    """int32 elements of the per-step table buffer: cache_lengths | qo_indptr | lookup_table."""
    return max_batch_size + (max_batch_size + 1) + max_batch_size * width


class StepTables:
    """Preallocated per-step tables: a host int32 buffer and one device buffer per device.

    Layout (int32): ``cache_lengths[max_batch] | qo_indptr[max_batch + 1] |
    lookup_table[max_batch, width]``. A step writes the host buffer, then :meth:`upload` copies
    the used prefix to every non-CPU device in one copy per device.
    """

    def __init__(self, max_batch_size: int, width: int, devices):
        import torch

        self.max_batch_size, self.width = max_batch_size, width
        n = table_elems(max_batch_size, width)
        any_cuda = any(d.type == "cuda" for d in devices)
        self.host = allocate("step tables", (n,), torch.int32, "cpu", pin_memory=any_cuda)
        self.host_np = self.host.numpy()
        mb = max_batch_size
        self.cache_lengths = self.host_np[:mb]
        self.qo_indptr = self.host_np[mb:2 * mb + 1]
        self.lookup = self.host_np[2 * mb + 1:].reshape(mb, width)
        self.device_bufs = []
        self._events = []
        self._views = {}  # (device, batch) -> views of the buffer, handed out detached
        for d in devices:
            if d.type == "cpu":
                self.device_bufs.append(self.host)
                self._events.append(None)
            else:
                self.device_bufs.append(allocate("step tables", (n,), torch.int32, d))
                self._events.append(None)

    def wait_host_free(self):
        """Wait until the previous step's host-to-device copies have read the host buffer."""
        for ev in self._events:
            if ev is not None:
                ev.synchronize()

    def upload(self, batch: int):
        """One copy per non-CPU device of the used part of the table buffer."""
        import torch

        used = 2 * self.max_batch_size + 1 + batch * self.width
        for i, buf in enumerate(self.device_bufs):
            if buf is self.host:
                continue
            buf[:used].copy_(self.host[:used], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(buf.device))
            self._events[i] = ev

    def views(self, dev: int, batch: int):
        """(cache_lengths [batch], qo_indptr [batch+1], lookup_table [batch, width]) of a device:
        fresh tensor objects over the fixed buffer (same addresses every step), so that each
        fetch can stamp its own :class:`~kvtvm.inputs.FetchToken` on them. The views are made
        once per batch size; each call hands out ``detach()``-ed aliases of them (a third of
        the cost of slicing anew)."""
        v = self._views.get((dev, batch))
        if v is None:
            buf, mb = self.device_bufs[dev], self.max_batch_size
            v = self._views[(dev, batch)] = (
                buf[:batch], buf[mb:mb + batch + 1],
                buf[2 * mb + 1:2 * mb + 1 + batch * self.width].view(batch, self.width))
        return v[0].detach(), v[1].detach(), v[2].detach()

    def device_nbytes(self) -> int:
        """Bytes of one device buffer."""
        return 4 * table_elems(self.max_batch_size, self.width)

