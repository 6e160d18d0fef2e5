"""The one file that spells TVM's moving names.

apache-tvm 0.27 renamed ``tvm.tir`` to ``tvm.tirx``, the schedule package to ``tvm.s_tir`` and
TVMScript's ``T.block`` to ``T.sblock``; older and newer releases spell them differently again.
Every other kvtvm file imports the names it needs from here, so following TVM is a one-file
change. Importing this module needs TVM's compiler library.
"""

from __future__ import annotations

from tvm import s_tir as _s_tir
from tvm import tirx as tir  # the TIR IR: Var, IntImm, FloatImm, all, any, const, ...
from tvm.script import tirx as T  # TVMScript's TIR dialect (``@T.prim_func``)

#: A schedule over an IRModule, and a loop handle inside it.
Schedule = _s_tir.Schedule
LoopRV = _s_tir.schedule.LoopRV

#: PrimFunc attribute names.
ATTR_NOALIAS = "tirx.noalias"
ATTR_IS_SCHEDULED = "tirx.is_scheduled"

__all__ = ["tir", "T", "Schedule", "LoopRV", "ATTR_NOALIAS", "ATTR_IS_SCHEDULED"]
