"""Fingerprints of a batch's tokens (kvtvm.manager.fingerprint): what step compares with fetch."""

import numpy as np

from kvtvm.manager.fingerprint import fingerprints


def _flat(items):
    counts = np.array([len(t) for t in items], dtype=np.int64)
    return np.concatenate([np.asarray(t, dtype=np.int64) for t in items]), counts


def test_decode_fast_path_agrees_with_the_general_path():
    rng = np.random.default_rng(1)
    toks = rng.integers(0, 32000, 64)
    fast = fingerprints(toks, np.ones(64, np.int64), np.ones(64, np.int64))
    # the same one-token items inside a batch that takes the general path
    items = [[int(t)] for t in toks] + [[5, 6, 7]]
    flat, counts = _flat(items)
    general = fingerprints(flat, counts, counts)
    np.testing.assert_array_equal(general[:64], fast)
    # and a prefix of one token of a longer item is the same fingerprint
    flat, counts = _flat([[int(toks[0]), 9, 9]])
    assert fingerprints(flat, counts, np.array([1]))[0] == fast[0]


def test_any_change_of_a_token_or_its_order_changes_the_fingerprint():
    rng = np.random.default_rng(2)
    for _ in range(200):
        n = int(rng.integers(2, 40))
        toks = rng.integers(0, 32000, n)
        flat, counts = _flat([toks])
        ref = fingerprints(flat, counts, counts)[0]
        changed = toks.copy()
        i = int(rng.integers(0, n))
        changed[i] += int(rng.integers(1, 1000))
        assert fingerprints(*_flat([changed]), counts)[0] != ref
        swapped = toks.copy()
        j = (i + 1) % n
        if swapped[i] != swapped[j]:
            swapped[[i, j]] = swapped[[j, i]]
            assert fingerprints(*_flat([swapped]), counts)[0] != ref


def test_use_counts_only_the_leading_tokens():
    flat, counts = _flat([[1, 2, 3, 4], [7, 8]])
    a = fingerprints(flat, counts, np.array([2, 1]))
    b = fingerprints(*_flat([[1, 2, 99, 98], [7, 55]]), np.array([2, 1]))
    np.testing.assert_array_equal(a, b)
    assert fingerprints(flat, counts, counts)[0] != a[0]
