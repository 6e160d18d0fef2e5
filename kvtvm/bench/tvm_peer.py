"""TVM 0.27's own paged-KV attention kernels (``tvm.relax.frontend.nn.llm``) as a benchmark peer.

Where TVM's compiler is present, a peer kernel is compiled in-process when a benchmark first
asks for it. A machine with the TVM runtime alone (the deployment kvtvm targets, e.g. a GPU
machine) cannot compile, so the peers are built ahead of time like kvtvm's kernels -- CUDA as
an nvcc fatbin, no source -- into ``<kernel dir>/<arch or llvm>/tvm_peer/`` of a kernel
directory on ``KVTVM_KERNEL_PATH``; a prebuilt one is used first wherever it is found::

    python -m kvtvm.bench.tvm_peer --arch sm_90a --out build/kernels   # the GPU benchmarks' shapes

Their calling conventions differ from kvtvm's: one ``[num_pages, 2, H, page, D]`` cache tensor
(K and V interleaved, head-major) and CSR page lists; :mod:`.decode` and :mod:`.prefill` adapt.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import compiler, runtime
from ..errors import CompilerUnavailableError

KINDS = ("decode", "prefill")
_loaded: dict = {}


def file_name(kind: str, dtype: str, n_kv_heads: int, n_q_heads: int, head_dim: int,
              page_size: int, tag: str) -> str:
    """Module path of a peer kernel, relative to a kernel directory; ``tag`` is ``"llvm"``
    or the CUDA arch (llvm builds are also keyed by the CPU they were compiled for)."""
    version = compiler._tvm_version().replace("/", "_")
    cpu = f"-{compiler._cpu_key()}" if tag == "llvm" else ""
    return (f"{tag}/tvm_peer/{kind}_{dtype}_h{n_kv_heads}_q{n_q_heads}_d{head_dim}"
            f"_p{page_size}-tvm{version}{cpu}.so")


def _target(tag: str, kind: str, dtype: str, n_kv_heads: int, head_dim: int):
    """The ``tvm.target.Target`` of ``tag`` (needs the compiler)."""
    import tvm

    if tag == "llvm":  # the host CPU, as kvtvm's own llvm kernels
        return compiler.KernelSpec(op=kind, dtype=dtype, head_dim=head_dim,
                                   n_kv_heads=n_kv_heads).tvm_target()
    return tvm.target.Target({"kind": "cuda", "arch": tag})


def _module(kind, dtype, n_kv_heads, n_q_heads, head_dim, page_size, target):
    """(IRModule, entry name) of TVM's kernel for ``target`` (needs the compiler); the entry
    is named ``kind``."""
    import tvm

    if kind == "decode":
        from tvm.relax.frontend.nn.llm import _decode_kernels as dk

        if target.kind.name == "llvm":
            func = dk._attention_decode_cpu(n_kv_heads, n_q_heads, head_dim, dtype, False, {},
                                            page_size)
        else:
            func = dk._attention_decode(n_kv_heads, n_q_heads, head_dim, dtype, False, {},
                                        target, page_size)
    elif kind == "prefill":
        from tvm.relax.frontend.nn.llm import _prefill_kernels as pk

        if target.kind.name == "llvm":
            func = pk._attention_prefill_cpu(n_kv_heads, n_q_heads, head_dim, dtype, False, {},
                                             page_size=page_size)
        else:
            func = pk._attention_prefill(n_kv_heads, n_q_heads, head_dim, dtype, False, {},
                                         target, page_size=page_size)
    else:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    return tvm.IRModule({kind: func.with_attr("global_symbol", kind)}), kind


def build(kind, dtype, n_kv_heads, n_q_heads, head_dim, page_size, tag, out_dir) -> Path:
    """Build the peer kernel for ``tag`` (``"llvm"`` or a CUDA arch) ahead of time into
    ``out_dir``."""
    target = _target(tag, kind, dtype, n_kv_heads, head_dim)
    mod, _ = _module(kind, dtype, n_kv_heads, n_q_heads, head_dim, page_size, target)
    out = Path(out_dir) / file_name(kind, dtype, n_kv_heads, n_q_heads, head_dim, page_size,
                                    tag)
    return compiler.export_module(mod, target, out, None if tag == "llvm" else tag)


def load(kind, dtype, n_kv_heads, n_q_heads, head_dim, page_size, device: str):
    """The callable peer kernel for tensors on ``device`` (``"cpu"`` or ``"cuda[:N]"``):
    prebuilt in a kernel directory if there is one, else compiled here."""
    import torch

    from ..compiler import target_for_device as target_of

    tgt = target_of(torch.device(device))
    tag = "llvm" if tgt.target == "llvm" else tgt.arch
    key = (kind, dtype, n_kv_heads, n_q_heads, head_dim, page_size, tag)
    if key not in _loaded:
        name = file_name(kind, dtype, n_kv_heads, n_q_heads, head_dim, page_size, tag)
        found = [d / name for d in compiler.kernel_dirs() if (d / name).exists()]
        if found:
            module = runtime.load_module(str(found[0]), needs_cuda=tag != "llvm")
        elif runtime.compiler_available():
            import tvm

            target = _target(tag, kind, dtype, n_kv_heads, head_dim)
            mod, _ = _module(kind, dtype, n_kv_heads, n_q_heads, head_dim, page_size, target)
            with target:
                module = tvm.compile(mod, target=target)
        else:
            raise CompilerUnavailableError(
                f"TVM's built-in {kind} kernel is not prebuilt in any of "
                f"{[str(d) for d in compiler.kernel_dirs()]} and the TVM compiler is absent; "
                "build it with `python -m kvtvm.bench.tvm_peer`")
        _loaded[key] = (module, module[kind])  # the module must outlive its function
    return _loaded[key][1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtvm.bench.tvm_peer",
                                     description="Build TVM's built-in paged attention kernels "
                                     "ahead of time for a machine without TVM's compiler "
                                     "(the shapes of the decode and prefill benchmarks).")
    parser.add_argument("--arch", default="sm_90a",
                        choices=["llvm", *sorted(compiler.FATBIN_ARCHS)],
                        help="a CUDA arch, or llvm (this CPU)")
    parser.add_argument("--out", required=True, help="kernel directory (KVTVM_KERNEL_PATH)")
    parser.add_argument("--dtypes", default="float16")
    parser.add_argument("--n-kv-heads", type=int, default=8)
    parser.add_argument("--n-q-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args(argv)
    for dtype in args.dtypes.split(","):
        for kind in KINDS:
            path = build(kind, dtype, args.n_kv_heads, args.n_q_heads, args.head_dim,
                         args.page_size, args.arch, args.out)
            print(f"built {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
