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
