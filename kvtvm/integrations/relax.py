"""Relax graph integration: kvtvm's kernels inside a TVM Relax model.

A Relax model that keeps its KV cache in a kvtvm manager takes the manager's per-step inputs as
function parameters and calls kvtvm's PrimFuncs on them with ``call_tir`` (attention) and
``call_tir_inplace`` (append, which writes the cache views it is given)::

    from tvm import relax
    import kvtvm.relax as kr

    kv = kr.kv_input_vars_for(manager)                # Relax vars typed from input_symbols()
    bb = relax.BlockBuilder()
    with bb.function("step", [x, *kv.params()], pure=False):
        ...
        k_cache, v_cache = kr.emit_append_kv(bb, kv.k_caches[i], kv.v_caches[i], k, v,
                                             kv.qo_indptr, kv.cache_lengths, kv.lookup_table,
                                             layout=kv.layout, error_flag=kv.error_flag)
        out = kr.emit_attention(bb, q, k_cache, v_cache, kv.qo_indptr, kv.cache_lengths,
                                kv.lookup_table, layout=kv.layout, error_flag=kv.error_flag)
    ...
    vm["step"](x, *kr.kv_call_args(manager.fetch(batch)[0]))   # torch tensors, no copy
    kr.check_errors()   # KernelIndexError for out-of-range entries the kernels skipped

The per-layer K/V caches are zero-copy strided views of the manager's one cache tensor
(:meth:`kvtvm.inputs.RaggedKVCacheInputs.collection`); the Relax VM passes them through as
strided DLPack tensors and the kernels bind their strides symbolically, so nothing is copied.
Attention must consume the caches *returned* by :func:`emit_append_kv` so that the graph
orders the write before the read.

Each kernel is added to the module once per :class:`kvtvm.compiler.KernelSpec` (and scalar
specialization): a float/int scalar parameter of a kernel (``sm_scale``, ``causal``,
``window``) is bound at graph-build time with ``PrimFunc.specialize``, since Relax's
``call_tir`` passes tensors only before the outputs.

Relax's own moving names (0.27: ``TensorType``, ``out_ty``, ``call_tir_inplace``) are confined
to this module; TIR's come from :mod:`kvtvm.kernels._tvm`, imported when a function needs
them (``import kvtvm.relax`` alone works with the TVM runtime only).

A manager's :meth:`~kvtvm.manager.KVCacheManager.input_symbols` is typed here
(:func:`struct_info_of`, registered by :mod:`kvtvm`): the manager describes its inputs as plain
data (:meth:`~kvtvm.manager.KVCacheManager.input_specs`) and imports no TVM. The input types,
vars and call arguments are defined in :mod:`.relax_inputs` and re-exported here.

:mod:`tvm.relax.frontend.nn` users get the same calls through :func:`nn_append_kv`, :func:`nn_attention` and
:func:`nn_decode_attention`, which take and return ``nn.Tensor``.
"""

from __future__ import annotations

import math
import numbers

from ..compiler import KernelSpec, lower
from ..errors import InvalidArgumentError, describe
from .relax_inputs import refuse_quantized
from .relax_inputs import (KV_INPUT_NAMES, KVInputVars, check_errors, error_flag,
                           input_symbols_for, kv_call_args, kv_input_types, kv_input_vars,
                           kv_input_vars_for, struct_info_of)

__all__ = [
    # input types, vars and arguments (defined in .relax_inputs)
    "KVInputVars", "struct_info_of", "input_symbols_for", "kv_input_types", "kv_input_vars",
    "kv_input_vars_for", "kv_call_args", "KV_INPUT_NAMES", "error_flag", "check_errors",
    # kernels in a Relax module
    "add_kernel", "kernel_func", "llvm_target", "emit_append_kv", "emit_attention",
    "emit_decode_attention",
    # tvm.relax.frontend.nn
    "nn_kv_spec", "nn_append_kv", "nn_attention", "nn_decode_attention",
]

#: TIR ``op_pattern`` of an opaque kernel: Relax's FuseOps never fuses it.
_OPAQUE = 8


def _ERR_TY():  # noqa: N802
    """Type of a kernel's error flag (its last parameter, :mod:`kvtvm.kernels.errflag`). Given
    ``error_flag=`` (the graph parameter :attr:`KVInputVars.error_flag`), every kernel writes
    into that one tensor in place and :func:`check_errors` reports it after the call; without
    it the flag is a scratch output nobody reads (the kernels still skip every out-of-range
    index, so a graph never touches memory outside its tensors)."""
    from tvm import relax

    from ..kernels.errflag import ERR_SLOTS

    return relax.TensorType([ERR_SLOTS], "int32")


# ------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------

_LOWERED: dict = {}


def llvm_target():
    """The ``tvm.target.Target`` kvtvm's llvm kernels are scheduled for (host CPU, all
    cores): compile a Relax module holding them with this target."""
    return KernelSpec("append", "float32", 1, 1).tvm_target()


def _lowered(spec: KernelSpec):
    """The scheduled PrimFunc of ``spec`` (memoized per process)."""
    if spec not in _LOWERED:
        _LOWERED[spec] = lower(spec)[spec.func_name]
    return _LOWERED[spec]


def kernel_func(spec: KernelSpec, **scalars):
    """The scheduled PrimFunc of ``spec`` with the named scalar parameters bound.

    Parameters
    ----------
    spec : KernelSpec
    **scalars
        Values of scalar parameters by name (e.g. ``sm_scale=0.125, causal=1, window=0``);
        each must name a scalar parameter of the kernel.

    Returns
    -------
    tvm.tir.PrimFunc
        Marked scheduled and opaque (Relax neither reschedules nor fuses it).

    Raises
    ------
    InvalidArgumentError
        A name that is not a scalar parameter of the kernel.
    """
    from ..kernels._tvm import ATTR_IS_SCHEDULED, tir

    func = _lowered(spec)
    bind = {}
    by_name = {p.name: p for p in func.params}
    for name, value in scalars.items():
        if name not in by_name:
            raise InvalidArgumentError(describe(f"scalar of {spec.func_name}",
                                                sorted(by_name), repr(name)))
        param = by_name[name]
        dtype = str(param.ty.dtype)
        bind[param] = (tir.FloatImm(dtype, float(value)) if dtype.startswith("float")
                       else tir.IntImm(dtype, int(value)))
    if bind:
        func = func.specialize(bind)
    # scheduled by hand: the Relax GPU pipeline's default schedules (dlight) must leave it be
    return func.with_attr("op_pattern", _OPAQUE).with_attr(ATTR_IS_SCHEDULED, True)


def add_kernel(bb, spec: KernelSpec, **scalars):
    """Add ``spec``'s kernel (scalars bound) to the module being built by ``bb``, once.

    Returns the kernel's ``GlobalVar``. Its name (and global symbol) is ``kvtvm_`` plus the
    spec's URI and, when scalars are bound, their values (``kvtvm_prefill_float32_h2_g4_d64_
    nhd_causal1_sm_scale0p125_window0``); an identical function already in the module is
    reused, so each specialization is added once however many layers call it.
    """
    return _add_kernel(bb, spec, None, scalars)


def _flag_after(func, n_inputs: int):
    """``func`` with its error flag (the last parameter) moved to right after its first
    ``n_inputs`` parameters: ``call_tir_inplace`` passes in-place arguments before the fresh
    outputs, and the flag is an in-place argument when the graph reports it."""
    from ..kernels._tvm import tir

    p = list(func.params)
    return tir.PrimFunc(p[:n_inputs] + [p[-1]] + p[n_inputs:-1], func.body, func.ret_type,
                        func.attrs)


def _add_kernel(bb, spec: KernelSpec, flag_after: int | None, scalars: dict):
    func = kernel_func(spec, **scalars)
    name = f"kvtvm_{spec.uri}"
    for key in sorted(scalars):
        value = scalars[key]
        # repr: every float64 apart ("{:g}" kept 6 digits: two scales, one symbol, and
        # tvm.compile failed on the duplicate)
        text = repr(float(value)) if isinstance(value, float) else str(value)
        name += f"_{key}{text}".replace(".", "p").replace("-", "m").replace("+", "")
    if flag_after is not None and flag_after != len(func.params) - 1:
        func, name = _flag_after(func, flag_after), name + "_errarg"
    # the kernel's global symbol must be unique in the module (two specializations of one
    # kernel would otherwise both export ``kvtvm_prefill``)
    return bb.add_func(func.with_attr("global_symbol", name), name)


def _call(bb, spec, scalars, args, inplace, out_ty, error_flag, name_hint):
    """Emit the kernel call: ``args`` the inputs, ``inplace[i]`` the input index output ``i``
    writes (-1: a fresh output), ``out_ty`` the outputs but the flag. With ``error_flag`` the
    flag is one more in-place input (reported by :func:`check_errors`), else a scratch output."""
    from tvm import relax

    args = [a._expr if hasattr(a, "_expr") else a for a in args]
    if error_flag is None:
        gv = _add_kernel(bb, spec, None, scalars)
        if all(i >= 0 for i in inplace):
            call = relax.op.call_tir_inplace(gv, args, inplace_indices=inplace + [-1],
                                             out_ty=out_ty + [_ERR_TY()])
        else:
            call = relax.call_tir(gv, args, out_ty + [_ERR_TY()])
    else:
        flag = error_flag._expr if hasattr(error_flag, "_expr") else error_flag
        shape, dtype = _ty(flag, "error_flag")
        if dtype != "int32" or [_static(d, "error_flag shape") for d in shape] != \
                [_ERR_TY().shape.values[0].value]:
            raise InvalidArgumentError(describe("error_flag", "an int32 [4] tensor "
                                                "(KVInputVars.error_flag)", f"{shape} {dtype}"))
        gv = _add_kernel(bb, spec, len(args), scalars)
        call = relax.op.call_tir_inplace(gv, args + [flag],
                                         inplace_indices=inplace + [len(args)],
                                         out_ty=out_ty + [_ERR_TY()])
    return bb.emit(call, name_hint=name_hint)


def _ty(expr, name: str = "argument"):
    """(shape list, dtype) of a Relax tensor expression or an ``nn.Tensor`` of known shape;
    anything else (a torch tensor, None, a tuple, a tensor of unknown rank) is an
    :class:`InvalidArgumentError` naming ``name``."""
    if hasattr(expr, "_expr"):
        expr = expr._expr
    ty = getattr(expr, "ty", None)
    shape = getattr(getattr(ty, "shape", None), "values", None)
    if shape is None or not hasattr(ty, "dtype"):
        raise InvalidArgumentError(describe(
            name, "a Relax tensor expression (or nn.Tensor) of known shape",
            type(expr).__name__ if ty is None else f"{type(expr).__name__} of type {ty}"))
    return list(shape), str(ty.dtype)


def _same_dim(a, b) -> bool:
    """Whether two extents of Relax shapes may be the same: equal when both are static; a
    symbolic one (the page count) is bound when the kernel is called."""
    static = [hasattr(x, "value") and not hasattr(x, "name") for x in (a, b)]
    return not all(static) or int(a.value) == int(b.value)


def _static(value, what):
    if not hasattr(value, "value") or hasattr(value, "name"):
        raise InvalidArgumentError(describe(what, "a static extent", str(value)))
    return int(value.value)


def _check_layout(layout):
    from ..compiler import LAYOUTS

    if layout not in LAYOUTS:
        raise InvalidArgumentError(describe("layout", LAYOUTS, repr(layout)))


def _check_rows(name, x, heads, dim, dtype):
    """``x`` must be ``[num_tokens, heads, dim]`` of ``dtype`` (``num_tokens`` may be
    symbolic)."""
    shape, dt = _ty(x, name)
    if len(shape) != 3 or dt != dtype or _static(shape[1], f"n_kv_heads of {name}") != heads \
            or _static(shape[2], f"head_dim of {name}") != dim:
        raise InvalidArgumentError(describe(name, f"[num_tokens, {heads}, {dim}] {dtype} (as "
                                            "the cache)", f"{shape} {dt}"))


def _check_tables(**tables):
    """Each table must be int32 of its rank (``lookup_table`` 2, the others 1)."""
    for name, x in tables.items():
        shape, dt = _ty(x, name)
        rank = 2 if name == "lookup_table" else 1
        if dt != "int32" or len(shape) != rank:
            raise InvalidArgumentError(describe(name, f"an int32 tensor of rank {rank}",
                                                f"{shape} {dt}"))


def _check_scalars(causal, sm_scale, sliding_window):
    """The scalar arguments by the rules of :mod:`kvtvm.ops` (typed errors naming them)."""
    from ..ops.checks import check_causal, check_sliding_window, check_sm_scale

    return check_causal(causal), check_sm_scale(sm_scale), check_sliding_window(sliding_window)


def _check_cache(k_cache, v_cache, layout):
    _check_layout(layout)
    kshape, kdtype = _ty(k_cache, "k_cache")
    vshape, vdtype = _ty(v_cache, "v_cache")
    refuse_quantized("k_cache dtype", kdtype)
    refuse_quantized("v_cache dtype", vdtype)
    if len(kshape) != 4:
        raise InvalidArgumentError(describe("k_cache rank", 4, len(kshape)))
    # the same static extents (a v_cache of another head_dim or head count failed late,
    # inside tvm.compile)
    if kdtype != vdtype or len(vshape) != 4 or any(
            not _same_dim(a, b) for a, b in zip(kshape, vshape)):
        raise InvalidArgumentError(describe("v_cache", f"like k_cache ({kshape} {kdtype})",
                                            f"{vshape} {vdtype}"))
    heads = kshape[2] if layout == "nhd" else kshape[1]
    return _static(heads, "n_kv_heads of k_cache"), _static(kshape[3], "head_dim of k_cache"), \
        kdtype


def emit_append_kv(bb, k_cache, v_cache, k, v, qo_indptr, cache_lengths, lookup_table, *,
                   layout: str = "nhd", target: str = "llvm", arch: str | None = None,
                   knobs=(), error_flag=None):
    """Emit kvtvm's append kernel: write new K/V rows into one layer's cache, in place.

    Parameters
    ----------
    bb : relax.BlockBuilder
        Builder inside a function (``pure=False`` or a dataflow block).
    k_cache, v_cache : relax.Expr
        One layer's cache views, ``[num_pages, page_size, H, D]`` (nhd) or
        ``[num_pages, H, page_size, D]`` (hnd).
    k, v : relax.Expr
        New rows ``[num_tokens, H, D]``, the cache dtype.
    qo_indptr, cache_lengths, lookup_table : relax.Expr
        int32 ``[batch + 1]``, ``[batch]``, ``[batch, max_pages]``.
    layout : {"nhd", "hnd"}
    target, arch, knobs
        Kernel target (``"llvm"`` / ``"cuda"``), CUDA arch and schedule knobs.
    error_flag : relax.Expr, optional
        int32 ``[4]``: the graph parameter :attr:`KVInputVars.error_flag`. The kernel records
        the out-of-range entries it skips there, and :func:`check_errors` raises
        :class:`~kvtvm.errors.KernelIndexError` for them after the call. Without it they
        are skipped silently (a scratch flag).

    Returns
    -------
    (k_cache, v_cache) : relax.Var
        The written caches (aliases of the inputs): pass these, not the inputs, to attention.
        Inside a dataflow block (``nn`` export) an append whose results are never used is
        dead code to Relax and is removed; consuming them in attention keeps it.

    Raises
    ------
    InvalidArgumentError
        A layout, rank, static extent, shape or dtype the kernel cannot take (checked on the
        expressions' struct info, before anything is emitted).
    """
    from tvm import relax

    heads, dim, dtype = _check_cache(k_cache, v_cache, layout)
    _check_rows("k", k, heads, dim, dtype)
    _check_rows("v", v, heads, dim, dtype)
    _check_tables(qo_indptr=qo_indptr, cache_lengths=cache_lengths, lookup_table=lookup_table)
    spec = KernelSpec("append", dtype, dim, heads, layout=layout, target=target, arch=arch,
                      knobs=knobs)
    args = [k_cache, v_cache, k, v, qo_indptr, cache_lengths, lookup_table]
    args = [a._expr if hasattr(a, "_expr") else a for a in args]
    out = _call(bb, spec, {}, args, [0, 1], [args[0].ty, args[1].ty], error_flag,
                "kv_appended")
    return (bb.emit(relax.TupleGetItem(out, 0), name_hint="k_cache"),
            bb.emit(relax.TupleGetItem(out, 1), name_hint="v_cache"))


def _attention_spec(op, rows, q, k_cache, v_cache, layout, sm_scale, sliding_window, target,
                    arch, knobs):
    """Check ``q`` against the caches; returns ``(spec, q shape, sm_scale)`` of ``op``."""
    heads, dim, dtype = _check_cache(k_cache, v_cache, layout)
    qshape, qdtype = _ty(q, "q")
    if len(qshape) != 3 or qdtype != dtype or _static(qshape[2], "head_dim of q") != dim:
        raise InvalidArgumentError(describe("q", f"[{rows}, n_q_heads, {dim}] {dtype}",
                                            f"{qshape} {qdtype}"))
    hq = _static(qshape[1], "n_q_heads of q")
    if hq < 1 or hq % heads:
        raise InvalidArgumentError(describe("n_q_heads", f"a positive multiple of {heads}",
                                            hq))
    _, sm_scale, sliding_window = _check_scalars(True, sm_scale, sliding_window)
    scale = 1.0 / math.sqrt(dim) if sm_scale is None else float(sm_scale)
    features = ("sliding_window",) if sliding_window is not None else ()
    spec = KernelSpec(op, dtype, dim, heads, group_size=hq // heads, layout=layout,
                      target=target, arch=arch, features=features, knobs=knobs)
    return spec, qshape, scale


def emit_attention(bb, q, k_cache, v_cache, qo_indptr, cache_lengths, lookup_table, *,
                   layout: str = "nhd", causal: bool = True, sm_scale: float | None = None,
                   sliding_window: int | None = None, return_lse: bool = False,
                   target: str = "llvm", arch: str | None = None, knobs=(), error_flag=None):
    """Emit kvtvm's ragged prefill attention (which also serves decode: one new token each).

    Sequence ``b``'s query rows ``qo_indptr[b]:qo_indptr[b+1]`` attend over its
    ``cache_lengths[b] + n_new`` cached positions (causally by default); their K/V must have
    been appended first (pass the caches returned by :func:`emit_append_kv`).

    Parameters
    ----------
    q : relax.Expr
        ``[num_tokens, n_q_heads, head_dim]``, the cache dtype; ``n_q_heads`` a multiple of
        the cache's ``n_kv_heads`` (GQA).
    k_cache, v_cache, qo_indptr, cache_lengths, lookup_table : relax.Expr
        As for :func:`emit_append_kv`.
    causal : bool
    sm_scale : float, optional
        Score scale, ``1 / sqrt(head_dim)`` by default (bound into the kernel).
    sliding_window : int, optional
        Window in tokens (bound into the kernel).
    return_lse : bool
        Also return the float32 ``[num_tokens, n_q_heads]`` log-sum-exp.
    error_flag : relax.Expr, optional
        As for :func:`emit_append_kv`.

    Returns
    -------
    relax.Var
        ``[num_tokens, n_q_heads, head_dim]`` (and the lse with ``return_lse``).

    Raises
    ------
    InvalidArgumentError
        As for :func:`emit_append_kv`; also ``n_q_heads`` not a multiple of the cache's
        heads, or a bad ``causal`` / ``sm_scale`` / ``sliding_window``.
    """
    from tvm import relax

    spec, qshape, scale = _attention_spec("prefill", "num_tokens", q, k_cache, v_cache, layout,
                                          sm_scale, sliding_window, target, arch, knobs)
    hq, dim, dtype = spec.n_kv_heads * spec.group_size, spec.head_dim, spec.dtype
    causal = _check_scalars(causal, None, None)[0]
    _check_tables(qo_indptr=qo_indptr, cache_lengths=cache_lengths, lookup_table=lookup_table)
    scalars = dict(causal=int(causal), sm_scale=scale, window=int(sliding_window or 0))
    args = [q, k_cache, v_cache, qo_indptr, cache_lengths, lookup_table]
    ntok = qshape[0]
    out = _call(bb, spec, scalars, args, [-1, -1], [relax.TensorType([ntok, hq, dim], dtype),
                                                    relax.TensorType([ntok, hq], "float32")],
                error_flag, "attn")
    o = bb.emit(relax.TupleGetItem(out, 0), name_hint="attn_out")
    if return_lse:
        return o, bb.emit(relax.TupleGetItem(out, 1), name_hint="attn_lse")
    return o


def emit_decode_attention(bb, q, k_cache, v_cache, cache_lengths, lookup_table, *,
                          layout: str = "nhd", sm_scale: float | None = None,
                          sliding_window: int | None = None, num_splits: int = 1,
                          return_lse: bool = False, target: str = "llvm",
                          arch: str | None = None, knobs=(), error_flag=None):
    """Emit kvtvm's decode attention: one query token per sequence (split-KV kernel).

    Sequence ``b`` attends over positions ``[0, cache_lengths[b] + 1)`` (its current token
    already appended).

    Parameters
    ----------
    q : relax.Expr
        ``[batch, n_q_heads, head_dim]``.
    k_cache, v_cache, cache_lengths, lookup_table : relax.Expr
        As for :func:`emit_append_kv` (no ``qo_indptr``: row ``b`` is sequence ``b``).
    num_splits : int
        KV splits per sequence (workspace ``[num_splits, batch, n_q_heads, head_dim]``
        float32 is allocated by the graph; 1 needs no merge).
    sm_scale, sliding_window, return_lse, error_flag
        As for :func:`emit_attention`.

    Returns
    -------
    relax.Var
        ``[batch, n_q_heads, head_dim]`` (and the float32 ``[batch, n_q_heads]`` lse with
        ``return_lse``).

    Raises
    ------
    InvalidArgumentError
        As for :func:`emit_attention`; also ``num_splits`` outside ``[1, 128]``.
    """
    from tvm import relax

    spec, qshape, scale = _attention_spec("decode", "batch", q, k_cache, v_cache, layout,
                                          sm_scale, sliding_window, target, arch, knobs)
    hq, dim, dtype = spec.n_kv_heads * spec.group_size, spec.head_dim, spec.dtype
    from ..ops.decode import MAX_SPLITS

    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) \
            or not 1 <= num_splits <= MAX_SPLITS:
        raise InvalidArgumentError(describe("num_splits", f"an int in [1, {MAX_SPLITS}]",
                                            repr(num_splits)))
    num_splits = int(num_splits)
    _check_tables(cache_lengths=cache_lengths, lookup_table=lookup_table)
    scalars = dict(sm_scale=scale, window=int(sliding_window or 0))
    args = [q, k_cache, v_cache, cache_lengths, lookup_table]
    batch = qshape[0]
    out = _call(bb, spec, scalars, args, [-1] * 4, [
        relax.TensorType([batch, hq, dim], dtype), relax.TensorType([batch, hq], "float32"),
        relax.TensorType([num_splits, batch, hq, dim], "float32"),
        relax.TensorType([num_splits, batch, hq], "float32")], error_flag, "decode_attn")
    o = bb.emit(relax.TupleGetItem(out, 0), name_hint="attn_out")
    if return_lse:
        return o, bb.emit(relax.TupleGetItem(out, 1), name_hint="attn_lse")
    return o


# ------------------------------------------------------------------------------------------
# tvm.relax.frontend.nn
# ------------------------------------------------------------------------------------------


def nn_kv_spec(kv: KVInputVars) -> dict:
    """``tvm.relax.frontend.nn`` spec entries of the KV inputs: ``{"kv_caches":
    [spec.Tensor, ...] (k0, v0, k1, ...), "qo_indptr": ..., "cache_lengths": ...,
    "lookup_table": ..., "error_flag": ...}``, with the same shapes (and symbolic vars) as
    ``kv``.

    A method taking these arguments receives ``kv_caches`` as a list of ``nn.Tensor`` (pass
    ``error_flag=`` its ``error_flag`` to the ``nn_*`` calls); at run time pass the list
    ``kv_call_args(inputs)[:-4]`` and the last four tensors, then call :func:`check_errors`.
    """
    from tvm.relax.frontend.nn import spec

    def tensor(var):
        shape, dtype = _ty(var)
        return spec.Tensor([_static_or_var(d) for d in shape], dtype)

    caches = []
    for k, v in zip(kv.k_caches, kv.v_caches):
        caches += [tensor(k), tensor(v)]
    return {"kv_caches": caches, "qo_indptr": tensor(kv.qo_indptr),
            "cache_lengths": tensor(kv.cache_lengths), "lookup_table": tensor(kv.lookup_table),
            "error_flag": tensor(kv.error_flag)}


def _static_or_var(d):
    if hasattr(d, "value") and not hasattr(d, "name"):
        return int(d.value)
    return d


def _current_bb():
    from tvm.relax import BlockBuilder

    bb = BlockBuilder.current()
    if bb is None:
        raise InvalidArgumentError("kvtvm.relax nn_* helpers must run while an nn module is "
                                   "being exported (no current BlockBuilder)")
    return bb


def _wrap(expr, name):
    from tvm.relax.frontend import nn

    return nn.Tensor(_expr=expr)


def nn_append_kv(k_cache, v_cache, k, v, qo_indptr, cache_lengths, lookup_table, **kwargs):
    """:func:`emit_append_kv` on ``nn.Tensor`` values; returns the written
    ``(k_cache, v_cache)`` as ``nn.Tensor``."""
    kc, vc = emit_append_kv(_current_bb(), k_cache, v_cache, k, v, qo_indptr, cache_lengths,
                            lookup_table, **kwargs)
    return _wrap(kc, "k_cache"), _wrap(vc, "v_cache")


def nn_attention(q, k_cache, v_cache, qo_indptr, cache_lengths, lookup_table, **kwargs):
    """:func:`emit_attention` on ``nn.Tensor`` values; returns ``nn.Tensor`` (a tuple with
    the lse when ``return_lse``)."""
    out = emit_attention(_current_bb(), q, k_cache, v_cache, qo_indptr, cache_lengths,
                         lookup_table, **kwargs)
    if isinstance(out, tuple):
        return tuple(_wrap(o, "attn") for o in out)
    return _wrap(out, "attn")


def nn_decode_attention(q, k_cache, v_cache, cache_lengths, lookup_table, **kwargs):
    """:func:`emit_decode_attention` on ``nn.Tensor`` values."""
    out = emit_decode_attention(_current_bb(), q, k_cache, v_cache, cache_lengths,
                                lookup_table, **kwargs)
    if isinstance(out, tuple):
        return tuple(_wrap(o, "attn") for o in out)
    return _wrap(out, "attn")
