"""The blocks of a model, as its adapter declares them: the units to checkpoint, shard or compile one by one."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ._containers import resolve_containers
from .errors import AdapterError
from .registry import get_adapter
from .spec import AdapterSpec


def model_blocks(
    model: nn.Module, *, adapter: AdapterSpec | str | None = None, blocks: Sequence[str] | None = None
) -> list[tuple[str, nn.Module]]:
    """(FQN, block) for every block of every container the adapter declares for ``model``, in order.

    The adapter is found as :func:`apply_activation_checkpointing` finds it (from the model's class, by
    name, or given as a spec); ``blocks=["layers"]`` names the containers instead. Under FSDP2 these are
    the modules to ``fully_shard`` one by one before sharding the root.
    """
    if blocks is not None:
        if isinstance(blocks, str):
            raise TypeError(f"blocks takes a list of container paths, e.g. blocks=[{blocks!r}]")
        paths, owner = tuple(blocks), "blocks="
    else:
        spec = get_adapter(model if adapter is None else adapter)
        model_spec = spec.model_spec(model)
        if model_spec is None:
            served = ", ".join(m.class_name for m in spec.models)
            raise AdapterError(f"adapter {spec.name!r} does not serve {type(model).__name__} (it serves {served})")
        paths, owner = model_spec.containers, f"adapter {spec.name!r}"
    return [block for _, container in resolve_containers(model, paths, owner) for block in container]
