"""A cache length past the pages a fetch gave a sequence, with the PAGED manager's own lookup
table: the row is padded with 0 past its pages -- page 0, another sequence's -- so a kernel
would write (append) or read (decode, prefill) another sequence's tokens. The ops refuse it
with an error naming ``cache_lengths`` and nothing is written; a length that fills the pages
exactly, or the room a multistep fetch reserved, is taken."""

import pytest
import torch

from kvtvm import KVCacheParams, ops
from kvtvm.errors import InvalidArgumentError
from kvtvm.manager import BatchItem, PagedKVCacheManager

H, G, D, PS = 2, 2, 32, 4


def _manager(cache_dtype):
    params = KVCacheParams("float32", H, D, "paged", page_size=PS, cache_dtype=cache_dtype)
    mgr = PagedKVCacheManager(params, 4, 64, 1)
    gen = torch.Generator().manual_seed(7)
    a, b = mgr.claim(2)
    batch = [BatchItem(a, list(range(2 * PS + 1))), BatchItem(b, [1, 2])]  # 3 pages, 1 page
    (inp,) = mgr.fetch(batch)
    n = 2 * PS + 3
    ops.append_kv(inp.k_cache(0), inp.v_cache(0), torch.randn(n, H, D, generator=gen),
                  torch.randn(n, H, D, generator=gen), inp.qo_indptr, inp.cache_lengths,
                  inp.lookup_table)
    mgr.step(batch)
    assert mgr.pages_of(a)[0] == 0  # sequence a holds page 0: b's padding points at it
    return mgr, a, b, gen


def _call(op, inp, gen, lengths):
    kc, vc = inp.k_cache(0), inp.v_cache(0)
    n = int(inp.qo_indptr[-1])
    if op == "append":
        ops.append_kv(kc, vc, torch.randn(n, H, D, generator=gen),
                      torch.randn(n, H, D, generator=gen), inp.qo_indptr, lengths,
                      inp.lookup_table)
    elif op == "decode":
        ops.decode_attention(torch.randn(n, H * G, D, generator=gen), kc, vc, lengths,
                             inp.lookup_table)
    else:
        ops.prefill_attention(torch.randn(n, H * G, D, generator=gen), kc, vc, inp.qo_indptr,
                              lengths, inp.lookup_table)


@pytest.mark.parametrize("cache_dtype", [None, "int8"])
@pytest.mark.parametrize("op", ["append", "decode", "prefill"])
@pytest.mark.parametrize("extra", [2, PS, 3 * PS])
def test_a_length_past_the_rows_pages_is_refused_and_writes_nothing(op, cache_dtype, extra):
    mgr, a, b, gen = _manager(cache_dtype)
    (inp,) = mgr.fetch([BatchItem(a, [9]), BatchItem(b, [9])])
    assert inp.lookup_table[1, 1:].tolist() == [0] * (inp.lookup_table.shape[1] - 1)
    before = mgr.blocks[0].clone()
    lengths = inp.cache_lengths.clone()
    lengths[1] += extra  # b holds 2 tokens (+1 this step) in 1 page of PS
    with pytest.raises(InvalidArgumentError, match=r"cache_lengths\[1\] \+ new tokens.*"
                       r"the fetch gave row 1 1 page of lookup_table"):
        _call(op, inp, gen, lengths)
    assert torch.equal(mgr.blocks[0], before)
    mgr.check_invariants()


@pytest.mark.parametrize("op", ["append", "decode", "prefill"])
def test_lengths_within_the_pages_given_are_taken(op):
    """The page the last token lands on is the row's last: a length that fills it exactly
    passes, as does the room a multistep fetch reserved ahead."""
    mgr, a, b, gen = _manager("int8")
    (inp,) = mgr.fetch([BatchItem(a, [9]), BatchItem(b, [9])], num_steps=PS + 2)
    assert mgr.pages_of(b) and len(mgr.pages_of(b)) == 2  # 3 + (PS + 1) tokens: 2 pages
    lengths = inp.cache_lengths.clone()
    lengths[1] = 2 * PS - 1  # its last token fills the second page
    _call(op, inp, gen, lengths)
    lengths[1] = 2 * PS
    with pytest.raises(InvalidArgumentError, match=r"cache_lengths\[1\]"):
        _call(op, inp, gen, lengths)


def test_a_table_without_a_manager_is_bounded_by_its_width_only():
    """Tables built by hand carry no fetch: the row's width and the page range bound them,
    as before (a hand-made table says which entries are pages)."""
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(6, 2, PS, H, D, generator=gen)
    kc, vc = cache[:, 0], cache[:, 1]
    table = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    lengths = torch.tensor([0, PS + 1], dtype=torch.int32)
    indptr = torch.tensor([0, 1, 2], dtype=torch.int32)
    k, v = torch.randn(2, H, D, generator=gen), torch.randn(2, H, D, generator=gen)
    ops.append_kv(kc, vc, k, v, indptr, lengths, table)
    assert torch.equal(kc[0, 1], k[1]) and torch.equal(vc[0, 1], v[1])  # row 1's 2nd page: 0
    assert torch.equal(kc[1, 0], k[0])
