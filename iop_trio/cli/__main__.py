"""``python -m iop_trio.cli``: the same as the ``iop-node`` console script."""

import sys

from . import main

sys.exit(main())
