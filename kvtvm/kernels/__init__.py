"""Kernel definitions: one module per family, each with ``define(spec)`` (the unscheduled
PrimFunc, blocks named for the schedules). Their plain numpy references live in
:mod:`.reference` (numpy only) and each family module re-exports its own ``reference_<op>``.

Importing a family module needs TVM's compiler (TVMScript); the runtime path never does, and
:mod:`.reference` needs no TVM at all.
"""
