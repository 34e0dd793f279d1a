"""The model libraries' own gradient checkpointing (diffusers, transformers): one table of their switches.

ac-core turns it off before checkpointing a model itself (blocks checkpointed twice would recompute
twice); ``ac-core bench`` and the conformance suite turn it on to compare against it.
"""

from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger("ac_core")

SWITCHES: tuple[tuple[str, str], ...] = (
    ("enable_gradient_checkpointing", "disable_gradient_checkpointing"),  # diffusers ModelMixin
    ("activation_checkpointing_enable", "activation_checkpointing_disable"),  # transformers >= 5
    ("gradient_checkpointing_enable", "gradient_checkpointing_disable"),  # transformers before it (deprecated)
)
"""(enable, disable) method names, duck-typed: the first pair a model has is its library's switch."""


def library_checkpointing(model: nn.Module) -> list[str]:
    """FQNs of modules on which the model library's own gradient checkpointing is on (``""``: the model)."""
    return [name for name, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True]


def library_switch(model: nn.Module) -> tuple[str, str] | None:
    """The (enable, disable) method names ``model`` has, or None for a model without library checkpointing."""
    for enable, disable in SWITCHES:
        if callable(getattr(model, enable, None)) and callable(getattr(model, disable, None)):
            return enable, disable
    return None


def enable_library_checkpointing(model: nn.Module) -> str:
    """Turn on the model library's own gradient checkpointing; returns the method called.

    Raises NotImplementedError naming the methods looked for where the model has none, and passes on
    the library's own ValueError/NotImplementedError for a class it does not support.
    """
    switch = library_switch(model)
    if switch is None:
        names = " / ".join(f"{enable}()" for enable, _ in SWITCHES)
        raise NotImplementedError(f"{type(model).__name__} has no library gradient checkpointing ({names})")
    getattr(model, switch[0])()
    return switch[0]


def _turn_off(model: nn.Module) -> str:
    # Only the disable method matters here: a model may offer it without its enable twin.
    disable = next((off for _, off in SWITCHES if callable(getattr(model, off, None))), None)
    if disable is not None:
        getattr(model, disable)()
    for m in model.modules():
        if getattr(m, "gradient_checkpointing", False) is True:
            m.gradient_checkpointing = False  # pyright: ignore[reportArgumentType]
    return f"model.{disable}()" if disable else "setting gradient_checkpointing = False on those modules"


def _library_name(model: nn.Module) -> str:
    top = type(model).__module__.split(".")[0]
    return {"diffusers": "diffusers", "transformers": "transformers"}.get(top, "the model's own")


def disable_library_checkpointing(model: nn.Module, level: int | None = logging.WARNING) -> list[str]:
    """Turn off diffusers'/transformers' gradient checkpointing on ``model``; returns the modules it was on for.

    Says so at ``level`` (None: silently).
    """
    modules = library_checkpointing(model)
    if not modules:
        return modules
    how = _turn_off(model)
    if level is not None:
        logger.log(
            level,
            "ac-core: %s gradient checkpointing was on for %s (%d modules, e.g. %r); turned it off with %s so that "
            "blocks are not checkpointed twice. Call that yourself before applying ac-core to avoid this message.",
            _library_name(model),
            type(model).__name__,
            len(modules),
            modules[0] or type(model).__name__,
            how,
        )
    return modules
