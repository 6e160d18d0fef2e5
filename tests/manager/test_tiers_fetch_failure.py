"""A fetch that fails after its tier promotions (its copy-on-write page copy raises): every
sequence's table, length and refcount is restored and nothing is wrong in the cache -- the
promoted page stays cached with the K/V of its own tokens (docs/managers.md, Tiers:
"Failures"), and the next fetches serve the right bytes."""

import torch

from kvtvm import KVCacheParams
from kvtvm.manager import BatchItem, PagedKVCacheManager


class Boom(RuntimeError):
    pass


def test_fetch_failing_after_a_promotion_restores_sequences_and_serves_right_bytes():
    fail = [False]

    def copier(blocks, src, dst):
        if fail[0]:
            raise Boom("copy-on-write copy failed")
        for s, d in zip(src.tolist(), dst.tolist()):
            blocks[d].copy_(blocks[s])

    P = 2
    params = KVCacheParams("float32", 1, 2, "paged", page_size=P, enable_prefix_caching=True)
    m = PagedKVCacheManager(params, 4, 12, 1, num_pages=6, page_copier=copier)
    m.attach_tiers(host_pages=4)
    blocks = m.blocks[0]

    def run(sid, toks):
        m.fetch([BatchItem(sid, toks)])
        for i, p in enumerate(m.pages_of(sid)):  # fresh K/V where this prompt computes
            if i * P >= m.cache_length(sid):
                blocks[p].copy_(torch.randn(blocks[p].shape))
        m.step([BatchItem(sid, toks)])

    (a,) = m.claim(1)
    run(a, [1, 2, 3])
    want = blocks[m.pages_of(a)[0]].clone()  # the K/V of page [1, 2]
    m.release(a)
    (b,) = m.claim(1)
    run(b, [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11])  # the whole pool: [1, 2] goes to the host tier
    m.release(b)
    (c,) = m.claim(1)
    run(c, [5])
    d = m.fork(c)  # c's next write copies the shared partial page
    (e,) = m.claim(1)
    seqs = {s: (m.pages_of(s), m.cache_length(s)) for s in (c, d, e)}
    c_page = blocks[m.pages_of(c)[0]].clone()
    refcount = m._refcount.copy()
    fail[0] = True
    try:
        m.fetch([BatchItem(c, [6]), BatchItem(e, [1, 2, 3])])  # e's prefix: promoted first
        raise AssertionError("the fetch did not raise")
    except Boom:
        pass
    fail[0] = False
    assert {s: (m.pages_of(s), m.cache_length(s)) for s in (c, d, e)} == seqs
    assert (m._refcount == refcount).all()
    assert torch.equal(blocks[m.pages_of(c)[0]], c_page)
    m.check_invariants()
    st = m.stats()
    assert st.pages_free + st.pages_used + st.pages_cached + st.pages_leased == st.pages_total
    # the same fetch again: e hits [1, 2] with its own K/V; c writes into its own copy
    (inp,) = m.fetch([BatchItem(c, [6]), BatchItem(e, [1, 2, 3])])
    assert list(inp.num_cached_tokens) == [0, 2]
    assert m.pages_of(c)[0] != m.pages_of(d)[0]
    assert torch.equal(blocks[m.pages_of(e)[0]], want)
    assert torch.equal(blocks[m.pages_of(c)[0]], c_page)  # copied before c writes
    m.check_invariants()
