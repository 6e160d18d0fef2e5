"""Where a receiving transport puts each of the sender's runs (``receive_targets``), against a
reference placement: row ``r`` of the sender's rows is page ``r - first_row`` of this cache's
fresh pages, rows before ``first_row`` (pages this cache already holds) are dropped. Was: a run
lying wholly before ``first_row`` (a receiver that gained the leading pages, data in runs of
one page -- scattered pages, or pages over the chunk size) took a fixup that copied from an
empty buffer slice: IndexError, an honest import refused (found by a helper)."""

import random
import pytest
import torch

from kvtvm.transferwire import receive_targets


def _place(lengths, first_row, fresh_runs):
    """Run ``receive_targets`` on fresh page runs ``fresh_runs`` (their sizes),
    "receive" the sender's rows (row r holds value r), apply the fixups; returns the fresh
    pages' values in order."""
    n_fresh = sum(fresh_runs)
    pool = torch.full((n_fresh + 3, 2), -1.0)
    dest, at, row = [], 1, 0  # runs of consecutive pages, a gap between runs
    for size in fresh_runs:
        dest.append((row, pool[at:at + size]))
        at, row = at + size, row + size
    out, fixups = receive_targets(dest, lengths, first_row, (2,), torch.float32, pool.device,
                                  lambda shape, dtype: torch.empty(shape, dtype=dtype))
    r = 0
    for target, n in zip(out, lengths):
        assert target.shape[0] == n
        target.copy_(torch.arange(r, r + n, dtype=torch.float32)[:, None].expand(n, 2))
        r += n
    for buf, rows in fixups:
        assert buf.shape[0] == len(rows)
        for i, page in enumerate(rows):
            page.copy_(buf[i])
    return torch.cat([v for _, v in dest])[:, 0].tolist()


@pytest.mark.parametrize("seed", range(40))
def test_every_fresh_page_gets_its_row(seed):
    rng = random.Random(seed)
    n_fresh = rng.randint(1, 9)
    first_row = rng.randint(0, 4)
    total, lengths = n_fresh + first_row, []
    while sum(lengths) < total:
        lengths.append(rng.randint(1, min(3, total - sum(lengths))))
    cuts, fresh_runs = sorted(rng.sample(range(1, n_fresh), rng.randint(0, n_fresh - 1))), []
    for a, b in zip([0, *cuts], [*cuts, n_fresh]):
        fresh_runs.append(b - a)
    got = _place(lengths, first_row, fresh_runs)
    assert got == [float(first_row + i) for i in range(n_fresh)], (lengths, first_row,
                                                                   fresh_runs)


def test_runs_of_one_page_before_first_row():
    # the helper's case: 2 held pages, 4 fresh, the sender's runs one page each
    assert _place([1] * 6, 2, [4]) == [2.0, 3.0, 4.0, 5.0]
