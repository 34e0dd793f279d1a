"""The model inside common wrappers (peft, torch.compile, DDP, accelerate): what an adapter serves and where."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel


def _find(outer: nn.Module, inner: nn.Module) -> str | None:
    if inner is outer:
        return None
    return next((name for name, module in outer.named_modules() if module is inner), None)


def _wrapped(module: nn.Module) -> tuple[str, nn.Module] | None:
    """(FQN, module) of the model ``module`` wraps, or None where it wraps nothing known."""
    children = module._modules
    # torch.compile's OptimizedModule (also what accelerate's dynamo plugin returns).
    inner = children.get("_orig_mod")
    if inner is not None:
        return "_orig_mod", inner
    # DDP and DataParallel (accelerate's prepare gives one of them, or the model itself), and any wrapper whose
    # one child is `module` (as they are).
    inner = children.get("module")
    if inner is not None and (isinstance(module, (DistributedDataParallel, DataParallel)) or len(children) == 1):
        return "module", inner
    if type(module).__module__.split(".")[0] == "peft":
        # PeftModel: get_base_model() is the model under its tuner (base_model.model); a tuner (LoraModel) holds
        # it as `model`.
        get_base = getattr(type(module), "get_base_model", None)
        inner = get_base(module) if callable(get_base) else children.get("model")
        if isinstance(inner, nn.Module):
            name = _find(module, inner)
            if name is not None:
                return name, inner
    return None


def unwrap_model(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model`` and each model it wraps, outermost first, as (FQN in ``model``, module); ``[("", model)]`` for a
    model in no known wrapper.

    Known wrappers: peft's ``PeftModel`` (its ``get_base_model()``) and tuners, torch.compile's
    ``OptimizedModule`` (``_orig_mod``), DDP/DataParallel (``.module``; accelerate's ``prepare`` gives one of
    those or the model itself) and any module whose one child is ``module``.
    """
    levels = [("", model)]
    seen = {id(model)}
    while True:
        prefix, module = levels[-1]
        step = _wrapped(module)
        if step is None or id(step[1]) in seen:
            return levels
        seen.add(id(step[1]))
        levels.append((f"{prefix}.{step[0]}" if prefix else step[0], step[1]))
