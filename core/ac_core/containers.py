"""A model's containers by their shape: the ModuleLists, ModuleDicts and Sequentials that hold repeated blocks.

What ``blocks=`` can name and what messages suggest for it; no adapter is read here, so the adapter lookup,
the library route and the resolved blocks all use it.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

CONTAINER_TYPES = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
# These have no forward of their own, so one holds blocks but never is one.
_UNCALLABLE = (nn.ModuleList, nn.ModuleDict)


def inner_container(container: nn.Module) -> str | None:
    """The name of the first child of ``container`` that is a ModuleList or ModuleDict, if any."""
    return next((name for name, child in container.named_children() if isinstance(child, _UNCALLABLE)), None)


def holds_repeated_blocks(container: nn.Module) -> bool:
    """Two or more children of one class, each a module with modules of its own."""
    children = list(container.children())
    return len(children) >= 2 and len({type(c) for c in children}) == 1 and any(children[0].children())


def module_lists(model: nn.Module) -> list[str]:
    """FQNs of every ModuleList/ModuleDict/Sequential in ``model`` that holds no such container, the candidates
    for ``blocks=``: containers of repeated blocks first, then the small inner ones (``attn.to_out``, ``ff.net``)
    outside them."""
    lists = [
        (name, m)
        for name, m in model.named_modules()
        if name and isinstance(m, CONTAINER_TYPES) and inner_container(m) is None
    ]
    blocks = [name for name, m in lists if holds_repeated_blocks(m)]
    inside = tuple(f"{name}." for name in blocks)
    return blocks + [name for name, m in lists if name not in blocks and not name.startswith(inside)]


def inside(path: str, prefixes: Iterable[str]) -> bool:
    """Whether ``path`` is one of ``prefixes`` or a module below one."""
    return any(path == p or path.startswith(f"{p}.") for p in prefixes)


def outermost(paths: Iterable[str]) -> list[str]:
    """``paths`` without those below another of them, in order."""
    paths = list(paths)
    return [p for p in paths if not any(p.startswith(f"{q}.") for q in paths)]


def repeated_block_lists(model: nn.Module) -> list[str]:
    """The containers of repeated blocks among :func:`module_lists`, outermost only (a block's own list of
    experts is not one)."""
    return outermost(p for p in module_lists(model) if holds_repeated_blocks(model.get_submodule(p)))


def blocks_hint(model: nn.Module) -> str:
    """What to pass as ``blocks=`` for ``model``: its containers of repeated blocks, as a ready argument."""
    lists = repeated_block_lists(model)
    if lists:
        return (
            f"its ModuleLists of repeated blocks are {lists}: "
            f"apply_activation_checkpointing(model, 'full', blocks={lists!r})"
        )
    return (
        f"{type(model).__name__} has no ModuleList, ModuleDict or Sequential of repeated blocks (its containers: "
        f"{module_lists(model) or 'none'}); pass blocks=[...] with the FQN of each container holding its blocks"
    )
