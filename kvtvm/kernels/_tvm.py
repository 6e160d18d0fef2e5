"""The one file that spells TVM's moving names.

apache-tvm 0.27 renamed ``tvm.tir`` to ``tvm.tirx``, the schedule package to ``tvm.s_tir`` and
TVMScript's ``T.block`` to ``T.sblock``; older and newer releases spell them differently again.
Every other kvtvm file imports the names it needs from here, so following TVM is a one-file
change. Importing this module needs TVM's compiler library.

TVMScript bodies use the names below instead of the renamed ones (the parser evaluates
``block("x")``, ``alloc_buffer(...)`` and ``{ATTR_NOALIAS: True}`` from the function's
globals like any other expression)::

    @prim_func                      # = @T.prim_func(s_tir=True): a schedulable PrimFunc
    def kernel(...):
        T.func_attr({ATTR_NOALIAS: True})
        with block("name"):
            tmp = alloc_buffer((n,), "float32")
"""

from __future__ import annotations

from tvm import s_tir as _s_tir
from tvm import tirx as tir  # the TIR IR: Var, IntImm, FloatImm, all, any, const, ...
from tvm.script import tirx as T  # TVMScript's TIR dialect
from tvm.tirx.script.parser import parser as _parser

#: A schedule over an IRModule, and a loop handle inside it.
Schedule = _s_tir.Schedule
LoopRV = _s_tir.schedule.LoopRV

#: PrimFunc attribute names.
ATTR_NOALIAS = "tirx.noalias"
ATTR_IS_SCHEDULED = "tirx.is_scheduled"

#: TVMScript's block scope (``with block("name"):``) and a buffer allocated in a block.
block = T.sblock
alloc_buffer = T.sblock_alloc_buffer


def get_block(sch, name: str):
    """The block named ``name`` in the function ``sch`` works on."""
    return sch.get_sblock(name)


def written_names(sch, block) -> list[str]:
    """Names of the buffers ``block`` writes, in its write-region order (0.27's region names
    its buffer ``.source``; earlier releases ``.buffer``)."""
    out = []
    for region in sch.get(block).writes:
        buf = getattr(region, "buffer", None)
        out.append(buf.name if buf is not None else region.source.name)
    return out


def _decorated_by_prim_func(node) -> bool:
    return any(getattr(dec, "id", None) == "prim_func" for dec in node.decorator_list)


_find_decorator_annotation = _parser.find_decorator_annotation


def _find_annotation(node, annotation: str, default: bool = True):
    # TVMScript reads ``s_tir=True`` from the decorator's source text, not from the decorator
    # object; a function decorated by our bare ``@prim_func`` has it on.
    if annotation == "s_tir" and _decorated_by_prim_func(node):
        return True
    return _find_decorator_annotation(node, annotation, default)


_parser.find_decorator_annotation = _find_annotation


def prim_func(func):
    """``@T.prim_func(s_tir=True)``: parse ``func`` as a schedulable PrimFunc (blocks, the
    buffer layout schedules expect). Use it bare, as ``@prim_func``."""
    return T.prim_func(s_tir=True)(func)


prim_func.dispatch_token = "tirx"  # the parser dispatches a decorated function on this

__all__ = ["tir", "T", "Schedule", "LoopRV", "ATTR_NOALIAS", "ATTR_IS_SCHEDULED", "block",
           "alloc_buffer", "get_block", "prim_func", "written_names"]
