"""Finding block containers in a model from dotted paths."""

from __future__ import annotations

from torch import nn

from .errors import AdapterError


def module_lists(model: nn.Module) -> list[str]:
    """FQNs of every ModuleList/Sequential in ``model``: the candidates for ``blocks=``."""
    return [name for name, m in model.named_modules() if name and isinstance(m, (nn.ModuleList, nn.Sequential))]


def resolve_path(model: nn.Module, path: str) -> list[tuple[str, nn.Module]] | None:
    """The modules a dotted path names, with their FQNs; ``*`` expands over a ModuleDict's children.

    Returns None when some segment is missing.
    """
    found: list[tuple[str, nn.Module]] = [("", model)]
    for segment in path.split("."):
        step: list[tuple[str, nn.Module]] = []
        for prefix, module in found:
            if segment == "*":
                children = list(module.named_children())
            else:
                child = module._modules.get(segment)
                children = [] if child is None else [(segment, child)]
            if segment != "*" and not children:
                return None
            step.extend((f"{prefix}.{name}" if prefix else name, child) for name, child in children)
        found = step
    return found


def resolve_containers(
    model: nn.Module, paths: tuple[str, ...] | list[str], owner: str
) -> list[tuple[str, list[tuple[str, nn.Module]]]]:
    """For each container path: its FQN and its blocks as (FQN, module); raises naming ``owner`` on a miss."""
    result: list[tuple[str, list[tuple[str, nn.Module]]]] = []
    for path in paths:
        resolved = resolve_path(model, path)
        if resolved is None:
            raise AdapterError(
                f"{owner} names block container {path!r}, which {type(model).__name__} does not have; "
                f"its ModuleLists are {module_lists(model) or 'none'}"
            )
        for fqn, container in resolved:
            if not isinstance(container, (nn.ModuleList, nn.Sequential)):
                raise AdapterError(
                    f"{owner} names {fqn!r} as a block container, but it is a {type(container).__name__}, "
                    f"not a ModuleList; {type(model).__name__}'s ModuleLists are {module_lists(model) or 'none'}"
                )
            blocks = [(f"{fqn}.{name}", block) for name, block in container.named_children()]
            result.append((fqn, blocks))
    return result
