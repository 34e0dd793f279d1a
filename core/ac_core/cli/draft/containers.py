"""A model's containers of repeated blocks, found without an adapter: those of its declared block classes, or
ModuleLists of one repeated class."""

from __future__ import annotations

from torch import nn

from ...blocks import module_lists

_TRANSFORMERS_LAYER_BASE = "GradientCheckpointingLayer"


def _block_names(model: nn.Module) -> frozenset[str]:
    names: set[str] = set()
    for attr in ("_no_split_modules", "_repeated_blocks"):
        value = getattr(model, attr, None) or ()
        names |= {value} if isinstance(value, str) else {str(v) for v in value}
    return frozenset(names)


def _is_block(module: nn.Module, declared: frozenset[str]) -> bool:
    return any(c.__name__ in declared or c.__name__ == _TRANSFORMERS_LAYER_BASE for c in type(module).__mro__)


def find_containers(model: nn.Module) -> tuple[list[str], frozenset[str]]:
    """Containers (ModuleList, ModuleDict, Sequential) of repeated blocks, outermost only; those of the model's
    declared block classes if it has any."""
    declared = _block_names(model)
    lists = [path for path in module_lists(model) if _is_block_list(model.get_submodule(path), declared)]
    outer = [p for p in lists if not any(p.startswith(q + ".") for q in lists)]
    return outer, declared


def _is_block_list(container: nn.Module, declared: frozenset[str]) -> bool:
    children = list(container.children())
    if not children:
        return False
    if declared or any(_is_block(c, declared) for c in children):
        return any(_is_block(c, declared) for c in children)
    return len(children) >= 2 and len({type(c) for c in children}) == 1 and any(children[0].children())
