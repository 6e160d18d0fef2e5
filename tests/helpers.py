"""Helpers shared by tests in several folders (tests/conftest.py puts tests/ on sys.path, so
any test imports them as ``from helpers import ...``)."""

import subprocess
import sys


def run_python(code, *args, env=None, timeout=300):
    """``python -c code *args`` in a fresh process; asserts it exited 0 and returns its
    stdout (a fresh process: what it loads is what a runtime-only user would load)."""
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def run_step(mgr, batch, qkv, planned):
    """One model step through ``mgr``: fetch ``batch``, then append + attention for every
    layer (``qkv`` is ``[(q, k, v)]`` per layer), either through the plain ops or through one
    ``kvtvm.plan.plan_step``; then ``step``. Returns ``[(out, lse)]`` per layer."""
    from kvtvm import ops, plan

    (inp,) = mgr.fetch(batch)
    results = []
    p = plan.plan_step(inp) if planned else None
    for layer, (q, k, v) in enumerate(qkv):
        if planned:
            p.append_kv(layer, k, v)
            results.append(p.attention(layer, q))
        else:
            kc, vc = inp.k_cache(layer), inp.v_cache(layer)
            ops.append_kv(kc, vc, k, v, inp.qo_indptr, inp.cache_lengths, inp.lookup_table)
            n = int(inp.qo_indptr_host[-1])
            if n == inp.batch_size:
                results.append(ops.decode_attention(q, kc, vc, inp.cache_lengths,
                                                    inp.lookup_table))
            else:
                results.append(ops.prefill_attention(q, kc, vc, inp.qo_indptr,
                                                     inp.cache_lengths, inp.lookup_table))
    mgr.step(batch)
    return results
