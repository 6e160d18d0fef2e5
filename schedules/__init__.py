"""Target schedules of every kernel family (installed as ``kvtvm.schedules``).

``schedules/<family>/cpu.py`` (llvm) and ``schedules/<family>/cuda.py`` (sm_90a, sm_80: arch
differences are knob defaults chosen inside) each define ``default_knobs(spec) -> dict`` and
``schedule(mod, spec, knobs) -> IRModule``. A schedule either transforms the family's
definition, finding its blocks by name, or is a hand-written TIR kernel with the definition's
signature and block names (it says so at the top, and a test checks it against the
definition compiled unscheduled). :mod:`.common` holds helpers of every target.
"""
