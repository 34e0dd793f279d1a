"""Collectives by their dispatcher op names: ops ac-core never retains."""

from __future__ import annotations

# Op namespaces of collectives. Nothing in them is ever retained: see ops.py for why.
COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d", "c10d_functional")


def is_collective(op_name: str) -> bool:
    """True for a dispatcher op name in a collective namespace, e.g. ``_c10d_functional::all_gather_into_tensor``."""
    return op_name.split("::", 1)[0] in COLLECTIVE_NAMESPACES and "::" in op_name
