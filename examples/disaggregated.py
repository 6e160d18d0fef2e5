"""Prefill/decode disaggregation: one process runs the prompts, another generates.

Two processes started with ``torch.multiprocessing`` talk over ``torch.distributed`` (gloo on
127.0.0.1). The *prefill* process (rank 0) runs each prompt through the model into its paged
KV cache, asks the decode process which leading pages it already holds (chained block
hashes), and sends only the others with :func:`kvtvm.transfer.send_sequence`, followed by the
first generated token. The *decode* process (rank 1) imports the pages into a fresh sequence
(every header field and page checksum verified; the full pages also land in its prefix cache)
and generates the rest. At the end the decode process checks every request's tokens against
``transformers``' own ``generate`` and reports how many pages each request moved: a second
prompt sharing a system prompt sends only the pages past it.

    python examples/disaggregated.py                  # SmolLM2-135M, 4 requests, CPU
    python examples/disaggregated.py --model toy --layers 2 --requests 3 --max-new-tokens 4

The model-running part is :class:`ModelStep` (kvtvm's :class:`kvtvm.engine.ModelRunner` over a
transformers model: SmolLM2, a local model directory, or the random toy Llama the tests use).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import numpy as np
import torch

from kvtvm import KVCacheParams, cliargs
from kvtvm.engine import ModelRunner, build_toy_model, load_model, reference_tokens
from kvtvm.manager import BatchItem, PagedKVCacheManager

PAGE_SIZE = 16
MAX_SEQ_LEN = 256   # tokens per sequence in both processes' caches


# ------------------------------------------------------------------------------------------
# The model: everything model-specific is here
# ------------------------------------------------------------------------------------------


class ModelStep:
    """One forward step of the model over a paged cache: ``run(mgr, seq_ids, tokens)`` fetches
    room, runs the model on the new tokens (skipping prefix hits), commits, and returns each
    sequence's greedy next token.

    ``model``: ``"smollm2"``, ``"toy"`` (random weights, ``seed`` and ``layers``) or a local
    transformers model directory; float32 on the CPU.
    """

    def __init__(self, model: str, seed: int, num_layers: int):
        if model == "toy":
            self.hf, self.tokenizer = build_toy_model(seed=seed, num_layers=num_layers), None
        else:
            self.hf, self.tokenizer = load_model(model, "float32")
        self.runner = ModelRunner(self.hf)
        self.params = KVCacheParams.from_hf_config(self.hf.config, "float32", "paged",
                                                   PAGE_SIZE, enable_prefix_caching=True)
        self.num_layers = self.runner.num_layers
        self.vocab_size = self.hf.config.vocab_size

    def run(self, mgr, seq_ids, tokens) -> list[int]:
        batch = [BatchItem(s, t) for s, t in zip(seq_ids, tokens)]
        kv = mgr.fetch(batch)[0]
        new = [t[h:] for t, h in zip(tokens, kv.num_cached_tokens)]
        logits = self.runner.run_step(kv, new)
        mgr.step(batch)
        return logits.argmax(dim=-1).tolist()

    def reference(self, prompt, max_new_tokens) -> list[int]:
        return reference_tokens(self.hf, prompt, max_new_tokens)

    def prompts(self, n: int, seed: int = 7) -> list[list[int]]:
        """``n`` prompts; the first two share a system prompt of 2.5 pages or more."""
        if self.tokenizer is None:
            return demo_prompts(n, self.vocab_size, seed)
        tok = self.tokenizer
        system = ("You are a concise assistant for a railway company. Answer in one short "
                  "sentence, name the station when you can, and never invent timetables. ")
        questions = ["When does the first train to Lyon leave?",
                     "Is there a lift at the north entrance?",
                     "What is the capital of France?", "Name the three primary colors.",
                     "What does a bee make?", "Give me one tip for learning Python."]
        head = tok.encode(system)
        while len(head) < 2 * PAGE_SIZE + 8:
            head = head + tok.encode(system)
        out = [head + tok.encode(q) for q in questions[:2]]
        out += [tok.encode(q) for q in questions[2:]]
        return (out * (1 + n // len(out)))[:n]


def make_cache(step: ModelStep, num_pages: int) -> PagedKVCacheManager:
    return PagedKVCacheManager(step.params, 4, MAX_SEQ_LEN, step.num_layers,
                               num_pages=num_pages)


def demo_prompts(n: int, vocab_size: int, seed: int = 7) -> list[list[int]]:
    """``n`` prompts; the first two share a 2.5-page system prompt, the rest are unrelated."""
    rng = np.random.default_rng(seed)
    system = rng.integers(3, vocab_size, 2 * PAGE_SIZE + 8).tolist()
    prompts = [system + rng.integers(3, vocab_size, 9).tolist(),
               system + rng.integers(3, vocab_size, 21).tolist()]
    while len(prompts) < n:
        prompts.append(rng.integers(3, vocab_size, int(rng.integers(10, 40))).tolist())
    return prompts[:n]


# ------------------------------------------------------------------------------------------
# The two processes
# ------------------------------------------------------------------------------------------


def prefill_worker(args, prompts, transport) -> None:
    from kvtvm.transfer import send_sequence

    step = ModelStep(args.model, args.seed, args.layers)
    mgr = make_cache(step, args.num_pages)
    transport.register(mgr)
    for rid, prompt in enumerate(prompts):
        (s,) = mgr.claim(1)
        (first,) = step.run(mgr, [s], [prompt])
        sent = send_sequence(transport, 1, s, tag=rid, timeout=args.timeout)
        transport.send_ints(1, [rid, first, sent])
        mgr.release(s)  # done here; a lease would keep the pages until the peer had them
    transport.close(1)
    assert not mgr.active_leases(), "an export lease was left open"


def decode_worker(args, prompts, transport, results) -> None:
    step = ModelStep(args.model, args.seed, args.layers)
    mgr = make_cache(step, args.num_pages)
    transport.register(mgr)
    seqs = {}

    def seq_for(header, tag):
        (s,) = mgr.claim(1)
        seqs[tag] = s
        return s

    lines, problems = [], []
    while True:
        msg = transport.handle(0, seq_for, timeout=args.timeout)
        if msg.kind == "close":
            break
        if msg.kind != "pages":
            continue
        if msg.error is not None:  # refused or resend: the sender retries or fails
            if msg.tag in seqs:
                mgr.release(seqs.pop(msg.tag))
            continue
        rid, first, sent = transport.recv_ints(0, 3)
        s = seqs.pop(rid)
        out = [first]
        while len(out) < args.max_new_tokens:
            out += step.run(mgr, [s], [[out[-1]]])
        mgr.release(s)
        want = step.reference(prompts[rid], args.max_new_tokens)
        n_pages = -(-len(prompts[rid]) // PAGE_SIZE)
        lines.append(f"request {rid}: {len(prompts[rid])} prompt tokens, {sent} of {n_pages} "
                     f"pages sent, tokens {out}")
        if out != want:
            problems.append(f"request {rid}: kvtvm {out} != transformers {want}")
        results.put((rid, sent, n_pages, out == want))
    st = mgr.stats()
    assert st.pages_free + st.pages_used + st.pages_cached + st.pages_leased == st.pages_total
    for line in lines + problems:
        print(line, flush=True)


def _worker(rank, args, prompts, port, results):
    import torch.distributed as dist

    from kvtvm.transfer import DistributedTransport

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        transport = DistributedTransport(timeout=args.timeout)
        if rank == 0:
            prefill_worker(args, prompts, transport)
        else:
            decode_worker(args, prompts, transport, results)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(argv=None) -> list[tuple]:
    """Run both processes; returns ``[(request, pages sent, pages, tokens match)]``."""
    args = parse(argv)
    import torch.multiprocessing as mp

    prompts = ModelStep(args.model, args.seed, args.layers).prompts(args.requests)
    # both caches must hold the longest request (one at a time): refused here, by option,
    # rather than as a capacity error in a worker process
    # (the last generated token is never fed back)
    longest = max(len(p) for p in prompts) + args.max_new_tokens - 1
    if longest > MAX_SEQ_LEN:
        _parser().error(f"--max-new-tokens {args.max_new_tokens}: the longest prompt "
                        f"({longest + 1 - args.max_new_tokens} tokens) plus the new tokens "
                        f"passes the caches' max_seq_len of {MAX_SEQ_LEN}")
    need = -(-longest // PAGE_SIZE)
    if args.num_pages < need:
        _parser().error(f"--num-pages {args.num_pages}: the longest request ({longest} tokens) "
                        f"needs {need} pages of {PAGE_SIZE}")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_worker, args=(args, prompts, free_port(), results), nprocs=2,
                       start_method="spawn", join=True)
    out = []
    while not results.empty():
        out.append(results.get())
    return sorted(out)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (default), toy (random Llama) or a local model directory")
    p.add_argument("--requests", type=cliargs.positive_int, default=4)
    p.add_argument("--layers", type=cliargs.positive_int, default=4,
                   help="layers of the toy model")
    p.add_argument("--max-new-tokens", type=cliargs.positive_int, default=8)
    p.add_argument("--num-pages", type=cliargs.positive_int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=_seconds, default=120.0,
                   help="seconds a process waits for its peer before giving up")
    return p


def parse(argv=None):
    """The options; a bad value exits 2 with one line naming it (argparse)."""
    return _parser().parse_args(argv)


def main(argv=None) -> int:
    results = run(argv)
    ok = results and all(r[3] for r in results)
    print(f"{len(results)} requests: tokens {'equal' if ok else 'DIFFER from'} transformers' "
          "generate()")
    return 0 if ok and len(results) == parse(argv).requests else 1


if __name__ == "__main__":
    sys.exit(main())
