"""Objects that own cache memory and its tables refuse ``copy``, ``deepcopy`` and ``pickle``.

A shallow copy of a manager shared its page tables, free list and lock but not its fetch token,
so a fetch through one copy rewrote the tables the other's inputs still called live; deepcopy and
pickle failed with a bare ``TypeError`` on the lock. Pages move between managers and processes
by export / import (:mod:`kvtvm.manager.pageio`, :mod:`kvtvm.transfer`)."""

from __future__ import annotations

from ..errors import InvalidArgumentError, describe


class Uncopyable:
    """Mixin: ``copy.copy``, ``copy.deepcopy`` and ``pickle`` raise
    :class:`~kvtvm.errors.InvalidArgumentError` naming the class."""

    __slots__ = ()

    def _refuse_copy(self, what: str):
        name = type(self).__name__
        raise InvalidArgumentError(describe(
            name, f"one object per cache ({what} is not supported: it owns cache memory, page "
            "tables and a lock; move pages with export/import or kvtvm.transfer)",
            f"{what} of a {name}"))

    def __copy__(self):
        self._refuse_copy("copy.copy")

    def __deepcopy__(self, memo):
        self._refuse_copy("copy.deepcopy")

    def __reduce_ex__(self, protocol):
        self._refuse_copy("pickling")
