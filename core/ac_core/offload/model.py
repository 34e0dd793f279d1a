"""Offload as a property of a model: every forward counts its tokens and offloads when they reach the threshold.

Like checkpointing, it overrides ``forward`` on the instance (the module tree and every name stay
as they are) and keeps the forward it replaced, so that removing it restores the model exactly.
"""

from __future__ import annotations

import inspect
import operator
import types
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .._containers import resolve_path
from ..errors import AdapterError
from ..registry import get_adapter
from ..spec import AdapterSpec
from ._regions import no_offload
from ._session import OffloadSession
from ._transport import can_offload
from .config import OffloadConfig, TokenCount
from .context import offload_activations
from .stats import OffloadStats

STATE_ATTR = "_ac_core_offload"
KEEP_ATTR = "_ac_core_keep_on_device"


class _Wrapped:
    """The instance-level forward a wrapper replaced (None: the class's)."""

    __slots__ = ("previous_forward",)

    def __init__(self, previous_forward: Any) -> None:
        self.previous_forward = previous_forward

    def call(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if self.previous_forward is not None:
            return self.previous_forward(*args, **kwargs)
        return type(module).forward(module, *args, **kwargs)


class _ModelOffload(_Wrapped):
    __slots__ = ("config", "count", "last", "signature", "source")

    def __init__(self, model: nn.Module, config: OffloadConfig, count: TokenCount, source: str) -> None:
        super().__init__(model.__dict__.get("forward"))
        self.config = config
        self.count = count
        self.source = source
        forward = self.previous_forward or types.MethodType(type(model).forward, model)
        self.signature = inspect.signature(forward)
        self.last: OffloadStats | None = None

    def tokens(self, model: nn.Module, args: tuple, kwargs: dict) -> int | None:
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


def _offloading_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state: _ModelOffload = self.__dict__[STATE_ATTR]
    # Traced code runs no Python hooks at run time: offload the compiled model's call from outside instead.
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or not can_offload():
        return state.call(self, args, kwargs)
    tokens = state.tokens(self, args, kwargs)
    if tokens is None:
        return state.call(self, args, kwargs)
    context = offload_activations(state.config, tokens, model=self, inputs=tree_leaves((args, kwargs)))
    if isinstance(context, OffloadSession):
        state.last = context.stats
    with context:
        return state.call(self, args, kwargs)


def _kept_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    with no_offload():
        return self.__dict__[KEEP_ATTR].call(self, args, kwargs)


def token_counter(
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


def kept_modules(model: nn.Module, config: OffloadConfig) -> list[nn.Module]:
    """The modules ``config.keep_on_device`` names; raises naming a path the model lacks."""
    modules: list[nn.Module] = []
    for path in config.keep_on_device:
        found = resolve_path(model, path)
        if not found:
            children = [name for name, _ in model.named_children()]
            raise AdapterError(
                f"OffloadConfig.keep_on_device names {path!r}, which {type(model).__name__} does not have; "
                f"its top-level modules are {children}"
            )
        modules.extend(module for _, module in found)
    return modules


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
    keep = kept_modules(model, config)
    count, source = None, ""
    if config.enabled:
        spec = None
        if config.token_count is None:
            spec = get_adapter(model if adapter is None else adapter)
            if not spec.serves(model):
                raise AdapterError(
                    f"adapter {spec.name!r} does not serve {type(model).__name__}; name the right adapter, or pass "
                    "OffloadConfig(token_count=lambda model, inputs: ...)"
                )
        count, source = token_counter(model, config, spec, explicit_blocks=False)
    install(model, config, count, source, keep)
    return model


def remove_activation_offload(model: nn.Module) -> nn.Module:
    """Remove ac-core's activation offload from ``model`` (checkpointing, if any, stays); returns ``model``."""
    uninstall(model)
    return model


def install(
    model: nn.Module, config: OffloadConfig, count: TokenCount | None, source: str, keep: list[nn.Module]
) -> None:
    """Offload ``model``'s forwards by ``config`` (already validated); replaces an earlier ac-core offload."""
    uninstall(model)
    if not config.enabled or count is None:
        return
    for module in keep:
        module.__dict__[KEEP_ATTR] = _Wrapped(module.__dict__.get("forward"))
        module.__dict__["forward"] = types.MethodType(_kept_forward, module)
    model.__dict__[STATE_ATTR] = _ModelOffload(model, config, count, source)
    # A bound method (not a closure) so that copy.deepcopy rebinds it to the copy.
    model.__dict__["forward"] = types.MethodType(_offloading_forward, model)


def _restore(module: nn.Module, attr: str) -> bool:
    wrapped: _Wrapped | None = module.__dict__.pop(attr, None)
    if wrapped is None:
        return False
    if wrapped.previous_forward is None:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = wrapped.previous_forward
    return True


def uninstall(model: nn.Module) -> bool:
    """Remove ac-core's offload from ``model`` and its submodules; returns whether there was any."""
    removed = _restore(model, STATE_ATTR)
    for module in model.modules():
        removed = _restore(module, KEEP_ATTR) or removed
    return removed


def last_offload_stats(model: nn.Module) -> OffloadStats | None:
    """What offload did in ``model``'s most recent offloaded forward (and its backward, once run); None if none."""
    state = model.__dict__.get(STATE_ATTR)
    return state.last if state is not None else None
