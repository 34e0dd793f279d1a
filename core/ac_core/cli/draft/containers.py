"""A model's containers of repeated blocks, found without an adapter: those of its declared block classes
(:mod:`ac_core.libraries.declarations`), or ModuleLists of one repeated class."""

from __future__ import annotations

from torch import nn

from ...containers import repeated_block_lists
from ...libraries.declarations import declared_block_classes, declared_containers


def find_containers(model: nn.Module) -> tuple[list[str], frozenset[str]]:
    """Containers (ModuleList, ModuleDict, Sequential) of repeated blocks, outermost only; those of the model's
    declared block classes if it declares any, else those of one repeated class."""
    declared = declared_block_classes(model)
    found = declared_containers(model, declared)
    if found or declared:
        return found, declared
    return repeated_block_lists(model), declared
