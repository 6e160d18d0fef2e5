"""Kernel definitions: one module per family, each with ``define(spec)`` (the unscheduled
PrimFunc, blocks named for the schedules) and its plain numpy ``reference_<op>`` beside it.

Importing a family module needs TVM's compiler (TVMScript); the runtime path never does.
"""
