"""Waiting on a posted ``torch.distributed`` receive without a deadline, on a thread of its own
(what :meth:`kvtvm.transfer.DistributedTransport.handle` does with the receive of its next
message): the caller waits on the returned future with a deadline of its own, so running out
of time leaves the receive posted and the group's connections open (a gloo wait that runs out
closes all of them). A dead peer ends the wait with its error.

At exit, a receive still awaited is woken first -- a 1 ms wait on it that runs out, closing
the group's connections (the process is ending) -- so that its thread leaves while the
interpreter still runs: a thread woken later (by the peer exiting too) aborted the process
("terminate called without an active exception")."""

from __future__ import annotations

import atexit
import datetime
import queue
import threading
import time
from concurrent.futures import Future

#: For ever, in effect (a gloo wait with no timeout would use the group's, then fail).
FOREVER = datetime.timedelta(days=3650)
_awaited: dict = {}  # listener queue -> the work its thread waits on
_idle: list = []  # queues of listener threads waiting for work (reused: not a thread
#                   started per message)
_registered: list = []  # the exit handler, once
_lock = threading.Lock()


def await_receive(work) -> Future:
    """A future done when ``work`` (a posted receive) completes, or failed with its error."""
    done = Future()
    with _lock:
        if not _registered:  # (registered after torch's own exit handlers: runs before them)
            atexit.register(_wake_at_exit)
            _registered.append(True)
        q = _idle.pop() if _idle else None
        if q is None:
            q = queue.SimpleQueue()
            threading.Thread(target=_listen, args=(q,), name="kvtvm-transfer-next",
                             daemon=True).start()
        _awaited[q] = work
    q.put((work, done))
    return done


def _listen(q) -> None:
    while True:
        work, done = q.get()
        try:
            work.wait(timeout=FOREVER)
            done.set_result(None)
        except BaseException as err:  # noqa: BLE001 - the caller re-raises it
            done.set_exception(err)
        with _lock:
            _awaited.pop(q, None)
            _idle.append(q)


def _wake_at_exit() -> None:
    with _lock:
        left = list(_awaited.values())
    for work in left:
        try:
            work.wait(timeout=datetime.timedelta(milliseconds=1))
        except Exception:  # noqa: BLE001 - the expected timeout
            pass
    deadline = time.monotonic() + 1.0
    while _awaited and time.monotonic() < deadline:  # the listeners back in Python
        time.sleep(0.001)
