"""transformers models, as adapters declare them: attention implementations, switching, training without the KV cache.

Read from transformers 5.24 (``integrations/*_attention.py``, ``modeling_flash_attention_utils.py``,
``PreTrainedModel.set_attn_implementation``). Nothing here imports transformers.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..ops import DEFAULT_RETAINED_OPS
from ..spec import AttentionBackend
from ..warnings import warn_once

logger = logging.getLogger("ac_core")

BACKENDS: tuple[AttentionBackend, ...] = (
    AttentionBackend("sdpa", ops=tuple(sorted(DEFAULT_RETAINED_OPS)), devices=("cpu", "cuda")),
    AttentionBackend(
        "eager",
        not_retainable="eager_attention_forward multiplies, softmaxes and multiplies in Python: no single op "
        "carries the attention output",
        devices=("cpu", "cuda"),
    ),
    # flash-attn >= 2.7 registers these custom ops (flash_attn_interface.py); with a padding mask transformers
    # calls the varlen one. Without flash-attn installed, transformers may load a Hub kernel instead, whose op
    # namespace carries a build hash: nothing is retained then, and ac-core warns once.
    AttentionBackend(
        "flash_attention_2",
        ops=("flash_attn::_flash_attn_forward", "flash_attn::_flash_attn_varlen_forward"),
        devices=("cuda",),
        requires=("flash_attn",),
    ),
    # FlashAttention-3 (hopper/flash_attn_interface.py): flash_attn_3::_flash_attn_forward since Aug 2025,
    # flash_attn::_flash_attn_forward in the builds before that rename.
    AttentionBackend(
        "flash_attention_3",
        ops=("flash_attn_3::_flash_attn_forward", "flash_attn::_flash_attn_forward"),
        devices=("cuda",),
        requires=("flash_attn_interface",),
    ),
    # flash_attn.cute ships in the flash-attn-4 distribution under the top-level name flash_attn.
    AttentionBackend(
        "flash_attention_4",
        not_retainable="FlashAttention-4 (flash_attn.cute) launches CuTe DSL kernels from Python inside an "
        "autograd.Function: no dispatcher op carries the output",
        devices=("cuda",),
        requires=("flash_attn",),
    ),
    AttentionBackend(
        "flex_attention",
        not_retainable="transformers calls flex_attention through its own torch.compile'd wrapper, whose kernel "
        "an eager selective-checkpoint policy does not see (not verified on a GPU; flex has no backward on CPU)",
        devices=("cuda",),
    ),
)
"""The ``attn_implementation`` values a transformers model can train with, and the ops carrying their output."""


def set_attn_implementation(model: nn.Module, name: str) -> None:
    """Switch a transformers model (and its sub-models) to ``attn_implementation`` ``name``."""
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(name)
        return
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"{type(model).__name__} is not a transformers PreTrainedModel: it has no config")
    config._attn_implementation = name


# Whether a module is or holds a checkpointed block: ac_core.checkpointing's is_activation_checkpointed, handed
# over when that module is imported (it is above this one, which cannot import it).
_checkpointed: Callable[[nn.Module], bool] | None = None


def use_checkpointed_test(test: Callable[[nn.Module], bool]) -> None:
    """Make the KV-cache guard of :func:`train_without_kv_cache` tell checkpointed models by ``test``.

    ``ac_core.checkpointing`` calls it with :func:`ac_core.is_activation_checkpointed` when it is imported.
    """
    global _checkpointed
    _checkpointed = test


# Names a transformers forward gives the KV cache it reads and writes (``past_key_values`` before 5.x renamed it).
_CACHE_ARGS = ("cache", "past_key_values")


def _forward_params(cls: type) -> tuple[str, ...]:
    """Names of ``cls.forward``'s parameters after ``self``, in order (transformers' decorators keep __wrapped__)."""
    return tuple(inspect.signature(cls.forward).parameters)[1:]


def _argument(params: tuple[str, ...], args: tuple, kwargs: dict[str, Any], name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    index = params.index(name) if name in params else len(args)
    return args[index] if index < len(args) else None


def _drop_kv_cache(
    params: tuple[str, ...], module: nn.Module, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]] | None:
    """Forward pre-hook, bound to the forward's parameter names: with gradients through checkpointed blocks,
    the forward runs with use_cache=False."""
    # Checkpointed blocks recompute whenever gradients are on, in eval mode too; without gradients they
    # run plain, so generation keeps its cache.
    if not (torch.is_grad_enabled() and _checkpointed is not None and _checkpointed(module)):
        return None
    for name in _CACHE_ARGS:
        if _argument(params, args, kwargs, name) is not None:
            raise ValueError(
                f"{type(module).__name__} got a KV cache ({name}=...) in a forward with gradients, but its "
                "layers are activation-checkpointed: recomputing a layer in backward would write to the cache a "
                f"second time. Pass {name}=None to train, or run this forward under torch.no_grad()."
            )
    if _argument(params, args, kwargs, "use_cache"):
        warn_once(
            "use_cache",
            "ac-core: use_cache=True ignored in a forward with gradients of %s: its layers are activation-checkpointed "
            "and a KV cache would grow again when they are recomputed in backward.",
            type(module).__name__,
        )
    position = params.index("use_cache")
    if position < len(args):
        args = (*args[:position], False, *args[position + 1 :])
    else:
        kwargs["use_cache"] = False
    return args, kwargs


def _is_guard(hook: Any) -> bool:
    return getattr(hook, "func", None) is _drop_kv_cache


def train_without_kv_cache(model: nn.Module) -> None:
    """Make every forward of ``model`` with gradients run without the KV cache while its blocks are checkpointed.

    A decoder layer appends its keys and values to the cache; recomputing it in backward appends them
    again, and per-op checkpointing then fails with "aten.slice.Tensor invocation ... not found in
    storage". A forward pre-hook on each module whose forward takes ``use_cache`` (the model and its
    base model) passes ``use_cache=False`` when gradients are on and some block is checkpointed (the
    condition under which ac-core recomputes); an explicit cache object in such a forward is an error
    naming the fix. Forwards without gradients (generation) keep the cache. Applying it again adds
    nothing (and says nothing); the config is not changed.

    ``apply_activation_checkpointing`` calls it for every model, whichever route named the blocks (an
    adapter or ``blocks=``) and inside wrappers (a PeftModel, torch.compile, DDP): a model without such a
    forward is left as it is.
    """
    guarded = []
    for name, module in model.named_modules():
        params = _forward_params(type(module)) if hasattr(module, "config") else ()
        if "use_cache" not in params or any(_is_guard(hook) for hook in module._forward_pre_hooks.values()):
            continue
        # Names bound now, so that torch.compile does not trace inspect.signature in the hook.
        module.register_forward_pre_hook(functools.partial(_drop_kv_cache, params), with_kwargs=True)
        guarded.append(name or type(module).__name__)
    if guarded:
        logger.info(
            "ac-core: forwards with gradients of %s run without the KV cache while checkpointed (hooked: %s)",
            type(model).__name__,
            ", ".join(guarded),
        )


_REQUIREMENTS = (
    "training forwards run without the KV cache: a recomputed decoder layer would append its keys and values "
    "again. prepare() hooks the model so that such forwards get use_cache=False (also over an explicit "
    "use_cache=True, with a warning) and rejects an explicit cache object; forwards without gradients keep it",
    "transformers' own gradient checkpointing off (ac-core turns it off and says so, also where "
    "gradient_checkpointing_enable() or the Trainer's gradient_checkpointing=True comes after ac-core: at the next "
    "forward)",
)


def adapter_fields(*, default_backend: str = "sdpa") -> dict[str, Any]:
    """What every transformers model's adapter declares the same way, as ``AdapterSpec`` keyword arguments: the
    ``attn_implementation`` values it can train with (``default_backend``, the one a model is built on: ``sdpa``
    where the class supports it), how to switch them, and training without the KV cache."""
    return {
        "backends": BACKENDS,
        "default_backend": default_backend,
        "requirements": _REQUIREMENTS,
        "prepare": train_without_kv_cache,
        "set_backend": set_attn_implementation,
    }


@contextmanager
def meta_values_unread() -> Iterator[None]:
    """Inside, transformers' masks take meta tensors as it takes fake ones (``is_tracing``): it skips the checks that
    read values (a packed sequence in ``position_ids``, an all-ones ``attention_mask``), as under torch.compile.
    A meta tensor has no values to read (``.item()`` fails), so a model planned on ``meta`` is planned on the path
    its compiled step traces. transformers is not imported for it: a model of it has imported it already."""
    masking = sys.modules.get("transformers.masking_utils")
    traced = getattr(masking, "is_tracing", None)
    if masking is None or traced is None:
        yield
        return

    def is_tracing(tensor: Any = None) -> bool:
        return traced(tensor) or (isinstance(tensor, torch.Tensor) and tensor.is_meta)

    setattr(masking, "is_tracing", is_tracing)  # noqa: B010 (a module's attribute pyright cannot see)
    try:
        yield
    finally:
        setattr(masking, "is_tracing", traced)  # noqa: B010
