"""The polls of :meth:`kvtvm.transfer.DistributedTransport.handle`: the receive of a peer's
next message, posted once per (group, peer) and shared by the transports of a group (one made
after another was dropped with a poll pending takes it over: left posted, it would have taken
the next message), checked-and-posted under a lock (two threads polling one peer posted two
receives, one of which took a message nobody read). Each is waited on without a deadline by a
thread of its own: the caller waits on the returned future with a deadline of its own, so
running out of time leaves the receive posted and the group's connections open (a gloo wait
that runs out closes all of them). A dead peer ends the wait with its error.

At exit, a receive still awaited is woken first -- a 1 ms wait on it that runs out, closing
the group's connections (the process is ending) -- so that its thread leaves while the
interpreter still runs: a thread woken later (by the peer exiting too) aborted the process
("terminate called without an active exception"). The hook is registered when this module is
imported (with kvtvm.transfer), after torch.distributed's own, so it runs before them -- and
after the exit handlers an application registers later, which may still use the group."""

from __future__ import annotations

import atexit
import datetime
import queue
import threading
import time
from concurrent.futures import Future

import torch.distributed  # noqa: F401  (imported first: its exit handlers run after ours)

#: For ever, in effect (a gloo wait with no timeout would use the group's, then fail).
FOREVER = datetime.timedelta(days=3650)
_awaited: dict = {}  # listener queue -> the work its thread waits on
_idle: list = []  # queues of listener threads waiting for work (reused: not a thread
#                   started per message)
_lock = threading.Lock()
_polls: dict = {}  # (group, peer) -> (buffer, future) of the posted receive
_polls_lock = threading.Lock()


def pending(key):
    """The posted receive ``(buffer, future)`` of ``key`` (a (group, peer)), or None."""
    return _polls.get(key)


def failed(key) -> BaseException | None:
    """The error that ended the posted receive of ``key`` (the peer went), or None."""
    entry = _polls.get(key)
    return entry[1].exception() if entry is not None and entry[1].done() else None


def posted(key, post):
    """The receive of ``key``, posting it with ``post() -> (buffer, work)`` if none is."""
    with _polls_lock:
        if key not in _polls:
            buf, work = post()
            _polls[key] = (buf, await_receive(work))
        return _polls[key]


def take(key, done) -> bool:
    """Remove the receive of ``key`` whose future ``done`` completed; False when another
    thread took it first."""
    with _polls_lock:
        if _polls.get(key, (None, None))[1] is not done:
            return False
        del _polls[key]
        return True


def await_receive(work) -> Future:
    """A future done when ``work`` (a posted receive) completes, or failed with its error."""
    done = Future()
    with _lock:
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


atexit.register(_wake_at_exit)
