"""Offload as a property of a model: every forward counts its tokens and offloads when they reach the threshold.

Like checkpointing, it is a layer of the model's forward chain (the module tree and every name stay
as they are), so removing it leaves the model, and any other layer on it, as they were.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .. import _chain
from ..blocks import ModelBlocks, modules_at, resolve_blocks
from ..errors import AdapterError
from ..spec import AdapterSpec
from ._regions import no_offload
from ._session import OffloadSession
from ._transport import can_offload
from .config import OffloadConfig, TokenCount
from .context import offload_activations
from .stats import OffloadStats

MODEL_KIND = "offload"
KEEP_KIND = "keep_on_device"


class _ModelOffload(_chain.ForwardLayer):
    """Offloads the forwards of the model it sits on whose token count reaches ``config.min_tokens``."""

    kind = MODEL_KIND

    def __init__(self, model: nn.Module, config: OffloadConfig, count: TokenCount, source: str) -> None:
        self.config = config
        self.count = count
        self.source = source
        self.signature = inspect.signature(_chain.original_forward(model))
        self.last: OffloadStats | None = None

    def tokens(self, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> int | None:
        """The forward's token count from its inputs bound by name; None when they do not bind (forward will raise)."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError:
            return None
        inputs: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            if self.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                inputs.update(value)
            else:
                inputs[name] = value
        try:
            return operator.index(self.count(model, inputs))
        except Exception as exc:
            raise ValueError(
                f"ac-core offload: {self.source} could not count the tokens of {type(model).__name__}'s inputs "
                f"{sorted(inputs)}: {exc}. Pass OffloadConfig(token_count=lambda model, inputs: ...) for this model."
            ) from exc

    def forward(self, module: nn.Module, call_next: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        # Traced code runs no Python hooks at run time: offload the compiled model's call from outside instead.
        if torch.compiler.is_compiling() or not torch.is_grad_enabled() or not can_offload():
            return call_next(*args, **kwargs)
        tokens = self.tokens(module, args, kwargs)
        if tokens is None:
            return call_next(*args, **kwargs)
        context = offload_activations(self.config, tokens, model=module, inputs=tree_leaves((args, kwargs)))
        if isinstance(context, OffloadSession):
            self.last = context.stats
        with context:
            return call_next(*args, **kwargs)


class _KeepOnDevice(_chain.ForwardLayer):
    """Tensors the module saves for backward stay on the device, as under :func:`no_offload`."""

    kind = KEEP_KIND

    def forward(self, module: nn.Module, call_next: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        with no_offload():
            return call_next(*args, **kwargs)


def _token_counter(
    model: nn.Module, config: OffloadConfig, adapter: AdapterSpec | None, *, explicit_blocks: bool
) -> tuple[TokenCount, str]:
    """Where the token count comes from: ``config.token_count``, else the adapter's; raises when neither exists."""
    if config.token_count is not None:
        return config.token_count, "OffloadConfig.token_count"
    if adapter is None:
        how = "blocks= names the containers and no adapter serves" if explicit_blocks else "no adapter serves"
        raise AdapterError(
            f"offload needs each forward's token count, and {how} {type(model).__name__} to compute it; pass "
            "OffloadConfig(min_tokens=..., token_count=lambda model, inputs: ...) (inputs are the forward's "
            "arguments by name), or an adapter with a token_count"
        )
    if adapter.token_count is None:
        raise AdapterError(
            f"adapter {adapter.name!r} declares no token_count, which offload needs; pass "
            "OffloadConfig(token_count=lambda model, inputs: ...)"
        )
    return adapter.token_count, f"adapter {adapter.name!r}"


def _kept_modules(model: nn.Module, config: OffloadConfig) -> list[nn.Module]:
    """The modules ``config.keep_on_device`` names; raises naming a path the model lacks."""
    modules: list[nn.Module] = []
    for path in config.keep_on_device:
        found = modules_at(model, path)
        if not found:
            children = [name for name, _ in model.named_children()]
            raise AdapterError(
                f"OffloadConfig.keep_on_device names {path!r}, which {type(model).__name__} does not have; "
                f"its top-level modules are {children}"
            )
        modules.extend(module for _, module in found)
    return modules


@dataclass(frozen=True)
class PreparedOffload:
    """Offload validated for a model and ready to install: nothing on the model has changed yet."""

    model: nn.Module
    config: OffloadConfig
    count: TokenCount | None
    source: str
    keep: tuple[nn.Module, ...]

    def install(self) -> None:
        """Offload the model's forwards by ``config``; replaces an earlier ac-core offload."""
        uninstall(self.model)
        if not self.config.enabled or self.count is None:
            return
        for module in self.keep:
            _chain.add(module, _KeepOnDevice())
        _chain.add(self.model, _ModelOffload(self.model, self.config, self.count, self.source))


def prepare(resolved: ModelBlocks, config: OffloadConfig) -> PreparedOffload:
    """Validate ``config`` for ``resolved``'s model (the token count's source, kept paths); changes nothing."""
    keep = tuple(_kept_modules(resolved.model, config))
    count, source = None, ""
    if config.enabled:
        count, source = _token_counter(
            resolved.model, config, resolved.adapter, explicit_blocks=resolved.adapter is None
        )
    return PreparedOffload(resolved.model, config, count, source, keep)


def apply_activation_offload(
    model: nn.Module, config: OffloadConfig, *, adapter: AdapterSpec | str | None = None
) -> nn.Module:
    """Offload ``model``'s activations in every forward whose token count reaches ``config.min_tokens``; in place.

    Works with or without checkpointing (``apply_activation_checkpointing(..., offload=config)`` does both
    in one call). The token count comes from ``config.token_count``, else from the adapter (found from the
    model's class, or named). ``config.min_tokens == 0`` removes offload. Applying again replaces the earlier
    config; :func:`remove_activation_offload` (or ``remove_activation_checkpointing``) removes it.
    """
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"apply_activation_offload takes an OffloadConfig, got {type(config).__name__}")
    keep = tuple(_kept_modules(model, config))
    count, source = None, ""
    if config.enabled:
        spec = None
        if config.token_count is None:
            spec = resolve_blocks(model, adapter).adapter
        count, source = _token_counter(model, config, spec, explicit_blocks=False)
    PreparedOffload(model, config, count, source, keep).install()
    return model


def remove_activation_offload(model: nn.Module) -> nn.Module:
    """Remove ac-core's activation offload from ``model`` (checkpointing, if any, stays); returns ``model``."""
    uninstall(model)
    return model


def uninstall(model: nn.Module) -> bool:
    """Remove ac-core's offload from ``model`` and its submodules; returns whether there was any."""
    removed = _chain.remove(model, MODEL_KIND) is not None
    for module in model.modules():
        removed = _chain.remove(module, KEEP_KIND) is not None or removed
    return removed


def last_offload_stats(model: nn.Module) -> OffloadStats | None:
    """What offload did in ``model``'s most recent offloaded forward (and its backward, once run); None if none."""
    layer = _chain.get(model, MODEL_KIND)
    return layer.last if isinstance(layer, _ModelOffload) else None
