"""``python -m kvtvm``: see :mod:`kvtvm.cli`."""

import sys

from .cli import main

sys.exit(main())
