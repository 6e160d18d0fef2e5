"""``python -m kvtvm {build,bench,tune,generate,info}``: the command line."""

from __future__ import annotations

import argparse
import importlib
import itertools
import os
import sys
from pathlib import Path

from . import cliargs, compiler
from .compiler.spec import QUANT_FAMILIES
from .errors import KVCacheError
from .quant import QUANT_DTYPES


def _csv(kind):
    def parse(text):
        values = [kind(x.strip()) for x in text.split(",") if x.strip()]
        if not values:  # `--dtypes=$UNSET` built nothing (or, for --ops, everything), exit 0
            raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
        return values
    return parse


#: compile-time features of the attention families, as ``--features`` names them
ATTENTION_FEATURES = {"none": (), "sliding_window": ("sliding_window",)}
#: The ``build`` option a spec field's error names (``head_dim: ...`` -> ``--head-dims``).
_SIZE_OPTIONS = {"head_dim": "--head-dims", "n_kv_heads": "--kv-heads",
                 "group_size": "--group-sizes", "head_dim / group_size":
                 "--head-dims / --group-sizes"}


def default_specs(target: str, arch: str | None, ops, dtypes, head_dims, kv_heads, groups,
                  layouts, features=("none",), cache_dtypes=("none",)):
    """The cross product of the requested axes, for every family whose kernel exists.

    The copy kernel moves whole rows whatever the head count and layout, so the copy op
    always loads it with ``n_kv_heads=1`` and layout ``nhd``; it is built that way.
    ``features`` (names of :data:`ATTENTION_FEATURES`) apply to decode and prefill.
    ``cache_dtypes``: ``"none"`` (full precision) and/or 8-bit storage types (K and V both
    stored so) for append, decode and prefill; ``"K/V"`` names the two sides apart (e.g.
    ``int8/none``: a K-only cache, ``int8/float8_e4m3fn``). A quantized cache's pages move as
    float32 words, four to a row (``kvtvm.ops.copy``): with ``copy`` and an 8-bit storage type
    that kernel (``float32``, head_dim 4) is built too.
    """
    specs = []
    for op, dtype, d, h, layout in itertools.product(ops, dtypes, head_dims, kv_heads, layouts):
        if op == "copy":
            h, layout = 1, "nhd"
        attention = op in ("decode", "prefill")
        for g, feats in itertools.product(groups if attention else [1],
                                          features if attention else ["none"]):
            quant = op in QUANT_FAMILIES
            for cd in cache_dtypes if quant else ["none"]:
                ks, vs = cliargs.storage_pair(cd)
                specs.append(compiler.KernelSpec(
                    op=op, dtype=dtype, head_dim=d, n_kv_heads=h, group_size=g, layout=layout,
                    target=target, arch=arch, features=ATTENTION_FEATURES[feats],
                    k_storage=ks, v_storage=vs))
    if "copy" in ops and any(cd != "none" for cd in cache_dtypes):
        specs.append(compiler.KernelSpec(op="copy", dtype="float32", head_dim=4, n_kv_heads=1,
                                         group_size=1, layout="nhd", target=target, arch=arch))
    return list(dict.fromkeys(specs))


def available_ops() -> list[str]:
    """Kernel families defined in this installation."""
    ops = []
    for op in compiler.KERNEL_FAMILIES:
        if importlib.util.find_spec(f"kvtvm.kernels.{op}") is not None:
            ops.append(op)
    return ops


def _refused_out(out: Path, specs) -> str:
    """Why ``build --out`` cannot put ``specs`` in ``out`` (``""`` when it can), checked now,
    not once per kernel after each is compiled: a directory that cannot be written, or one
    the loader would refuse (:mod:`kvtvm.compiler.trust`: another user's, or under or holding
    a ``<target>/`` folder group/others can write), with the loader's message."""
    from .compiler.trust import check_before_making, check_trusted, check_trusted_tree

    try:
        check_before_making(out)  # nothing made inside another user's tree
        why = cliargs.unwritable_dir(out)
        if why:
            return f"cannot write kernels to {str(out)!r}: {why}"
        check_trusted_tree(out)
        for folder in dict.fromkeys((out / spec.file_name()).parent for spec in specs):
            if folder.exists():
                check_trusted(folder, "kernel directory")
    except KVCacheError as err:
        return str(err)
    return ""


def cmd_build(args) -> int:
    from . import runtime

    if not runtime.compiler_available():  # once, not as every kernel's failure
        print("error: building kernels needs TVM's compiler; this is the TVM runtime alone "
              "(TVM_USE_RUNTIME_LIB=1 or no libtvm_compiler.so)", file=sys.stderr)
        return 2
    arch = args.arch if args.target == "cuda" else None
    ops = args.ops or available_ops()
    for option, given, known in (("--ops", ops, available_ops()),
                                 ("--dtypes", args.dtypes, cliargs.FLOAT_DTYPES),
                                 ("--layouts", args.layouts, ("nhd", "hnd"))):
        unknown = sorted(set(given) - set(known))
        if unknown:
            print(f"{option}: unknown {unknown}; known: {', '.join(known)}", file=sys.stderr)
            return 2
    unknown = sorted(set(args.features) - set(ATTENTION_FEATURES))
    if unknown:
        print(f"--features: unknown {unknown}; known: {sorted(ATTENTION_FEATURES)}",
              file=sys.stderr)
        return 2
    for cd in args.cache_dtypes:  # (int8/int8/int8 has known parts but is no K/V pair)
        try:
            cliargs.storage_pair(cd)
        except argparse.ArgumentTypeError as err:
            print(f"--cache-dtypes: {err}", file=sys.stderr)
            return 2
    from .errors import KVCacheError

    try:  # an unsupported size (a CUDA head_dim, a zero, a layout that does not fit the
        # CTA) names itself before any build
        specs = default_specs(args.target, arch, ops, args.dtypes, args.head_dims,
                              args.kv_heads, args.group_sizes, args.layouts, args.features,
                              args.cache_dtypes)
        specs = [v for spec in specs for v in compiler.with_runtime_variants(spec)]
        for spec in specs:
            compiler.check_layout(spec)
    except KVCacheError as err:
        print(f"{_SIZE_OPTIONS.get(str(err).split(':')[0].strip(), 'error')}: {err}",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    why = _refused_out(out, specs)
    if why:
        print(f"--out: {why}", file=sys.stderr)
        return 2
    print(f"building {len(specs)} kernels for {args.target}"
          f"{' ' + arch if arch else ''} into {out}")
    from tqdm import tqdm

    failures = 0
    bar = tqdm(specs, desc="kvtvm build", unit="kernel",
               disable=True if args.no_progress else None)
    for i, spec in enumerate(bar, 1):
        name = spec.uri + (f" ({spec.variant})" if spec.variant else "")
        bar.set_postfix_str(name, refresh=False)
        path = out / spec.file_name()
        status = "cached"
        if not (path.exists() and compiler.is_fresh(path, spec)):
            try:
                compiler.build_spec(spec, out)
                status = "built"
            except Exception as err:  # report and go on with the others
                failures += 1
                tqdm.write(f"[{i}/{len(specs)}] {name}: FAILED: {err}", file=sys.stderr)
                continue
        note = ""
        ptxas = path.with_suffix(".ptxas.txt")
        if ptxas.exists():
            usage = compiler.spill_report(ptxas.read_text())
            regs = max((u["registers"] for u in usage.values()), default=0)
            spills = sum(u["spill_stores"] + u["spill_loads"] for u in usage.values())
            note = f" (max {regs} registers, {spills} spill bytes)"
        tqdm.write(f"[{i}/{len(specs)}] {name}: {status}{note}", file=sys.stdout)
    print(f"done: {len(specs) - failures} ok, {failures} failed. Load them with "
          f"KVTVM_KERNEL_PATH={out} or kvtvm.compiler.add_kernel_dir('{out}')")
    return 1 if failures else 0


def cmd_info(args) -> int:
    import tvm

    from . import __version__, runtime

    print(f"kvtvm {__version__}, TVM {compiler.tvm_version()} ({os.path.dirname(tvm.__file__)})")
    print(f"TVM compiler available: {runtime.compiler_available()}")
    try:
        import torch

        cuda = torch.cuda.is_available()
        gpu = torch.cuda.get_device_name(0) if cuda else "none"
    except ImportError:
        gpu = "torch not installed"
    print(f"GPU: {gpu}")
    print(f"kernel families: {', '.join(available_ops())}")
    print("kernel directories (searched in order):")
    for d in compiler.kernel_dirs():
        built = sorted(d.glob("*/*.so")) if d.exists() else []
        by_target: dict[str, int] = {}
        for p in built:
            by_target[p.parent.name] = by_target.get(p.parent.name, 0) + 1
        summary = ", ".join(f"{n} for {t}" for t, n in sorted(by_target.items())) or "empty"
        print(f"  {d}: {summary}")
    return 0


def cmd_generate(args) -> int:
    """Answer one chat prompt with kvtvm's engine (SmolLM2 unless --model is given); with
    ``--model toy`` the prompt is token ids and the answer is token ids."""
    from .engine import (Engine, Request, check_against_reference, load_model,
                         quantized_reference, reference_tokens)
    from .engine.check import reference_tolerance
    from .errors import InvalidArgumentError, KVCacheCapacityError

    if args.max_new_tokens < 1:  # before the model loads; it also sizes the cache below
        print(f"error: --max-new-tokens: expected a positive int, got {args.max_new_tokens}",
              file=sys.stderr)
        return 2
    try:
        model, tok = load_model(args.model, args.dtype, args.device)
    except InvalidArgumentError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if tok is None:          # the toy, a directory without a tokenizer: token ids in and out
        try:
            ids = [int(t) for t in args.prompt.split()]
        except ValueError:
            print(f"error: --model {args.model} has no tokenizer: give --prompt as token ids, "
                  "e.g. --prompt '5 6 7'", file=sys.stderr)
            return 2
    else:
        try:   # argv bytes that are not UTF-8 arrive as lone surrogates: the tokenizer raises
            args.prompt.encode("utf-8")
        except UnicodeEncodeError as err:
            bad = args.prompt[err.start].encode("utf-8", "surrogateescape")
            print(f"error: --prompt: not UTF-8 text (byte {bad!r} at character {err.start}); "
                  "give the prompt in UTF-8", file=sys.stderr)
            return 2
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}],
                                      add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    why = args.disk_tier_dir is not None and cliargs.unwritable_dir(args.disk_tier_dir)
    if why:  # (else named as the manager's disk_dir)
        print(f"error: --disk-tier-dir {args.disk_tier_dir}: {why}", file=sys.stderr)
        return 2
    max_seq_len = max(len(ids), 1) + args.max_new_tokens
    if max_seq_len >= 1 << 31:  # (named as the engine's max_seq_len)
        print(f"error: --max-new-tokens {args.max_new_tokens}: the prompt's {len(ids)} tokens "
              f"+ {args.max_new_tokens} pass the int32 tables' {(1 << 31) - 1}", file=sys.stderr)
        return 2
    try:
        engine = Engine(model, "paged", max_batch_size=1, max_seq_len=max_seq_len,
                        device=args.device,
                        torch_threads=args.torch_threads, kernel_threads=args.kernel_threads,
                        host_tier_pages=args.host_tier_pages, disk_tier_dir=args.disk_tier_dir,
                        **args.cache_storage)
    except KVCacheCapacityError as err:   # the cache is sized by the prompt + new tokens
        print(f"error: --max-new-tokens {args.max_new_tokens}: no room for a cache of the "
              f"prompt's {len(ids)} tokens + {args.max_new_tokens}: {err}", file=sys.stderr)
        return 2
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and len(ids) + args.max_new_tokens > limit:
        print(f"warning: the prompt's {len(ids)} tokens + --max-new-tokens "
              f"{args.max_new_tokens} pass the model's max_position_embeddings ({limit}): "
              "positions past it were never trained", file=sys.stderr)
    req = Request(0, ids, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                  seed=args.seed, top_k=args.top_k)
    rejected = f"request {req.rid}: rejected: "  # said once, below, as --prompt's error
    engine.log = lambda s: s.startswith(rejected) or print(s, file=sys.stderr)
    engine.serve([req])
    if args.disk_tier_dir is not None or args.host_tier_pages:
        written = engine.close()
        print(f"prefix cache: {req.prefix_hit_tokens} prompt tokens from the cache and its "
              f"tiers, {written} pages written to the disk tier", file=sys.stderr)
    if req.status != "done":   # the options are checked and the cache sized: the prompt
        print(f"error: --prompt: {req.error}", file=sys.stderr)
        return 2
    print(" ".join(map(str, req.output)) if tok is None else
          tok.decode(req.output, skip_special_tokens=True).strip())
    if args.check:  # greedy (checked with the options)
        tol = reference_tolerance(model, engine.params)  # None: float32, exact
        with quantized_reference(model, engine.params):  # K/V quantized as the cache does
            want = reference_tokens(model, ids, args.max_new_tokens, req.stop_token_ids)
            problems = check_against_reference(model, [req], rel_tol=tol)
        ref = ("transformers' generate" + (" over the same 8-bit K/V (kvtvm's reference "
               "quantizer at its attention input)" if engine.params.quantized else ""))
        if problems:
            print(f"MISMATCH: {ref} gives {want}, kvtvm {req.output}: {problems[0]}",
                  file=sys.stderr)
            return 1
        if want != req.output:    # near-ties of low precision or an 8-bit cache's rounding
            print(f"checked: kvtvm's {len(req.output)} tokens, each within {100 * tol:.3g}% of "
                  f"the logit range of the best token of {ref} (teacher-forced; it gave "
                  f"{len(want)} tokens)", file=sys.stderr)
        else:
            print(f"checked: {len(want)} tokens equal {ref}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m kvtvm",
                                     description="kvtvm: KV-cache kernels and managers")
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="build kernels ahead of time into a directory",
                       description="Build a set of kernel specs ahead of time. CUDA code is "
                       "compiled by nvcc now (sm_80 + sm_90a SASS for --arch sm_90a), so the "
                       "modules load with the TVM runtime alone.")
    b.add_argument("--target", choices=["llvm", "cuda"], default="cuda")
    b.add_argument("--arch", default="sm_90a", choices=sorted(compiler.CUDA_ARCHS))
    b.add_argument("--out", required=True, type=cliargs.dir_path, help="output directory")
    b.add_argument("--ops", type=_csv(str), default=None,
                   help="comma-separated families (default: all defined)")
    b.add_argument("--dtypes", type=_csv(str), default=["float16", "bfloat16"])
    b.add_argument("--head-dims", type=cliargs.int_list, default=[128])
    b.add_argument("--kv-heads", type=cliargs.int_list, default=[8])
    b.add_argument("--group-sizes", type=cliargs.int_list, default=[4])
    b.add_argument("--layouts", type=_csv(str), default=["nhd", "hnd"])
    b.add_argument("--features", type=_csv(str), default=["none"],
                   help="attention feature sets to build, comma-separated: "
                   f"{', '.join(ATTENTION_FEATURES)} (default: none)")
    b.add_argument("--cache-dtypes", type=_csv(str), default=["none"],
                   help="cache storage types to build append/decode/prefill for, "
                   f"comma-separated: none (full precision), {', '.join(QUANT_DTYPES)} "
                   "(K and V both 8-bit), or K/V pairs such as int8/none (K-only) "
                   "(default: none)")
    b.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none anyway when not on a terminal)")
    b.add_argument("-v", "--verbose", action="store_true",
                   help="log what is built and how long it takes (nvcc commands too)")
    b.set_defaults(func=cmd_build)

    sub.add_parser("bench", help="run a benchmark (python -m kvtvm bench <name> --help)",
                   add_help=False)
    sub.add_parser("tune", help="autotune kernel knobs (python -m kvtvm tune --help)",
                   add_help=False)
    g = sub.add_parser("generate", help="answer a prompt with kvtvm's engine (SmolLM2 default)")
    g.add_argument("--model", default="smollm2", type=cliargs.nonempty,
                   help="'smollm2', a local model directory, or 'toy' (prompt = token ids)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=cliargs.positive_int, default=64)
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu", type=cliargs.device)
    g.add_argument("--temperature", type=cliargs.temperature, default=0.0,
                   help="0: greedy (default)")
    g.add_argument("--top-p", type=cliargs.top_p, default=1.0)
    g.add_argument("--top-k", type=cliargs.nonnegative_int, default=0,
                   help="sample from the k most likely tokens (default 0: all)")
    g.add_argument("--seed", type=cliargs.seed, default=0)
    g.add_argument("--torch-threads", type=cliargs.thread_count, default=1,
                   help="torch intra-op threads (default 1: see kvtvm.engine.threads)")
    g.add_argument("--kernel-threads", type=cliargs.thread_count, default=None,
                   help="kvtvm kernel threads (default KVTVM_NUM_THREADS or the cores)")
    g.add_argument("--check", action="store_true",
                   help="greedy: compare the tokens with transformers' generate (exit 1 if not)")
    g.add_argument("--host-tier-pages", type=cliargs.nonnegative_int, default=0,
                   help="pages of the prefix cache's host tier (default 0: none)")
    g.add_argument("--disk-tier-dir", default=None, type=cliargs.dir_path,
                   help="prefix cache disk tier directory: a later run with the same "
                   "directory reads the prompt's cached pages from it")
    cliargs.add_cache_storage_options(g)
    g.set_defaults(func=cmd_generate)
    i = sub.add_parser("info", help="what is built, for which targets, where the cache lives")
    i.set_defaults(func=cmd_info)

    if argv and argv[0] == "bench":
        from .bench.__main__ import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "tune":
        from .tune import main as tune_main

        return tune_main(argv[1:], prog="python -m kvtvm tune")
    args = parser.parse_args(argv)
    if args.command == "generate":
        args.cache_storage = cliargs.cache_storage_kwargs(g, args)
        if args.check and args.temperature != 0:  # before the model loads
            g.error(f"--check compares greedy tokens: it needs --temperature 0, got "
                    f"{args.temperature}")
    if getattr(args, "verbose", False):
        import logging

        logging.basicConfig(format="%(name)s: %(message)s")
        logging.getLogger("kvtvm").setLevel(logging.DEBUG)
    try:
        return args.func(args)
    except KVCacheError as err:  # a value the options let through that kvtvm refuses
        text = str(err)
        name = text.partition(":")[0]
        if name in vars(args) and name != "command":  # named as the option, not the keyword
            text = f"argument --{name.replace('_', '-')}:{text.partition(':')[2]}"
        print(f"python -m kvtvm {args.command}: error: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
