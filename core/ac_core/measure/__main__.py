"""``python -m ac_core.measure``: saved activations and backward recomputes per route, compiled."""

from __future__ import annotations

from .compiled import main

main()
