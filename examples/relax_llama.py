"""A small Llama compiled with TVM Relax, its KV cache held by a kvtvm manager.

The decoder is written with ``tvm.relax.frontend.nn`` (embeddings, RMSNorm, q/k/v projections,
RoPE, o-proj, SwiGLU MLP, final norm, lm_head); the KV append and the attention are kvtvm's
kernels, added to the same IRModule and called with ``call_tir`` through :mod:`kvtvm.relax`.
Two Relax functions are compiled for the CPU (llvm):

- ``prefill``: a ragged batch of any mix of new prompts and decoding sequences (kvtvm's
  prefill attention kernel);
- ``decode``: one new token per sequence (kvtvm's split-KV decode kernel).

A :class:`kvtvm.manager.PagedKVCacheManager` (prefix caching on) feeds them: requests are
claimed, fetched, run, stepped and released; a late request that shares the system prompt
reuses its cached pages. The weights are a random-weight ``transformers`` ``LlamaForCausalLM``
(fixed seed); every request's greedy tokens must equal ``model.generate(do_sample=False)`` on
that request alone, or the script exits non-zero saying where.

Run: ``python examples/relax_llama.py`` (``--help`` for the sizes).

Ahead of time, for a GPU machine that has the TVM runtime but not its compiler (the Relax VM is
part of the runtime)::

    python examples/relax_llama.py --export build/relax_llama_sm90a.so --arch sm_90a  # here
    python examples/relax_llama.py --load build/relax_llama_sm90a.so --device cuda    # there

The export compiles the model for CUDA (TVM's default GPU schedules for the model's own
operators, kvtvm's hand-scheduled kernels for the KV cache), compiles the CUDA code with nvcc
into a fatbin embedded in the file, and writes the parameter order beside it
(``<file>.json``); the load path imports neither ``tvm.relax`` nor the compiler.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import kvtvm.relax as kr
from kvtvm import KVCacheParams
from kvtvm.compiler.trust import (check_digest, check_trusted, check_trusted_tree, sha256_of,
                                  write_file)
from kvtvm.errors import CorruptKernelError
from kvtvm.manager import BatchItem, PagedKVCacheManager


@dataclass
class Config:
    """Model and run sizes (defaults: the issue's small Llama)."""

    num_layers: int = 4
    hidden: int = 256
    intermediate: int = 512
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 32
    vocab: int = 1000
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    seed: int = 0
    page_size: int = 8
    max_seq_len: int = 96
    new_tokens: int = 8
    #: (arrival step, prompt length, shares the system prompt)
    requests: tuple = ((0, 21, True), (0, 7, False), (0, 16, False), (3, 13, True))
    system_prompt_len: int = 17
    #: where the Relax model runs: "cpu" (compiled here for llvm) or "cuda"
    device: str = "cpu"
    #: CUDA arch of an ahead-of-time CUDA build (``--export --arch``)
    arch: str = "sm_90a"


# ------------------------------------------------------------------------------------------
# The reference model
# ------------------------------------------------------------------------------------------


def make_hf_model(cfg: Config):
    """A random-weight ``transformers`` Llama (float32, eval, no early stop on eos)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden,
                         intermediate_size=cfg.intermediate, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                         head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_eps,
                         max_position_embeddings=cfg.max_seq_len,
                         rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                         bos_token_id=None, eos_token_id=None, pad_token_id=0,
                         tie_word_embeddings=False)
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(hf_cfg).eval()
    # default init is std 0.02 with zero-free norms at 1: widen it so logits are well separated
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08 if "embed" not in name else 1.0)
    return model


def hf_generate(model, prompt: list[int], new_tokens: int) -> list[int]:
    """``transformers``' own greedy generation of ``new_tokens`` tokens after ``prompt``."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    return out[0, len(prompt):].tolist()


def rope_tables(model, cfg: Config):
    """(cos, sin) ``[max_seq_len, head_dim]`` float32 exactly as transformers computes them."""
    positions = torch.arange(cfg.max_seq_len)[None]
    x = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(x, positions)
    return cos[0].contiguous(), sin[0].contiguous()


# ------------------------------------------------------------------------------------------
# The Relax model (tvm.relax.frontend.nn)
# ------------------------------------------------------------------------------------------


def build_relax_model(cfg: Config):
    """nn.Module classes of the decoder; parameter names equal transformers' state-dict keys."""
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn import op

    D, HQ, H = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    kern = dict(target="cuda", arch=cfg.arch) if cfg.device == "cuda" else {}

    def take_rows(table, rows):
        """``table[rows]``, indices clipped into range (``nn.op.take``'s "fast" mode reads out
        of bounds on a bad index)."""
        from tvm import relax

        return op.wrap_nested(relax.op.take(table._expr, rows._expr, axis=0, mode="clip"),
                              "take_rows")

    class Embedding(nn.Module):
        def __init__(self):
            self.weight = nn.Parameter((cfg.vocab, cfg.hidden), "float32")

        def forward(self, ids):
            return take_rows(self.weight, ids)

    def rotate(x, cos, sin):
        """x * cos + rotate_half(x) * sin, x ``[n, heads, D]``, cos/sin ``[n, 1, D]``."""
        x1, x2 = op.split(x, 2, axis=2)
        return x * cos + op.concat([op.negative(x2), x1], dim=2) * sin

    class Attention(nn.Module):
        def __init__(self):
            self.q_proj = nn.Linear(cfg.hidden, HQ * D, bias=False)
            self.k_proj = nn.Linear(cfg.hidden, H * D, bias=False)
            self.v_proj = nn.Linear(cfg.hidden, H * D, bias=False)
            self.o_proj = nn.Linear(HQ * D, cfg.hidden, bias=False)

        def forward(self, x, cos, sin, k_cache, v_cache, kv, decode: bool):
            n = x.shape[0]
            q = rotate(op.reshape(self.q_proj(x), [n, HQ, D]), cos, sin)
            k = rotate(op.reshape(self.k_proj(x), [n, H, D]), cos, sin)
            v = op.reshape(self.v_proj(x), [n, H, D])
            flag = dict(error_flag=kv["error_flag"])  # what check_errors() reports
            k_cache, v_cache = kr.nn_append_kv(k_cache, v_cache, k, v, kv["qo_indptr"],
                                               kv["cache_lengths"], kv["lookup_table"],
                                               **kern, **flag)
            if decode:  # one token per sequence: row b is sequence b
                o = kr.nn_decode_attention(q, k_cache, v_cache, kv["cache_lengths"],
                                           kv["lookup_table"], **kern, **flag)
            else:
                o = kr.nn_attention(q, k_cache, v_cache, kv["qo_indptr"],
                                    kv["cache_lengths"], kv["lookup_table"], **kern, **flag)
            return self.o_proj(op.reshape(o, [n, HQ * D]))

    class MLP(nn.Module):
        def __init__(self):
            self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
            self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
            self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

        def forward(self, x):
            return self.down_proj(op.silu(self.gate_proj(x)) * self.up_proj(x))

    class Layer(nn.Module):
        def __init__(self):
            self.self_attn = Attention()
            self.mlp = MLP()
            self.input_layernorm = nn.RMSNorm(cfg.hidden, -1, cfg.rms_eps, bias=False)
            self.post_attention_layernorm = nn.RMSNorm(cfg.hidden, -1, cfg.rms_eps, bias=False)

        def forward(self, x, cos, sin, k_cache, v_cache, kv, decode):
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, kv,
                                   decode)
            return x + self.mlp(self.post_attention_layernorm(x))

    class Model(nn.Module):
        def __init__(self):
            self.embed_tokens = Embedding()
            self.layers = nn.ModuleList([Layer() for _ in range(cfg.num_layers)])
            self.norm = nn.RMSNorm(cfg.hidden, -1, cfg.rms_eps, bias=False)

    class LlamaForCausalLM(nn.Module):
        def __init__(self):
            self.model = Model()
            self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
            self.rope_cos = nn.Parameter((cfg.max_seq_len, D), "float32")
            self.rope_sin = nn.Parameter((cfg.max_seq_len, D), "float32")

        def _run(self, input_ids, positions, logit_rows, kv_caches, kv, decode):
            n = input_ids.shape[0]
            cos = op.reshape(take_rows(self.rope_cos, positions), [n, 1, D])
            sin = op.reshape(take_rows(self.rope_sin, positions), [n, 1, D])
            x = self.model.embed_tokens(input_ids)
            for i, layer in enumerate(self.model.layers):
                x = layer(x, cos, sin, kv_caches[2 * i], kv_caches[2 * i + 1], kv, decode)
            if logit_rows is not None:  # the last new token of each sequence
                x = take_rows(x, logit_rows)
            return self.lm_head(self.model.norm(x))

        def prefill(self, input_ids, positions, logit_rows, kv_caches, qo_indptr,
                    cache_lengths, lookup_table, error_flag):
            kv = dict(qo_indptr=qo_indptr, cache_lengths=cache_lengths,
                      lookup_table=lookup_table, error_flag=error_flag)
            return self._run(input_ids, positions, logit_rows, kv_caches, kv, decode=False)

        def decode(self, input_ids, positions, kv_caches, qo_indptr, cache_lengths,
                   lookup_table, error_flag):
            kv = dict(qo_indptr=qo_indptr, cache_lengths=cache_lengths,
                      lookup_table=lookup_table, error_flag=error_flag)
            return self._run(input_ids, positions, None, kv_caches, kv, decode=True)

    return LlamaForCausalLM()


def compile_relax(cfg: Config, manager):
    """Export the Relax model (``prefill`` and ``decode``) and compile it for ``cfg.device``
    (llvm for the CPU; CUDA ``cfg.arch``). Returns ``(VM executable, parameter names)``.

    The KV parameters of each function are typed from ``manager.input_symbols()``
    (:func:`kvtvm.relax.kv_input_vars_for`), so the VM checks every fetched input's shape.
    """
    import tvm
    from tvm.relax.frontend.nn import spec

    model = build_relax_model(cfg)
    specs = {}
    for name in ("prefill", "decode"):
        kv = kr.kv_input_vars_for(manager)  # fresh symbolic vars per function
        kv_spec = kr.nn_kv_spec(kv)
        batch = kv.batch
        tokens = batch if name == "decode" else "num_tokens"
        s = {"input_ids": spec.Tensor([tokens], "int32"),
             "positions": spec.Tensor([tokens], "int32"), **kv_spec,
             "$": {"param_mode": "plain", "effect_mode": "none"}}
        if name == "prefill":
            s["logit_rows"] = spec.Tensor([batch], "int32")
        specs[name] = s
    mod, named_params = model.export_tvm(spec=specs)
    if cfg.device == "cuda":
        target = tvm.target.Target({"kind": "cuda", "arch": cfg.arch})
    else:
        target = kr.llvm_target()
    return tvm.compile(mod, target=target), [n for n, _ in named_params]


def export_relax(cfg: Config, path) -> Path:
    """Compile the model for ``cfg.device`` here and export it to ``path`` (CUDA: nvcc fatbin
    embedded, loadable with the TVM runtime alone), with its parameter names and sizes in
    ``<path>.json``."""
    from kvtvm import compiler

    executable, names = compile_relax(cfg, make_manager(dataclasses.replace(cfg, device="cpu")))
    path = Path(path)
    compiler.export_built(executable.mod, path, cfg.arch if cfg.device == "cuda" else None)
    meta = {"params": names, "sha256": sha256_of(path),
            "config": {k: v for k, v in dataclasses.asdict(cfg).items()
                       if k not in ("requests", "new_tokens")}}
    write_file(Path(str(path) + ".json"), json.dumps(meta, indent=1))
    return path


def load_relax(cfg: Config, path):
    """A Relax VM on ``cfg.device`` over the module exported by :func:`export_relax`, with the
    TVM runtime only; returns ``(vm, parameter names)``."""
    import tvm
    from tvm.runtime.vm import VirtualMachine

    from kvtvm import runtime

    path, meta_path = Path(path), Path(str(path) + ".json")
    # nothing runs unless kvtvm wrote it: the module and its record are this user's (or root's),
    # no one else can write them or a directory above them, and the bytes are those exported
    check_trusted_tree(path, "exported Relax module")
    check_trusted(meta_path, "exported Relax module's record")
    meta = json.loads(meta_path.read_text())
    why = check_digest(path, meta)
    if why is not None:
        raise CorruptKernelError(f"exported Relax module {path}: {why}; export it again")
    theirs = {k: v for k, v in meta["config"].items() if k != "arch"}  # (any arch loads)
    mine = {k: v for k, v in dataclasses.asdict(cfg).items() if k in theirs}
    if mine != theirs:
        diff = {k: (theirs[k], v) for k, v in mine.items() if theirs[k] != v}
        raise SystemExit(f"{path} was exported for another configuration: (exported, now) {diff}")
    module = runtime.load_module(str(path), needs_cuda=cfg.device == "cuda")
    dev = tvm.cuda() if cfg.device == "cuda" else tvm.cpu()
    return VirtualMachine(module, dev), meta["params"]


# ------------------------------------------------------------------------------------------
# Serving loop
# ------------------------------------------------------------------------------------------


def make_prompts(cfg: Config) -> list[tuple[int, list[int]]]:
    """(arrival step, prompt) of each request; shared ones start with the system prompt."""
    rng = np.random.default_rng(cfg.seed + 1)
    system = rng.integers(3, cfg.vocab, cfg.system_prompt_len).tolist()
    out = []
    for arrive, length, shared in cfg.requests:
        own = rng.integers(3, cfg.vocab, length).tolist()
        out.append((arrive, (system + own) if shared else own))
    return out


def serve(cfg: Config, vm, weights, manager, requests, log=print):
    """Greedy-decode every request through the Relax VM, the manager holding the cache.

    Returns ``(tokens per request, stats dict)``.
    """
    pending = sorted(range(len(requests)), key=lambda r: requests[r][0])
    active: dict[int, dict] = {}   # request -> {"seq": id, "feed": tokens, "out": [...]}
    results: dict[int, list[int]] = {}
    stats = {"steps": 0, "prefill_calls": 0, "decode_calls": 0, "prefix_hit_tokens": 0,
             "prompt_tokens": 0, "computed_tokens": 0}
    step = 0
    while pending or active:
        while pending and requests[pending[0]][0] <= step:
            r = pending.pop(0)
            seq = manager.claim(1)[0]
            active[r] = {"seq": seq, "feed": list(requests[r][1]), "out": []}
            stats["prompt_tokens"] += len(requests[r][1])
        order = sorted(active)
        batch = [BatchItem(active[r]["seq"], active[r]["feed"]) for r in order]
        inp = manager.fetch(batch)[0]
        cached = inp.num_cached_tokens
        cl, qo = inp.cache_lengths_host, inp.qo_indptr_host
        ids, pos = [], []
        for b, r in enumerate(order):
            run = active[r]["feed"][cached[b]:]
            ids += run
            pos += range(int(cl[b]), int(cl[b]) + len(run))
        stats["prefix_hit_tokens"] += sum(cached)
        stats["computed_tokens"] += len(ids)
        ids_t = torch.tensor(ids, dtype=torch.int32, device=cfg.device)
        pos_t = torch.tensor(pos, dtype=torch.int32, device=cfg.device)
        kv_args = kr.kv_call_args(inp)
        caches, tables = kv_args[:-4], kv_args[-4:]  # + the error flag
        if len(ids) == len(order):  # every sequence adds one token: the decode kernel
            logits = vm["decode"](ids_t, pos_t, caches, *tables, *weights)
            stats["decode_calls"] += 1
            kind = "decode"
        else:
            rows = torch.from_numpy(qo[1:].astype(np.int32) - 1).to(cfg.device)
            logits = vm["prefill"](ids_t, pos_t, rows, caches, *tables, *weights)
            stats["prefill_calls"] += 1
            kind = "prefill"
        kr.check_errors(cfg.device)  # KernelIndexError if a kernel skipped a bad entry
        manager.step(batch)
        nxt = torch.from_dlpack(logits).argmax(-1).tolist()
        if kind == "prefill" and log:
            hits = [f"r{r}:{len(active[r]['feed'])}" + (f"(hit {cached[b]})" if cached[b] else "")
                    for b, r in enumerate(order) if len(active[r]["feed"]) > 1]
            log(f"  step {step}: ragged prefill of {len(ids)} tokens for {len(order)} "
                f"sequences; new prompts {', '.join(hits)}")
        for b, r in enumerate(order):
            st = active[r]
            st["out"].append(int(nxt[b]))
            st["feed"] = [int(nxt[b])]
            if len(st["out"]) == cfg.new_tokens:
                results[r] = st["out"]
                manager.release(st["seq"])
                del active[r]
        step += 1
    stats["steps"] = step
    return [results[r] for r in range(len(requests))], stats


def make_manager(cfg: Config) -> PagedKVCacheManager:
    """The paged manager (prefix caching on) holding the Relax model's KV cache."""
    params = KVCacheParams("float32", n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                           cache_strategy="paged", page_size=cfg.page_size,
                           enable_prefix_caching=True)
    return PagedKVCacheManager(params, max_batch_size=len(cfg.requests),
                               max_seq_len=cfg.max_seq_len, num_layers=cfg.num_layers,
                               devices=(cfg.device,))


@dataclass
class Built:
    """Everything :func:`run` builds: the reference model, the weights by Relax parameter
    name, the manager, the VM and the weights in the VM functions' parameter order."""

    hf: object
    weights: dict
    manager: PagedKVCacheManager
    vm: object
    weight_list: list
    compile_s: float


def build(cfg: Config, load=None) -> Built:
    """The transformers model, its weights (plus transformers' RoPE tables), a manager and
    the Relax VM: compiled here, or loaded from ``load`` (a file of :func:`export_relax`)."""
    hf = make_hf_model(cfg)
    weights = {k: v.detach().contiguous() for k, v in hf.state_dict().items()}
    weights["rope_cos"], weights["rope_sin"] = rope_tables(hf, cfg)
    weights = {k: v.to(cfg.device) for k, v in weights.items()}
    manager = make_manager(cfg)
    t0 = time.perf_counter()
    if load is None:
        import tvm
        from tvm import relax

        executable, names = compile_relax(cfg, manager)
        dev = tvm.cuda() if cfg.device == "cuda" else tvm.cpu()
        vm = relax.VirtualMachine(executable, dev)
    else:
        vm, names = load_relax(cfg, load)
    missing = [n for n in names if n not in weights]
    if missing:
        raise KeyError(f"weights missing for Relax parameters {missing}")
    return Built(hf, weights, manager, vm, [weights[n] for n in names],
                 time.perf_counter() - t0)


def run(cfg: Config | None = None, log=print, load=None) -> tuple[bool, dict]:
    """Build (or ``load``), serve and compare; returns ``(all tokens equal, report dict)``."""
    cfg = cfg or Config()
    t0 = time.perf_counter()
    built = build(cfg, load)
    hf, manager, vm, weight_list = built.hf, built.manager, built.vm, built.weight_list
    if log:
        log(f"model: Llama {cfg.num_layers} layers, hidden {cfg.hidden}, {cfg.n_heads} query / "
            f"{cfg.n_kv_heads} kv heads of {cfg.head_dim}, vocab {cfg.vocab}, float32, "
            f"random weights (seed {cfg.seed})")
        typed = ("" if load else  # (input_symbols() needs tvm.relax: not in a runtime)
                 f"; Relax KV inputs from input_symbols(): {manager.input_symbols()[0]}")
        log(f"cache: PagedKVCacheManager on {cfg.device}, {manager.num_pages} pages of "
            f"{cfg.page_size} tokens, prefix caching on{typed}")
        how = (f"loaded {load} (runtime only)" if load else
               f"compiled for {'cuda ' + cfg.arch if cfg.device == 'cuda' else 'llvm'}")
        log(f"Relax functions prefill + decode on {cfg.device}: {how} in "
            f"{built.compile_s:.1f} s")
    t2 = time.perf_counter()
    requests = make_prompts(cfg)
    got, stats = serve(cfg, vm, weight_list, manager, requests, log=log)
    t3 = time.perf_counter()
    if log:
        log(f"served {len(requests)} requests in {stats['steps']} steps "
            f"({stats['prefill_calls']} prefill, {stats['decode_calls']} decode calls) in "
            f"{t3 - t2:.2f} s; prefix cache: {stats['prefix_hit_tokens']} of "
            f"{stats['prompt_tokens']} prompt tokens reused")
    ok = True
    mismatches = []
    for r, (arrive, prompt) in enumerate(requests):
        want = hf_generate(hf, prompt, cfg.new_tokens)
        if got[r] != want:
            ok = False
            at = next(i for i in range(len(want)) if got[r][i] != want[i])
            mismatches.append((r, at, got[r], want))
            if log:
                log(f"MISMATCH request {r} (prompt of {len(prompt)} tokens) at generated token "
                    f"{at}: relax {got[r]} vs transformers {want}")
        elif log:
            log(f"  request {r}: prompt {len(prompt):3d} tokens, arrives at step {arrive}: "
                f"{got[r]} == transformers")
    if log:
        log(f"{'OK' if ok else 'FAILED'}: {len(requests) - len(mismatches)}/{len(requests)} "
            f"requests match transformers' greedy generate (total {time.perf_counter() - t0:.1f} s)")
    manager_ok = manager.slots_remaining == set(range(manager.max_batch_size))
    return ok, {"tokens": got, "stats": stats, "mismatches": mismatches,
                "compile_s": built.compile_s, "serve_s": t3 - t2, "manager_ok": manager_ok}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where the model runs (default: cpu; cuda with --export builds "
                        "for CUDA)")
    parser.add_argument("--export", metavar="FILE", help="compile ahead of time into FILE "
                        "(for --device, default cuda) and stop")
    parser.add_argument("--arch", default="sm_90a", help="CUDA arch of --export")
    parser.add_argument("--load", metavar="FILE", help="run a model exported with --export, "
                        "with the TVM runtime alone")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if args.export else "cpu")
    cfg = Config(num_layers=args.layers, new_tokens=args.new_tokens, seed=args.seed,
                 device=device, arch=args.arch)
    if args.export:
        path = export_relax(cfg, args.export)
        print(f"exported the Relax model for {device} {args.arch if device == 'cuda' else ''}"
              f" to {path} (+ {path}.json); run it with --load {path} --device {device}")
        return 0
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    ok, _ = run(cfg, load=args.load)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
