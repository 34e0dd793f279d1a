"""Which dispatcher ops of interest each block runs in one forward, and how often: what ``inspect`` measures."""

from __future__ import annotations

import functools
import operator
from collections import Counter
from collections.abc import Callable, Mapping

from torch import nn

from ..measure import attribute_ops


def block_op_counts(
    blocks: Mapping[str, nn.Module], run: Callable[[], object], selects: Callable[[str], bool]
) -> tuple[dict[str, Counter[str]], frozenset[str]]:
    """Per block label, the calls of each op name ``selects`` picks in one ``run()``; and the labels of the
    blocks that ran any op at all.

    One run finds the blocks that run and the op names picked; one more run per op name counts it by block
    (``attribute_ops`` counts the calls, not which op made them).
    """
    seen: set[str] = set()

    def any_op(name: str) -> bool:
        if selects(name):
            seen.add(name)
        return True

    with attribute_ops(blocks, any_op) as ran:
        run()
    counts: dict[str, Counter[str]] = {label: Counter() for label in blocks}
    for op in sorted(seen):
        with attribute_ops(blocks, functools.partial(operator.eq, op)) as calls:
            run()
        for label in blocks:
            if calls[label]:
                counts[label][op] = calls[label]
    return counts, frozenset(label for label in blocks if ran[label])
