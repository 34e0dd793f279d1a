"""A sweep target as a conformance :class:`Subject`: its class built tiny, served by whichever adapter ac-core picks.

A class a curated adapter serves is checked through that adapter's own tiny factory. Any other class is built
from its defaults scaled down, its inputs probed from ``forward``'s signature, and served by the library route;
its attention calls per block are measured on one plain forward (the route declares none), so the checks then
hold it to what it ran.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ac_core import AdapterError, AdapterSpec, ModelCase, ModelSpec, get_adapter, op_matches, resolve_blocks
from ac_core.libraries.configs import build_model, derived_config
from ac_core.libraries.inputs import InputsError, build_inputs, loss_of, probe_inputs
from ac_core.libraries.route import Refusal, derive_adapter
from ac_core.measure import attribute_ops

from ..subjects import Subject
from .catalog import Target


class NotBuilt(Exception):
    """The tiny model could not be built or run from settings derived from its class."""


class Refused(Exception):
    """No adapter serves the class and the library route refuses it: the message is the route's reason."""


def _config_class(target: Target) -> type | None:
    if target.model_type is None:
        return None
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[target.model_type]


MAX_PARAMETERS = 20_000_000
"""A derived config that still builds a model this big has scaled down too little to run tiny."""


def _too_big(cls: type, config: Mapping[str, Any], config_class: type | None) -> str | None:
    """Why the derived config is not tiny (counted on ``meta``, nothing allocated), or None."""
    try:
        with torch.device("meta"):
            model = build_model(cls, config, config_class)
    except Exception:  # some constructors need real tensors: the real build then says what is wrong
        return None
    total = sum(p.numel() for p in model.parameters())
    if total <= MAX_PARAMETERS:
        return None
    largest = sorted(((p.numel(), name) for name, p in model.named_parameters()), reverse=True)[:3]
    return (
        f"the config derived from its defaults still builds {total:,} parameters (largest: "
        + ", ".join(f"{name} {n:,}" for n, name in largest)
        + "): a setting the scaling does not know keeps it large"
    )


def _attention_calls(adapter: AdapterSpec, model: nn.Module, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Per block class, the default backend's kernel calls per block (by position where blocks differ)."""
    resolved = resolve_blocks(model, adapter, check_versions=False)
    ops = adapter.backend(adapter.default_backend).ops if adapter.default_backend else ()
    blocks = {block.path: block.module for block in resolved}
    # With gradients, as the checks run it: a mask that takes gradients, or cycles run without them, change
    # which kernel runs and how often.
    with attribute_ops(blocks, lambda op: op_matches(op, ops)) as counts:
        model(**inputs)
    by_class: dict[str, list[tuple[int, str, int]]] = {}
    for block in resolved:
        by_class.setdefault(block.class_name, []).append((block.index, block.path, counts.get(block.path, 0)))
    return {cls: _per_block(found) for cls, found in by_class.items()}


def _per_block(found: list[tuple[int, str, int]]) -> int | dict[Any, int]:
    """One class's calls as ``attention_calls`` takes them: one count, else by index, else by path where blocks
    at one index of different containers differ (BriaFibo2's refiner and its text-injecting layers)."""
    if len({calls for _, _, calls in found}) == 1:
        return found[0][2]
    by_index: dict[int, set[int]] = {}
    for index, _, calls in found:
        by_index.setdefault(index, set()).add(calls)
    if all(len(calls) == 1 for calls in by_index.values()):
        return {index: calls.pop() for index, calls in by_index.items()}
    return {path: calls for _, path, calls in found}


def tiny_subject(target: Target) -> Subject:
    """``target`` as a Subject ready for the checks; :class:`NotBuilt` or :class:`Refused` where it cannot be."""
    cls = target.load()
    config_class = _config_class(target)
    try:
        config = derived_config(cls, config_class)
        too_big = _too_big(cls, config, config_class)
        if too_big is not None:
            raise NotBuilt(too_big)
        model = build_model(cls, config, config_class)
    except NotBuilt:
        raise
    except Exception as exc:
        raise NotBuilt(f"the tiny config derived from its defaults does not build: {exc!r}") from exc
    try:
        adapter = get_adapter(model)
    except AdapterError as exc:
        refusal = derive_adapter(model)
        raise Refused(refusal.reason if isinstance(refusal, Refusal) else str(exc)) from exc
    spec = adapter.model_spec(model)
    assert spec is not None  # get_adapter returned an adapter that serves it
    if spec.tiny is not None:
        return Subject(adapter, spec, adapter)
    try:
        inputs = probe_inputs(model.eval())
    except InputsError as exc:
        raise NotBuilt(str(exc)) from exc
    try:
        # Counted as the checks run it, in train mode: on CPU, SDPA with dropout takes the unfused math path.
        calls = _attention_calls(adapter, model.train(), build_inputs(inputs))
    except Exception as exc:
        raise NotBuilt(f"its forward with gradients fails where one without ran: {exc!r}") from exc

    def tiny() -> ModelCase:
        case = ModelCase(build_model(cls, config, config_class), build_inputs(inputs), loss_of)
        # Some models change themselves in their first forward (BigBird picks another attention and builds it,
        # drawing random weights): every check then compares steady models, whichever ran a forward first.
        with torch.no_grad():
            case.run()
        return case

    served: ModelSpec = replace(spec, tiny=tiny, attention_calls=calls)
    served_adapter = replace(adapter, models=(served,))
    return Subject(served_adapter, served, served_adapter)
