"""The one rule by which a dispatcher op matches an op name: eager policies, the graph pass, measurements."""

from __future__ import annotations

from collections.abc import Iterable


def op_matches(op_name: str, names: Iterable[str]) -> bool:
    """Whether dispatcher op ``op_name`` (``"aten::mul.Tensor"``) is one of ``names``.

    A name with an overload matches that overload; a name without one (``"aten::mm"``) matches every
    overload. This is the one matching rule of ac-core, in eager policies, graph passes and measurements.
    """
    wanted = names if isinstance(names, (set, frozenset)) else set(names)
    return op_name in wanted or op_name.partition(".")[0] in wanted
