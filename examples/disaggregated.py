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

    python examples/disaggregated.py                  # 4 requests, 4-layer toy Llama, CPU
    python examples/disaggregated.py --layers 2 --requests 3 --max-new-tokens 4

The model-running part is :class:`ModelStep` (a thin wrapper over ``examples/serve.py``'s toy
Llama and its kvtvm forward pass): swap it to run another model.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve  # noqa: E402  (examples/serve.py: the toy Llama and its kvtvm forward pass)

from kvtvm import KVCacheParams  # noqa: E402
from kvtvm.manager import BatchItem, PagedKVCacheManager  # noqa: E402

PAGE_SIZE = 16


# ------------------------------------------------------------------------------------------
# The model: everything model-specific is here
# ------------------------------------------------------------------------------------------


class ModelStep:
    """One forward step of the model over a paged cache: ``run(mgr, seq_ids, tokens)`` fetches
    room, runs the model on the new tokens (skipping prefix hits), commits, and returns each
    sequence's greedy next token."""

    def __init__(self, seed: int, num_layers: int):
        self.hf = serve.build_model(seed=seed, num_layers=num_layers)
        self.model = serve.KVTVMLlama(self.hf)
        cfg = self.hf.config
        self.params = KVCacheParams("float32", cfg.num_key_value_heads, self.model.head_dim,
                                    "paged", page_size=PAGE_SIZE, enable_prefix_caching=True)
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = cfg.vocab_size

    def run(self, mgr, seq_ids, tokens) -> list[int]:
        batch = [BatchItem(s, t) for s, t in zip(seq_ids, tokens)]
        (kv,) = mgr.fetch(batch)
        hits = kv.num_cached_tokens
        ids, counts = [], []
        for t, h in zip(tokens, hits):
            ids.extend(t[h:])
            counts.append(len(t) - h)
        start = kv.cache_lengths_host.astype(np.int64)
        positions = np.repeat(start, counts) + (np.arange(sum(counts))
                                                - np.repeat(kv.qo_indptr_host[:-1], counts))
        logits = self.model.forward(torch.tensor(ids, dtype=torch.int64),
                                    torch.from_numpy(positions), kv,
                                    all(c == 1 for c in counts))
        mgr.step(batch)
        return logits.argmax(dim=-1).tolist()

    def reference(self, prompt, max_new_tokens) -> list[int]:
        return serve.reference_tokens(self.hf, prompt, max_new_tokens)


def make_cache(step: ModelStep, num_pages: int) -> PagedKVCacheManager:
    return PagedKVCacheManager(step.params, 4, 256, step.num_layers, num_pages=num_pages)


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

    step = ModelStep(args.seed, args.layers)
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
    step = ModelStep(args.seed, args.layers)
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

    vocab = 1000  # serve.build_model's default
    prompts = demo_prompts(args.requests, vocab)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_worker, args=(args, prompts, free_port(), results), nprocs=2,
                       start_method="spawn", join=True)
    out = []
    while not results.empty():
        out.append(results.get())
    return sorted(out)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--num-pages", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds a process waits for its peer before giving up")
    return p.parse_args(argv)


def main(argv=None) -> int:
    results = run(argv)
    ok = results and all(r[3] for r in results)
    print(f"{len(results)} requests: tokens {'equal' if ok else 'DIFFER from'} transformers' "
          "generate()")
    return 0 if ok and len(results) == parse(argv).requests else 1


if __name__ == "__main__":
    sys.exit(main())
