"""``kvtvm.relax``: the historical name of :mod:`kvtvm.integrations.relax`.

This module replaces itself with that one in ``sys.modules``, so ``import kvtvm.relax``,
``from kvtvm import relax`` and ``from kvtvm.relax import emit_attention`` all give the same
module object and the same functions (private helpers and module state included).
"""

import sys

from .integrations import relax as _relax

sys.modules[__name__] = _relax
