"""What the CPU append kernel's in-kernel bounds checks cost (issue 14: under 2%): the shipped
kernel against the same definition with the checks taken out (a probe-only build: the
``locate`` block's three range checks and the append block's skip test replaced by
``False`` / ``True``; never shipped or loadable through kvtvm's kernel lookup), both built
here, loaded side by side and called alternately on the append benchmark's cases.

``python tools/cpu_append_check_probe.py [--rounds 41]`` (run on an otherwise idle machine).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvtvm import compiler, runtime
from kvtvm.bench.append import make_case
from kvtvm.kernels import append as append_family
from kvtvm.kernels.errflag import ERR_SLOTS

CASES = [(5000, 1), (512, 8), (1, 64)]  # bench append: (tokens a sequence, sequences)
UNCHECKED = [
    ("if vn < T.Cast(\"int64\", qo_indptr[bounds[0]]) \\\n"
     "                        or vn >= T.Cast(\"int64\", qo_indptr[bounds[0] + 1]):", "if False:"),
    ("if pos < T.int64(0) or pos >= max_pages * page_size:", "if False:"),
    ("if page < T.int64(0) or page >= num_pages:", "if False:"),
    ("if seq_of[vn] >= 0:  # checked by ``locate``", "if True:"),
]


def unchecked_family(tmp: Path):
    """The append family module with its checks taken out (written to ``tmp`` and imported, so
    TVMScript can read its source)."""
    src = inspect.getsource(append_family)
    for old, new in UNCHECKED:
        if old not in src:
            raise SystemExit(f"the append definition changed; update the probe: {old!r}")
        src = src.replace(old, new)
    src = src.replace("from ._tvm", "from kvtvm.kernels._tvm").replace(
        "from .", "from kvtvm.kernels.")
    path = tmp / "append_unchecked.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("append_unchecked", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["append_unchecked"] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=41)
    args = parser.parse_args()
    spec = compiler.KernelSpec(op="append", dtype="float16", head_dim=128, n_kv_heads=8)
    tmp = Path(tempfile.mkdtemp(prefix="kvtvm-append-probe-"))
    shipped = compiler.build_spec(spec, tmp / "checked")
    original = append_family.define
    append_family.define = unchecked_family(tmp).define
    try:
        bare = compiler.build_spec(spec, tmp / "unchecked")
    finally:
        append_family.define = original
    fns = {}
    for name, path in (("checked", shipped), ("unchecked", bare)):
        mod = runtime.load_module(str(path), needs_cuda=False)
        fns[name] = (mod, mod[spec.func_name])
    print(f"{'case':>12s} {'checked ms':>11s} {'unchecked ms':>13s} {'cost':>7s}")
    for per_seq, seqs in CASES:
        case = make_case(per_seq, seqs, 8, 128, 16, "float16", "cpu")
        call_args = (case["cache"][:, 0, 0], case["cache"][:, 1, 0], case["k"], case["v"],
                     case["indptr"], case["lengths"], case["table"],
                     torch.zeros(ERR_SLOTS, dtype=torch.int32))
        times = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, (_, fn) in fns.items():
                t0 = time.perf_counter()
                runtime.call_cpu_kernel(fn, call_args)
                times[name].append(time.perf_counter() - t0)
        med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        print(f"{per_seq:>6d} x {seqs:<3d} {med['checked']:11.4f} {med['unchecked']:13.4f} "
              f"{100 * (med['checked'] / med['unchecked'] - 1):+6.1f}%", flush=True)


if __name__ == "__main__":
    main()
