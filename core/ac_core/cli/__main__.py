"""``python -m ac_core.cli``: the same as the ``ac-core`` script."""

from __future__ import annotations

import sys

from . import main

sys.exit(main())
