"""Relax types of a kvtvm manager's per-step inputs, and the Relax vars and runtime arguments
that carry them (part of :mod:`kvtvm.integrations.relax`, which re-exports every name here).

:func:`struct_info_of` types a manager's plain input description
(:meth:`kvtvm.manager.KVCacheManager.input_specs`); it is what ``manager.input_symbols()``
calls. :func:`kv_input_vars_for` derives the per-layer cache views the kernels take and the
tables, as Relax vars; :func:`kv_call_args` gives the matching runtime tensors of a fetch.

The last KV input is the graph's error flag (int32 ``[4]``, :mod:`kvtvm.kernels.errflag`):
kernels emitted with ``error_flag=kv.error_flag`` record there the out-of-range entries they
skip (writing nothing outside their tensors); :func:`kv_call_args` passes kvtvm's flag of the
inputs' device (:func:`error_flag`) and :func:`check_errors`, called after the graph, raises
:class:`~kvtvm.errors.KernelIndexError` for what it recorded and zeroes it. One flag per device
is shared by every graph call on it (a GPU flag is read only by :func:`check_errors`, which
synchronizes): with graphs running in several threads, a check may report another's error.
"""

from __future__ import annotations

import numbers
import threading
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidArgumentError, describe
from ..inputs import RaggedKVCacheInputSymbols

__all__ = ["KVInputVars", "struct_info_of", "input_symbols_for", "kv_input_types",
           "kv_input_vars", "kv_input_vars_for", "kv_call_args", "KV_INPUT_NAMES",
           "error_flag", "check_errors"]

#: Order of the non-cache KV inputs after the per-layer caches (see :meth:`KVInputVars.params`).
KV_INPUT_NAMES = ("qo_indptr", "cache_lengths", "lookup_table", "error_flag")


def _i64(value):
    """An int64 shape entry: a python int stays an int, a ``tir.Var`` is kept."""
    return int(value) if isinstance(value, int) else value


def struct_info_of(specs: list) -> list:
    """Relax struct info of a manager's plain input description.

    Parameters
    ----------
    specs : list of RaggedKVCacheInputSymbols
        One per device, each field a :class:`kvtvm.manager.symbols.TensorSymbol` (as
        :meth:`KVCacheManager.input_specs` returns).

    Returns
    -------
    list of RaggedKVCacheInputSymbols
        The same entries with each field a Relax tensor type; a named dim becomes one int64
        ``tir.Var`` shared by every tensor of the list (``batch`` of ``cache_lengths`` is the
        ``batch`` of ``lookup_table``), ints stay concrete.
    """
    from tvm import relax

    from ..kernels._tvm import tir

    # TVM 0.27 names Relax struct info ``relax.TensorType``; older TVM ``TensorStructInfo``
    tensor_info = getattr(relax, "TensorStructInfo", None) or relax.TensorType
    dims: dict = {}

    def dim(d):
        if isinstance(d, str):
            if d not in dims:
                dims[d] = tir.Var(d, "int64")
            return dims[d]
        return int(d)

    def typed(sym):
        return tensor_info([dim(d) for d in sym.shape], sym.dtype)

    return [RaggedKVCacheInputSymbols(blocks=typed(s.blocks), cache_lengths=typed(s.cache_lengths),
                                      lookup_table=typed(s.lookup_table),
                                      max_lengths=typed(s.max_lengths)) for s in specs]


def input_symbols_for(manager) -> list:
    """Relax struct info of ``manager``'s per-step inputs, one entry per device (what
    ``manager.input_symbols()`` returns): :func:`struct_info_of` of ``manager.input_specs()``.
    A :class:`kvtvm.manager.LinearKVCache` has none (seed 004): :func:`kv_input_vars_for`
    describes it from its buffer."""
    if not callable(getattr(manager, "input_specs", None)):
        raise InvalidArgumentError(describe(
            "manager", "a paged or continuous kvtvm manager (input_specs(); a LinearKVCache "
            "goes to kv_input_vars_for)", type(manager).__name__))
    return struct_info_of(manager.input_specs())


def _layer_cache_shape(layout, num_pages, page_size, n_kv_heads, head_dim):
    if layout == "nhd":
        return [num_pages, page_size, n_kv_heads, head_dim]
    if layout == "hnd":
        return [num_pages, n_kv_heads, page_size, head_dim]
    raise InvalidArgumentError(describe("layout", ("nhd", "hnd"), repr(layout)))


def kv_input_types(num_layers: int, n_kv_heads: int, head_dim: int, dtype: str = "float32", *,
                   layout: str = "nhd", num_pages=None, page_size=None, width=None,
                   batch=None) -> dict[str, Any]:
    """Relax types of the KV inputs of one device, by name.

    Parameters
    ----------
    num_layers, n_kv_heads, head_dim : int
        Decoder layers, KV heads on the device, head size.
    dtype : str
        Cache dtype.
    layout : {"nhd", "hnd"}
        ``"nhd"``: PAGED / CONTINUOUS per-layer views ``[num_pages, page_size, H, D]``;
        ``"hnd"``: LINEAR per-layer views ``[num_slots, H, max_seq_len, D]``.
    num_pages, page_size, width : int or tir.Var, optional
        Cache extents and lookup-table width; symbolic (``int64`` vars) when None.
    batch : tir.Var, optional
        The batch-size var (symbolic when None).

    Returns
    -------
    dict
        ``"k_cache_<l>"``, ``"v_cache_<l>"`` for each layer (cache shape above), then
        ``"qo_indptr"`` int32 ``[batch + 1]``, ``"cache_lengths"`` int32 ``[batch]``,
        ``"lookup_table"`` int32 ``[batch, width]``, ``"error_flag"`` int32 ``[4]``: the order
        of :meth:`KVInputVars.params`.

    Raises
    ------
    InvalidArgumentError
        A count or extent that is not a positive int, or an unknown layout.
    DTypeMismatchError
        ``dtype`` is not a dtype name, or is an 8-bit storage type.
    """
    from tvm import relax

    from ..kernels._tvm import tir

    def positive(name, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise InvalidArgumentError(describe(name, "a positive int", repr(value)))
        return int(value)

    num_layers, n_kv_heads, head_dim = (positive(n, v) for n, v in (
        ("num_layers", num_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)))
    refuse_quantized("dtype", str(dtype))

    def sym(value, name, var=None):
        if value is None:
            return tir.Var(var or name, "int64")
        if isinstance(value, tir.IntImm):  # TVM's int
            value = int(value.value)
        elif isinstance(value, tir.Expr):  # a var or an expression of vars
            return value
        return positive(name, value)

    num_pages, page_size = sym(num_pages, "num_pages"), sym(page_size, "page_size")
    width, batch = sym(width, "width", "max_pages"), sym(batch, "batch")
    cache = relax.TensorType(_layer_cache_shape(layout, num_pages, page_size, int(n_kv_heads),
                                                int(head_dim)), dtype)
    types = {}
    for layer in range(int(num_layers)):
        types[f"k_cache_{layer}"] = cache
        types[f"v_cache_{layer}"] = cache
    types["qo_indptr"] = relax.TensorType([batch + 1], "int32")
    types["cache_lengths"] = relax.TensorType([batch], "int32")
    types["lookup_table"] = relax.TensorType([batch, width], "int32")
    types["error_flag"] = relax.TensorType([_err_slots()], "int32")
    return types


def _err_slots() -> int:
    from ..kernels.errflag import ERR_SLOTS

    return ERR_SLOTS


@dataclass
class KVInputVars:
    """The Relax parameters carrying one device's KV inputs.

    Attributes
    ----------
    k_caches, v_caches : list of relax.Var
        Per layer, ``[num_pages, page_size, H, D]`` (nhd) or ``[num_slots, H, max_seq_len, D]``
        (hnd), the cache dtype.
    qo_indptr : relax.Var
        int32 ``[batch + 1]``.
    cache_lengths : relax.Var
        int32 ``[batch]``: tokens cached before this step.
    lookup_table : relax.Var
        int32 ``[batch, width]``.
    layout : str
        Token layout of the cache views.
    error_flag : relax.Var
        int32 ``[4]``: pass it as ``error_flag=`` to the ``emit_*`` calls so that
        :func:`check_errors` reports what their kernels skipped.
    """

    k_caches: list
    v_caches: list
    qo_indptr: Any
    cache_lengths: Any
    lookup_table: Any
    layout: str = "nhd"
    error_flag: Any = None
    types: dict = field(default_factory=dict, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.k_caches)

    @property
    def batch(self):
        """The batch-size var (``int64``), shared by the three tables' shapes."""
        return self.cache_lengths.ty.shape.values[0]

    def params(self) -> list:
        """The vars in parameter order: ``k_cache_0, v_cache_0, k_cache_1, ...,
        qo_indptr, cache_lengths, lookup_table, error_flag`` (the order of
        :func:`kv_call_args`)."""
        out = []
        for k, v in zip(self.k_caches, self.v_caches):
            out += [k, v]
        return out + [self.qo_indptr, self.cache_lengths, self.lookup_table, self.error_flag]


def kv_input_vars(num_layers: int, n_kv_heads: int, head_dim: int, dtype: str = "float32", *,
                  layout: str = "nhd", **extents) -> KVInputVars:
    """Fresh Relax vars for the KV inputs (types from :func:`kv_input_types`)."""
    from tvm import relax

    types = kv_input_types(num_layers, n_kv_heads, head_dim, dtype, layout=layout, **extents)
    v = {name: relax.Var(name, ty) for name, ty in types.items()}
    return KVInputVars([v[f"k_cache_{i}"] for i in range(num_layers)],
                       [v[f"v_cache_{i}"] for i in range(num_layers)],
                       v["qo_indptr"], v["cache_lengths"], v["lookup_table"], layout=layout,
                       error_flag=v["error_flag"], types=types)


def _static_dims(ty) -> list:
    out = []
    for d in ty.shape.values:
        out.append(int(d) if hasattr(d, "value") and not hasattr(d, "name") else d)
    return out


def refuse_quantized(what: str, storage: str) -> None:
    """Raise for a quantized (8-bit) cache: the Relax integration emits the full-precision
    kernels only (quantized caches run through :mod:`kvtvm.ops`).

    Raises
    ------
    DTypeMismatchError
        Naming the storage type given and those supported.
    """
    from ..errors import DTypeMismatchError, describe
    from ..params import _CACHE_DTYPE_ALIASES, DTYPE_SIZES

    if storage in _CACHE_DTYPE_ALIASES:  # int8, float8_e4m3fn or an alias (fp8, e4m3)
        raise DTypeMismatchError(describe(
            what, f"one of {sorted(DTYPE_SIZES)} (the Relax integration has no quantized-cache "
            "kernels; use kvtvm.ops with a quantized cache)", storage))
    if storage not in DTYPE_SIZES:
        raise DTypeMismatchError(describe(what, f"a dtype name, one of {sorted(DTYPE_SIZES)}",
                                          repr(storage)))


def kv_input_vars_for(manager, device: int = 0) -> KVInputVars:
    """Relax vars for the KV inputs of ``manager`` on ``device``, agreeing with
    ``manager.input_symbols()``.

    The manager describes its whole cache tensor (``blocks``, concrete shape) and its tables
    (symbolic ``batch``, concrete lookup width); the per-layer views the kernels take are
    derived from the ``blocks`` shape of the manager's strategy, and ``qo_indptr`` gets
    ``[batch + 1]`` over the same ``batch`` var. A :class:`kvtvm.manager.LinearKVCache`
    (no ``input_symbols``) is described from its buffer, with a ``[batch, 1]`` slot table.

    Raises
    ------
    InvalidArgumentError
        ``manager`` is not a kvtvm manager, or ``device`` is out of range.
    DTypeMismatchError
        The cache is quantized (8-bit K or V: the Relax integration emits full-precision
        kernels only).
    """
    from ..kernels._tvm import tir
    from ..params import KVCacheStrategy

    if not (callable(getattr(manager, "input_symbols", None))
            or callable(getattr(manager, "get_kv_cache_buffer", None))):
        raise InvalidArgumentError(describe("manager", "a kvtvm cache manager (paged, "
                                            "continuous or LinearKVCache)",
                                            type(manager).__name__))
    strategy = manager.params.cache_strategy
    for name in ("k_cache_dtype", "v_cache_dtype"):
        refuse_quantized(f"params.{name}", str(getattr(manager.params, name,
                                                       manager.params.dtype)))
    if hasattr(manager, "input_symbols"):
        symbols = manager.input_symbols()
        if isinstance(device, bool) or not isinstance(device, numbers.Integral) \
                or not 0 <= device < len(symbols):
            raise InvalidArgumentError(describe("device", f"an int in [0, {len(symbols)})",
                                                repr(device)))
        sym = symbols[int(device)]
        blocks, dtype = _static_dims(sym.blocks), str(sym.blocks.dtype)
        lookup = sym.lookup_table.shape.values
        batch, width = lookup[0], _static_dims(sym.lookup_table)[1]
    else:  # LinearKVCache (seed 004's API has no input_symbols): its buffer and [batch, 1]
        buf = manager.get_kv_cache_buffer(device)
        blocks, dtype = [int(d) for d in buf.shape], manager.params.dtype
        batch, width = tir.Var("batch", "int64"), 1
    if strategy is KVCacheStrategy.LINEAR:
        # [num_layers, max_batch_size, 2, H, max_seq_len, D] -> view [slots, H, seq, D]
        num_layers, slots, _, heads, seq, dim = blocks
        return kv_input_vars(num_layers, heads, dim, dtype, layout="hnd",
                             num_pages=slots, page_size=seq, width=width, batch=batch)
    # CONTINUOUS / PAGED: [num_pages, 2, num_layers, page_size, H, D] -> [pages, page, H, D]
    pages, _, num_layers, page_size, heads, dim = blocks
    return kv_input_vars(num_layers, heads, dim, dtype, layout="nhd",
                         num_pages=pages, page_size=page_size, width=width, batch=batch)


def kv_call_args(inputs) -> list:
    """The runtime tensors matching :meth:`KVInputVars.params`, from one device's fetched
    :class:`kvtvm.inputs.RaggedKVCacheInputs`: per layer the zero-copy K and V views, then
    ``qo_indptr``, ``cache_lengths``, ``lookup_table`` and kvtvm's error flag of the device
    (:func:`error_flag`).

    Raises
    ------
    StaleInputsError
        ``inputs`` were superseded (a later fetch, their step, a release).
    DTypeMismatchError
        ``inputs`` of a quantized cache (:func:`refuse_quantized`).
    """
    if not callable(getattr(inputs, "check_live", None)):
        hint = " (a list: take one device's, manager.fetch(batch)[0])" \
            if isinstance(inputs, (list, tuple)) else ""
        raise InvalidArgumentError(describe("inputs", "one device's fetched inputs" + hint,
                                            type(inputs).__name__))
    inputs.check_live()
    params = getattr(inputs, "params", None)
    for name in ("k_cache_dtype", "v_cache_dtype") if params is not None else ():
        refuse_quantized(f"inputs.params.{name}", str(getattr(params, name, params.dtype)))
    coll = inputs.collection()
    out = []
    for layer in range(inputs.num_layers):
        out += [coll.get_key_cache(layer).blocks, coll.get_value_cache(layer).blocks]
    return out + [inputs.qo_indptr, inputs.cache_lengths, inputs.lookup_table,
                  error_flag(inputs.cache_lengths.device)]


_FLAGS: dict = {}  # torch.device (cuda) -> int32 [ERR_SLOTS] tensor, shared by its graphs
_FLAGS_LOCK = threading.Lock()
_CPU = threading.local()  # .flag: this thread's CPU flag (threads' graphs report apart)


def _cpu_flag():
    """The calling thread's CPU flag, made at its first use."""
    import torch

    flag = getattr(_CPU, "flag", None)
    if flag is None:
        flag = _CPU.flag = torch.zeros(_err_slots(), dtype=torch.int32)
    return flag


def _device(device):
    """The flag's device: cpu (any ``cpu:N``) or a CUDA device with its index; else a typed
    error naming ``device`` (no flag is made for it)."""
    import torch

    from ..manager.args import parse_devices

    if device is None:
        return torch.device("cpu")
    if not isinstance(device, (str, torch.device)):
        raise InvalidArgumentError(describe("device", "a device name or torch.device",
                                            repr(device)))
    (device,) = parse_devices(device, name="device")  # cpu or cuda, CUDA there
    if device.type == "cpu":
        return torch.device("cpu")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.index >= torch.cuda.device_count():
        raise InvalidArgumentError(describe(
            "device", f"a CUDA device of this machine (cuda:0 to cuda:"
            f"{torch.cuda.device_count() - 1})", str(device)))
    return device


def error_flag(device="cpu"):
    """kvtvm's error flag of Relax graphs on ``device``: an int32 ``[4]`` torch tensor, zero
    until a kernel emitted with ``error_flag=`` skips an out-of-range entry (what
    :func:`kv_call_args` passes as the ``error_flag`` parameter). On the CPU each thread has
    its own (a thread's :func:`check_errors` reports its own graphs' errors); a GPU's is
    shared by the graphs on it."""
    import torch

    if isinstance(device, torch.device):  # a tensor's device (kv_call_args, every step):
        if device.type == "cpu":           # its flag without parsing it again
            return _cpu_flag()
        flag = _FLAGS.get(device)
        if flag is not None:
            return flag
    device = _device(device)
    if device.type == "cpu":
        return _cpu_flag()
    flag = _FLAGS.get(device)
    if flag is None:
        with _FLAGS_LOCK:
            flag = _FLAGS.setdefault(device, torch.zeros(_err_slots(), dtype=torch.int32,
                                                         device=device))
    return flag


def check_errors(device=None) -> None:
    """Report what the kernels of Relax graphs skipped since the last check.

    Parameters
    ----------
    device : torch.device or str, optional
        The device whose flag to read (synchronizes with a GPU): on the CPU, the calling
        thread's; when None, the calling thread's CPU flag and every GPU's that
        :func:`error_flag` handed out.

    Raises
    ------
    KernelIndexError
        A kernel skipped an out-of-range entry (``lookup_table``, ``cache_lengths`` or
        ``qo_indptr`` named); the flag is zeroed, nothing outside the tensors was touched.
    """
    from ..ops.errflag import _ZERO, raise_flag

    import torch

    cpu = torch.device("cpu")
    devices = [cpu, *_FLAGS] if device is None else [_device(device)]
    for dev in devices:
        flag = getattr(_CPU, "flag", None) if dev == cpu else _FLAGS.get(dev)
        if flag is None:
            continue
        values = flag.cpu().numpy().copy()  # a CPU flag's numpy() is a view
        if values.tobytes() != _ZERO:
            flag.zero_()
            raise_flag(values, f"a kvtvm kernel in a Relax graph on {dev}")
