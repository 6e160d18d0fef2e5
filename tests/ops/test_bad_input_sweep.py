"""Every public op driven with each kind of bad argument: each raises a kvtvm error (a
``ValueError`` or ``TypeError``) naming the argument, and the cache bytes are unchanged."""

import math

import numpy as np
import pytest
import torch

from kvtvm import ops
from kvtvm.errors import KVCacheError

P, PS, H, G, D = 6, 4, 2, 2, 16


def _valid(op):
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randn(P, 2, PS, H, D, generator=gen)
    a = dict(k_cache=blocks[:, 0], v_cache=blocks[:, 1], _blocks=blocks,
             cache_lengths=torch.tensor([2, 0], dtype=torch.int32),
             lookup_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))
    if op == "append":
        a.update(k=torch.randn(3, H, D, generator=gen), v=torch.randn(3, H, D, generator=gen),
                 qo_indptr=torch.tensor([0, 1, 3], dtype=torch.int32))
    elif op == "decode":
        a.update(q=torch.randn(2, H * G, D, generator=gen))
    elif op == "prefill":
        a.update(q=torch.randn(3, H * G, D, generator=gen),
                 qo_indptr=torch.tensor([0, 1, 3], dtype=torch.int32))
    return blocks, a


def _call(op, a):
    if op == "append":
        ops.append_kv(a["k_cache"], a["v_cache"], a["k"], a["v"], a["qo_indptr"],
                      a["cache_lengths"], a["lookup_table"], **a.get("kw", {}))
    elif op == "decode":
        ops.decode_attention(a["q"], a["k_cache"], a["v_cache"], a["cache_lengths"],
                             a["lookup_table"], **a.get("kw", {}))
    else:
        ops.prefill_attention(a["q"], a["k_cache"], a["v_cache"], a["qo_indptr"],
                              a["cache_lengths"], a["lookup_table"], **a.get("kw", {}))


def _mutations(op, a):
    """(what, argument named in the message, mutate(a))."""
    first = "k" if op == "append" else "q"
    out = [
        ("dtype", first, lambda a: a.__setitem__(first, a[first].double())),
        ("rank", first, lambda a: a.__setitem__(first, a[first][None])),
        ("shape", first, lambda a: a.__setitem__(first, a[first][:, :, :D // 2])),
        ("stride", first, lambda a: a.__setitem__(
            first, torch.randn(a[first].shape[2], a[first].shape[1], a[first].shape[0])
            .permute(2, 1, 0))),
        ("type", first, lambda a: a.__setitem__(first, a[first].tolist())),
        ("byte order", first, lambda a: a.__setitem__(first, a[first].numpy().astype(">f4"))),
        ("device", first, lambda a: a.__setitem__(first, a[first].to("meta"))),
        ("all on meta", first, _all_on_meta),  # no kernel there (append: was "k_cache and
        # v_cache share memory", two meta tensors having the same null data pointer)
        ("index dtype", "cache_lengths",
         lambda a: a.__setitem__("cache_lengths", a["cache_lengths"].long())),
        ("negative length", "cache_lengths",
         lambda a: a.__setitem__("cache_lengths", torch.tensor([-1, 0], dtype=torch.int32))),
        ("huge length", "cache_lengths", lambda a: a.__setitem__(
            "cache_lengths", torch.tensor([2 ** 31 - 1, 0], dtype=torch.int32))),
        ("huge page", "lookup_table", lambda a: a.__setitem__(
            "lookup_table", torch.tensor([[0, 1], [2 ** 30, 3]], dtype=torch.int32))),
        ("negative page", "lookup_table", lambda a: a.__setitem__(
            "lookup_table", torch.tensor([[-1, 1], [2, 3]], dtype=torch.int32))),
        ("cache dtype", "v_cache", lambda a: a.__setitem__("v_cache", a["v_cache"].double())),
        ("negative strides", "k_cache", lambda a: a.__setitem__(
            "k_cache", a["k_cache"].numpy()[::-1])),
        # an empty cache axis: a typed error naming it (was a ZeroDivisionError for head_dim,
        # or "k_cache and v_cache share memory" for two empty views)
        ("empty pages", "page_size", lambda a: _empty_axis(a, 1)),
        ("no kv heads", "n_kv_heads", lambda a: _empty_axis(a, 2)),
        ("empty head_dim", "head_dim", lambda a: _empty_axis(a, 3)),
    ]
    if op != "decode":
        out.append(("decreasing indptr", "qo_indptr", lambda a: a.__setitem__(
            "qo_indptr", torch.tensor([0, 3, 1], dtype=torch.int32))))
        # rows but no sequence, unchecked: was a segfault (the kernel looked the rows' sequence
        # up in empty tables)
        out.append(("rows without a batch", "cache_lengths", _rows_without_a_batch))
    if op != "append":
        out += [
            ("nan sm_scale", "sm_scale", lambda a: a.__setitem__("kw", {"sm_scale": math.nan})),
            ("inf sm_scale", "sm_scale", lambda a: a.__setitem__("kw", {"sm_scale": math.inf})),
            # finite in float64, inf in the kernels' float32: out and lse were NaN
            ("float32-inf sm_scale", "sm_scale",
             lambda a: a.__setitem__("kw", {"sm_scale": 1e39})),
            # finite in float32, but not times log2(e), the kernels' base-2 scale: prefill
            # gave NaN for scores of a few hundred (decode did not)
            ("sm_scale past FLT_MAX / log2 e", "sm_scale",
             lambda a: a.__setitem__("kw", {"sm_scale": -2.4e38})),
            ("huge int sm_scale", "sm_scale",
             lambda a: a.__setitem__("kw", {"sm_scale": 10 ** 400})),
            ("bool sliding_window", "sliding_window",
             lambda a: a.__setitem__("kw", {"sliding_window": True})),
            ("out aliases q", "out", lambda a: a.__setitem__("kw", {"out": a["q"]})),
            ("out requires grad", "out", lambda a: a.__setitem__(
                "kw", {"out": torch.empty_like(a["q"]).requires_grad_()})),
            ("lse over the page table", "lse and lookup_table", _lse_over_the_table),
            ("out aliases the cache", "out", lambda a: a.__setitem__(
                "kw", {"out": a["_blocks"][1].view(-1)[:a["q"].numel()].view(a["q"].shape)})),
        ]
    else:  # (attention only reads the caches: a read-only array will do there)
        out.append(("k aliases the cache", "k_cache", lambda a: a.__setitem__(
            "k", a["_blocks"][0].view(-1)[:a["k"].numel()].view(a["k"].shape))))
        out.append(("read-only cache", "k_cache",
                    lambda a: a.__setitem__("k_cache", _readonly(a))))
        out.append(("cache requires grad", "v_cache", lambda a: a.__setitem__(
            "v_cache", a["v_cache"].clone().requires_grad_())))
    out.append(("negated view", first, lambda a: a.__setitem__(
        first, torch._neg_view(a[first]))))
    out.append(("sparse tensor", first, lambda a: a.__setitem__(first, a[first].to_sparse())))
    return out


def _lse_over_the_table(a):
    """``lse`` sharing the page table's memory: the kernel would overwrite the table it reads
    (it did, then raised KernelIndexError over float bits)."""
    lse = torch.empty(a["q"].shape[:2], dtype=torch.float32)
    table = lse.view(-1).view(torch.int32)[:a["lookup_table"].numel()]
    a["lookup_table"] = table.view(a["lookup_table"].shape).copy_(a["lookup_table"])
    a["kw"] = {"lse": lse}


def _rows_without_a_batch(a):
    a.update(qo_indptr=torch.zeros(1, dtype=torch.int32),
             cache_lengths=torch.zeros(0, dtype=torch.int32),
             lookup_table=torch.zeros(0, 2, dtype=torch.int32), kw={"check_indices": False})


def _all_on_meta(a):
    for name, t in list(a.items()):
        if isinstance(t, torch.Tensor) and name != "_blocks":
            a[name] = t.to("meta")


def _empty_axis(a, axis):
    """Fresh K and V caches (nhd) with axis ``axis`` of extent 0 (head_dim: q, k and v too)."""
    shape = list(a["k_cache"].shape)
    shape[axis] = 0
    a["k_cache"], a["v_cache"] = torch.zeros(shape), torch.zeros(shape)
    if axis == 3:
        for name in ("q", "k", "v"):
            if name in a:
                a[name] = a[name][..., :0].contiguous()


def _readonly(a):
    arr = a["k_cache"].numpy().copy()
    arr.flags.writeable = False
    return arr


CASES = [(op, what, name, mutate) for op in ("append", "decode", "prefill")
         for what, name, mutate in _mutations(op, _valid(op)[1])]


@pytest.mark.parametrize("op,what,name,mutate", CASES,
                         ids=[f"{c[0]}-{c[1].replace(' ', '_')}" for c in CASES])
def test_bad_argument_raises_a_named_kvtvm_error_and_changes_nothing(op, what, name, mutate):
    blocks, a = _valid(op)
    _call(op, dict(a))  # valid as given
    before = blocks.clone()
    mutate(a)
    with pytest.raises(KVCacheError) as info:
        _call(op, a)
    assert isinstance(info.value, (ValueError, TypeError))
    assert name in str(info.value), str(info.value)
    assert torch.equal(blocks, before)


@pytest.mark.parametrize("what", ["dtype", "rank", "huge", "negative", "type", "meta"])
def test_copy_pages_bad_arguments(what):
    blocks = torch.randn(P, 2, PS, H, D)
    before = blocks.clone()
    src, dst = torch.tensor([1], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    name = "dst"
    if what == "meta":
        with pytest.raises(KVCacheError, match="blocks"):
            ops.copy_pages(blocks.to("meta"), src, dst)
        return
    if what == "dtype":
        dst = dst.long()
    elif what == "rank":
        dst = dst[None]
    elif what == "huge":
        dst = torch.tensor([2 ** 30], dtype=torch.int32)
    elif what == "negative":
        dst = torch.tensor([-1], dtype=torch.int32)
    else:
        dst = [2]
    with pytest.raises(KVCacheError) as info:
        ops.copy_pages(blocks, src, dst)
    assert name in str(info.value) and isinstance(info.value, (ValueError, TypeError))
    assert torch.equal(blocks, before)


@pytest.mark.parametrize("shape", [(P, 3, 0), (P, 0, 8), (P, 0)], ids=["no-head_dim",
                                                                    "no-rows", "no-row"])
def test_copy_pages_of_empty_pages_moves_nothing(shape):
    """Pages of zero bytes: the copy has nothing to move (was a ZeroDivisionError or a TVM
    stride error); indices are still checked."""
    blocks = torch.zeros(shape)
    ops.copy_pages(blocks, torch.tensor([1], dtype=torch.int32),
                   torch.tensor([2], dtype=torch.int32))
    with pytest.raises(KVCacheError, match="dst"):
        ops.copy_pages(blocks, torch.tensor([1], dtype=torch.int32),
                       torch.tensor([P], dtype=torch.int32))


def test_vector_alignment_of_contiguous_rows_is_the_pointer():
    """``strides=False`` (q and out on CUDA: vectors within contiguous rows) checks the data
    pointer alone: rows of 24 bytes pass, a pointer one element off does not."""
    import torch

    from kvtvm.errors import InvalidArgumentError
    from kvtvm.ops.checks import check_vector_aligned

    rows = torch.zeros(4, 2, 12, dtype=torch.float16)  # 24-byte rows
    check_vector_aligned({"out": rows}, strides=False)
    with pytest.raises(InvalidArgumentError, match="out"):
        check_vector_aligned({"out": rows})  # the strided rule wants 16-byte strides
    off = torch.zeros(4 * 2 * 12 + 1, dtype=torch.float16)[1:].view(4, 2, 12)
    with pytest.raises(InvalidArgumentError, match=r"out: .*pointer % 16 = 2"):
        check_vector_aligned({"out": off}, strides=False)
