"""Integrations of kvtvm with other frameworks; each module imports its framework lazily.

:mod:`.relax`
    kvtvm's kernels inside a TVM Relax model (``kvtvm.relax`` is the same module); the
    Relax types of a manager's inputs live in :mod:`.relax_inputs` and are re-exported there.
"""
