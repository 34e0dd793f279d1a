"""The model libraries' own gradient checkpointing (diffusers, transformers): one table of their switches.

ac-core turns it off before checkpointing a model itself (blocks checkpointed twice would recompute
twice), and again where it is switched on afterwards (``gradient_checkpointing_enable()``, the
Trainer's ``gradient_checkpointing=True``, diffusers' ``enable_gradient_checkpointing()``): each
checkpointed block checks at its forward; ``ac-core bench`` and the conformance suite turn it on to
compare against it.
"""

from __future__ import annotations

import logging

from torch import nn

from ..unwrap import unwrap_model
from ..warnings import warn_once

logger = logging.getLogger("ac_core")

FLAG = "gradient_checkpointing"
"""The attribute both libraries set to True on each module whose forward checkpoints (transformers: every decoder
layer and its model; diffusers: the model whose forward loops over the blocks)."""

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
    # Only the disable method matters here: a model may offer it without its enable twin. A wrapper without one
    # (DDP) is looked through to the model it wraps.
    disable = None
    for _, level in unwrap_model(model):
        disable = next((off for _, off in SWITCHES if callable(getattr(level, off, None))), None)
        if disable is not None:
            getattr(level, disable)()
            break
    for m in model.modules():
        if getattr(m, "gradient_checkpointing", False) is True:
            m.gradient_checkpointing = False  # pyright: ignore[reportArgumentType]
    return f"model.{disable}()" if disable else "setting gradient_checkpointing = False on those modules"


def _library_name(model: nn.Module) -> str:
    # The model inside a wrapper (a PeftModel, torch.compile, DDP) names the library.
    top = type(unwrap_model(model)[-1][1]).__module__.split(".")[0]
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


def switched_on(root: nn.Module | None, segments: tuple[str, ...], block: nn.Module) -> str | None:
    """The FQN (in ``root``) of the first module on the way from ``root`` to ``block`` (at ``segments``) whose
    library checkpointing is on, or None. Cheap enough for every block forward: one dict read per module.

    Both libraries switch on by setting ``gradient_checkpointing = True`` on the instance.
    """
    if block.__dict__.get(FLAG) is True:
        return ".".join(segments)
    module = root
    for depth in range(len(segments)):
        if module is None:
            return None
        if module.__dict__.get(FLAG) is True:
            return ".".join(segments[:depth])
        module = module._modules.get(segments[depth])
    return None


_SWITCHED_ON_BY = {
    "transformers": "gradient_checkpointing_enable() / activation_checkpointing_enable(), or the Trainer's "
    "gradient_checkpointing=True",
    "diffusers": "enable_gradient_checkpointing()",
}


def keep_ours(root: nn.Module | None, block: nn.Module, found: str, kept: str) -> None:
    """Library checkpointing was switched on beneath (or over) ac-core's after ac-core was applied: turn it off
    again on ``root`` (or on ``block`` where the model is unknown) and say so, once per process and model class."""
    model = root if root is not None else block
    library = _library_name(model)
    how = _turn_off(model)
    warn_once(
        f"library_checkpointing_after_apply:{type(model).__name__}",
        "ac-core: %s gradient checkpointing was switched on for %s after ac-core checkpointed its blocks (found "
        "gradient_checkpointing=True on %s; e.g. by %s), so each block would be checkpointed twice and recomputed "
        "twice in backward. Kept ac-core's %r checkpointing and turned the library's off with %s. To use the "
        "library's instead, call ac_core.remove_activation_checkpointing(model) before switching it on.",
        library,
        type(model).__name__,
        repr(found) if found else "the model itself",
        _SWITCHED_ON_BY.get(library, "its gradient_checkpointing_enable() / enable_gradient_checkpointing()"),
        kept,
        how,
    )
