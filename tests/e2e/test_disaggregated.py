"""End to end: examples/disaggregated.py runs prefill and decode in two processes (gloo over
loopback); every request's tokens equal transformers' generate(), and the second request,
sharing a system prompt with the first, sends only the pages past it. A peer that never
answers is a TransferTimeoutError and leaves no lease open."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import disaggregated  # noqa: E402

pytestmark = pytest.mark.e2e


def test_prefill_decode_in_two_processes_match_transformers():
    results = disaggregated.run(["--model", "toy", "--layers", "2", "--requests", "3",
                                 "--max-new-tokens", "4", "--timeout", "120"])
    assert [r[0] for r in results] == [0, 1, 2]
    for rid, sent, n_pages, ok in results:
        assert ok, f"request {rid}: tokens differ from transformers"
    (_, sent0, n0, _), (_, sent1, n1, _), (_, sent2, n2, _) = results
    assert sent0 == n0 and sent2 == n2
    assert sent1 == n1 - 2  # the 2 full pages of the shared system prompt stayed home


DEAD_PEER = r'''
import sys, torch, torch.distributed as dist, torch.multiprocessing as mp
from kvtvm import KVCacheParams
from kvtvm.errors import TransferTimeoutError
from kvtvm.manager import BatchItem, PagedKVCacheManager
from kvtvm.transfer import DistributedTransport, send_sequence

def worker(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    if rank == 1:  # alive, but never answers
        import time; time.sleep(6)
        return
    mgr = PagedKVCacheManager(KVCacheParams("float32", 2, 4, "paged", page_size=4,
                                            enable_prefix_caching=True), 2, 32, 2, num_pages=8)
    (s,) = mgr.claim(1)
    mgr.fetch([BatchItem(s, list(range(9)))]); mgr.step([BatchItem(s, list(range(9)))])
    tr = DistributedTransport(timeout=1.5)
    tr.register(mgr)
    try:
        send_sequence(tr, 1, s, timeout=1.5)
    except TransferTimeoutError as err:
        print("timeout:", str(err)[:60], flush=True)
    assert not mgr.active_leases()
    mgr.release(s)
    st = mgr.stats()
    assert st.pages_free + st.pages_cached == st.pages_total, st
    print("no lease left", flush=True)
    import os; os._exit(0)

if __name__ == "__main__":
    import socket
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0)); port = so.getsockname()[1]
    mp.start_processes(worker, args=(port,), nprocs=2, start_method="spawn", join=False)
    import time; time.sleep(12)
'''


def test_dead_peer_is_a_timeout_and_leaks_nothing(tmp_path):
    script = tmp_path / "dead_peer.py"
    script.write_text(DEAD_PEER)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout
    assert "timeout: transport: peer silent" in out and "no lease left" in out


@pytest.mark.parametrize("argv, names", [
    (["--requests", "0"], "--requests"), (["--layers", "0"], "--layers"),
    (["--max-new-tokens", "0"], "--max-new-tokens"), (["--num-pages", "-1"], "--num-pages"),
    (["--timeout", "0"], "--timeout"), (["--timeout", "nan"], "--timeout"),
    (["--num-pages", "2"], "--num-pages 2"), (["--max-new-tokens", "250"], "--max-new-tokens")])
def test_bad_options_are_one_line_before_any_process_starts(argv, names, capsys):
    """These were a traceback from a worker process (a capacity error, transformers'
    max_new_tokens check, num_layers 0) or, for --requests 0, 'tokens DIFFER' and exit 1."""
    with pytest.raises(SystemExit) as ex:
        disaggregated.run(["--model", "toy", "--layers", "1", *argv])
    assert ex.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert names in last, last
