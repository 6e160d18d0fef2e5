"""Kernel families, one module per family (append, copy, decode, prefill), each owning:

- ``define(spec)``: the unscheduled PrimFunc (TVMScript, blocks named for the schedules);
- ``reference_<op>``: its plain numpy reference, re-exported from :mod:`.reference`;
- ``knob_space(spec)``: the schedule knobs ``kvtvm.tune`` searches on the spec's target;
- ``VARIANTS``: its named runtime variants, declared once in :mod:`.variants`.

Their schedules live in ``schedules/<family>/{cpu,cuda}.py``. :mod:`._tvm` is the only file
that spells TVM's moving names; :mod:`.accessor` is the one cache accessor every kernel is
written against. Importing a family module needs TVM's compiler (TVMScript); :mod:`.reference`
and :mod:`.variants` need no TVM at all (the runtime path imports only those).
"""
