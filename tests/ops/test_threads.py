"""kvtvm's CPU threads: set in one place (runtime.set_num_threads / KVTVM_NUM_THREADS), applied
to TVM's thread pool at a thread's first kernel call, never through os.environ."""

import pytest

from helpers import run_python

CODE = r"""
import os, sys
env = dict(os.environ)
import torch
import kvtvm
from kvtvm import ops, runtime
assert dict(os.environ) == env, "importing kvtvm changed os.environ"
torch.set_num_threads(1)
def threads():
    return len(os.listdir("/proc/self/task"))
before, cpus = threads(), os.sched_getaffinity(0)
kc = torch.randn(600, 16, 2, 64); vc = torch.randn_like(kc)
q = torch.randn(1, 4, 64)
lengths = torch.tensor([9000], dtype=torch.int32)
table = torch.arange(600, dtype=torch.int32).view(1, -1)
out, _ = ops.decode_attention(q, kc, vc, lengths, table, num_splits=4)
assert dict(os.environ) == env, "a kernel call changed os.environ"
assert os.sched_getaffinity(0) == cpus, "the pool pinned the calling thread"
print(runtime.cpu_threads(), threads() - before, len(cpus))
runtime.set_num_threads(1)
again, _ = ops.decode_attention(q, kc, vc, lengths, table, num_splits=4)
assert torch.allclose(out, again, atol=1e-6)
"""


@pytest.mark.parametrize("n", [1, 3])
def test_pool_follows_the_one_knob(n):
    env = {k: v for k, v in __import__("os").environ.items() if k != "TVM_NUM_THREADS"}
    env["KVTVM_NUM_THREADS"] = str(n)
    threads, started, cpus = map(int, run_python(CODE, env=env).split())
    assert threads == n
    # TVM's pool holds a worker per allowed CPU (n when more are asked for) and runs n of
    # them; the calling thread is the first worker
    assert started == max(n, cpus) - 1


def test_set_num_threads_refuses_nonsense():
    from kvtvm import runtime
    from kvtvm.errors import InvalidArgumentError

    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(InvalidArgumentError, match="n"):
            runtime.set_num_threads(bad)


CHURN = r"""
import os, resource, sys, threading, time
import torch
from kvtvm import ops
torch.set_num_threads(1)
def threads():
    return len(os.listdir("/proc/self/task"))
H, D, PS = 1, 16, 16
kc = torch.randn(600, PS, H, D); vc = torch.randn_like(kc)
table = torch.arange(600, dtype=torch.int32).view(1, -1)
lengths = torch.tensor([9000], dtype=torch.int32)        # decode: the parallel kernel
rows = 1 << 16                                          # append: 8 MiB moved, parallel
big_k = torch.randn(1, rows // PS, PS, H, D).view(rows, H, D)
big_cache = torch.zeros(rows // PS, PS, H, D)
ip = torch.tensor([0, rows], dtype=torch.int32)
big_table = torch.arange(rows // PS, dtype=torch.int32).view(1, -1)
zero = torch.tensor([0], dtype=torch.int32)
def work():
    ops.append_kv(big_cache, big_cache.clone(), big_k, big_k, ip, zero, big_table)
    ops.decode_attention(torch.randn(1, 2, D), kc, vc, lengths, table)
start = threads()
for _ in range(int(sys.argv[1])):
    t = threading.Thread(target=work)
    t.start()
    t.join()
time.sleep(1.0)  # TVM's workers spin a while after their last task, then sleep
after = threads()
r = resource.getrusage(resource.RUSAGE_SELF)
c0 = r.ru_utime + r.ru_stime
time.sleep(1.0)
r = resource.getrusage(resource.RUSAGE_SELF)
print(start, after, round(r.ru_utime + r.ru_stime - c0, 3))
sys.stdout.flush()
print("END", time.time())
"""


def test_short_lived_threads_leave_no_threads_cpu_or_slow_exit():
    """200 threads that each call append and decode (their parallel kernels) and end: the
    OS thread count comes back within a few of the start, the idle process burns no CPU and
    exits in under 2 s (TVM keeps one worker pool per calling thread, forever: kvtvm runs
    such threads' parallel kernels on one shared kernel thread)."""
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", CHURN, "200"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=600)
    ended = time.time()
    assert proc.returncode == 0, err[-3000:]
    first, last = out.strip().splitlines()[-2:]
    start, after, idle_cpu = first.split()
    assert int(after) <= int(start) + 3, (start, after)
    # before: about one core busy (the pools' workers of every ended thread)
    assert float(idle_cpu) < 0.1, f"{idle_cpu} CPU-seconds burnt in 1 s of idling"
    assert ended - float(last.split()[1]) < 2.0, "exit took too long"


def test_a_thread_with_its_own_pool_runs_inline_and_matches():
    out = run_python(r"""
import threading, torch
from kvtvm import ops, runtime
kc = torch.randn(600, 16, 1, 16); vc = torch.randn_like(kc)
table = torch.arange(600, dtype=torch.int32).view(1, -1)
lengths = torch.tensor([9000], dtype=torch.int32)
q = torch.randn(1, 2, 16)
want, _ = ops.decode_attention(q, kc, vc, lengths, table)
got = {}
def own():
    runtime.use_own_pool()
    got["own"] = ops.decode_attention(q, kc, vc, lengths, table)[0]
def shared():
    got["shared"] = ops.decode_attention(q, kc, vc, lengths, table)[0]
for f in (own, shared):
    t = threading.Thread(target=f); t.start(); t.join()
print(torch.equal(got["own"], want), torch.equal(got["shared"], want))
""")
    assert out.split() == ["True", "True"]


def test_kvtvm_num_threads_out_of_range_is_named(monkeypatch):
    """The variable took any int (100000 would start 100000 spinning TVM workers), and
    clamped 0 or ignored "abc" silently; it now follows set_num_threads' range."""
    from kvtvm import runtime
    from kvtvm.errors import InvalidArgumentError

    monkeypatch.setattr(runtime, "_num_threads", None)
    for bad in ("0", "-3", "abc", "1.5", str(runtime.MAX_THREADS + 1), "100000"):
        monkeypatch.setenv("KVTVM_NUM_THREADS", bad)
        with pytest.raises(InvalidArgumentError, match="KVTVM_NUM_THREADS") as info:
            runtime.cpu_threads()
        assert repr(bad) in str(info.value)
    monkeypatch.setenv("KVTVM_NUM_THREADS", " 3 ")
    assert runtime.cpu_threads() == 3
    monkeypatch.setenv("KVTVM_NUM_THREADS", "")  # empty: unset
    monkeypatch.setenv("TVM_NUM_THREADS", "2")
    assert runtime.cpu_threads() == 2


def test_a_bad_kvtvm_num_threads_is_named_by_a_serial_call_too(monkeypatch):
    """Small calls run the serial kernels, which never read the thread count: a bad value
    went unnoticed until the first large call."""
    from kvtvm import runtime
    from kvtvm.errors import InvalidArgumentError

    monkeypatch.setattr(runtime, "_num_threads", None)
    monkeypatch.setattr(runtime, "_threads_checked", False)
    monkeypatch.setenv("KVTVM_NUM_THREADS", "abc")
    with pytest.raises(InvalidArgumentError, match="KVTVM_NUM_THREADS"):
        runtime.call_cpu_kernel(lambda: None, (), parallel=False)
    monkeypatch.setenv("KVTVM_NUM_THREADS", "1")
    ran = []
    runtime.call_cpu_kernel(lambda: ran.append(1), (), parallel=False)
    runtime.call_cpu_kernel(lambda: ran.append(2), (), parallel=False)
    assert ran == [1, 2] and runtime._threads_checked


FORK = r"""
import os, sys, threading, time, torch
from kvtvm import ops
torch.set_num_threads(1)
kc = torch.randn(600, 16, 2, 64); vc = torch.randn_like(kc)
q = torch.randn(1, 4, 64)
lengths = torch.tensor([9000], dtype=torch.int32)
table = torch.arange(600, dtype=torch.int32).view(1, -1)
def decode():
    return ops.decode_attention(q, kc, vc, lengths, table, num_splits=4)[0]
want = decode()  # the main thread's pool
if sys.argv[1] == "worker":  # and kvtvm's shared kernel thread
    t = threading.Thread(target=decode); t.start(); t.join()
pid = os.fork()
if pid == 0:
    got = [decode()]
    t = threading.Thread(target=lambda: got.append(decode())); t.start(); t.join()
    os._exit(0 if all(torch.equal(g, want) for g in got) else 3)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print(os.waitstatus_to_exitcode(status)); break
    time.sleep(0.05)
else:
    os.kill(pid, 9); print("hung")
"""


@pytest.mark.parametrize("where", ["main", "worker"])
def test_kernels_run_in_a_forked_child(where):
    """A child forked after kernels ran in the parent (its TVM workers and kvtvm's kernel
    thread did not come along) runs parallel kernels, equal to the parent's; it hung."""
    import os

    env = dict(os.environ, KVTVM_NUM_THREADS="2")
    assert run_python(FORK, where, env=env).split()[-1] == "0"


def test_more_kernel_threads_than_cpus_are_warned_about(monkeypatch, caplog):
    """TVM's workers spin: threads past the CPUs slow the kernels, and the exit (a generate
    with 64 kernel threads on 2 CPUs spent 22 s after its answer)."""
    import logging
    import os

    import torch

    from kvtvm import ops, runtime

    monkeypatch.setattr(runtime, "_warned_oversubscribed", False)
    cpus = len(os.sched_getaffinity(0))
    kc = torch.randn(600, 16, 2, 64)  # (a parallel kernel: a small one runs serially)
    table = torch.arange(600, dtype=torch.int32).view(1, -1)
    lengths = torch.tensor([9000], dtype=torch.int32)
    runtime.set_num_threads(cpus + 1)
    try:
        with caplog.at_level(logging.WARNING, logger="kvtvm.runtime"):
            ops.decode_attention(torch.randn(1, 4, 64), kc, kc.clone(), lengths, table,
                                 num_splits=4)
    finally:
        runtime.set_num_threads(None)
    assert f"{cpus + 1} kernel threads on {cpus} CPUs" in caplog.text
