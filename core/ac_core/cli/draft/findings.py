"""What an adapter must declare for a model class no adapter serves, found by building it tiny and running it."""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...blocks import resolve_blocks
from ...containers import module_lists
from ...coverage import undeclared_containers
from ...libraries.configs import build_model, derived_config, library_of
from ...libraries.inputs import InputsError, build_inputs, loss_of, probe_inputs
from ...measure import OpCounter, op_matches
from ...ops import DEFAULT_RETAINED_OPS, is_attention_like
from ...refs import load_ref
from ...spec import AdapterSpec, ModelCase, ModelSpec, class_path
from ..op_counts import block_op_counts
from .containers import find_containers
from .options import DraftError, load_class, load_factory
from .tokens import TokenDerivation, measure_tokens


@dataclass
class Findings:
    """What ``inspect`` found in a model class no adapter serves."""

    cls: type
    ref: str
    config: dict[str, Any]
    inputs: dict[str, Any] | None  # input specs; None where a function gave them
    inputs_ref: str | None
    containers: dict[str, str]  # path -> "n x BlockClass"
    declared_blocks: frozenset[str]  # what the model says its repeated blocks are
    factory_ref: str | None = None  # the function that built the model, where no config did
    attention_calls: dict[str, int | dict[int, int]] = field(default_factory=dict)
    ops_per_block: dict[str, dict[str, float]] = field(default_factory=dict)  # class -> op -> calls per block
    other_attention_ops: dict[str, list[str]] = field(default_factory=dict)  # class -> attention-like, unretainable
    dispatcher: bool | None = None  # processors go through diffusers' dispatcher (None: not a diffusers model)
    backends: dict[str, list[str]] = field(default_factory=dict)  # backend tried on CPU -> retainable ops it ran
    uncovered: dict[str, str] = field(default_factory=dict)
    tokens: TokenDerivation | None = None  # how token_count counts, measured on the tiny forward

    @property
    def family(self) -> str:
        return library_of(self.cls)

    @property
    def name(self) -> str:
        base = re.sub(r"(Transformer|Model|ForCausalLM|For\w+)+\d*\w*$", "", self.cls.__name__) or self.cls.__name__
        return re.sub(r"(?<!^)(?=[A-Z][a-z])", "_", base).lower().replace("__", "_")


def draft_spec(findings: Findings) -> AdapterSpec:
    """The drafted adapter as an object (its tiny factory is left out: the source defines it)."""
    return AdapterSpec(
        name=findings.name,
        models=(
            ModelSpec(
                cls=class_path(findings.cls),
                containers=tuple(findings.containers),
                attention_calls=findings.attention_calls,
            ),
        ),
    )


def retainable_ops() -> frozenset[str]:
    """Op names some known backend retains: PyTorch's fused SDPA kernels and diffusers' dispatcher backends'."""
    from ...libraries.diffusers import BACKENDS

    return DEFAULT_RETAINED_OPS | frozenset(op for b in BACKENDS for op in b.ops)


def _probe_backends(model_factory: Callable[[], nn.Module], inputs: Callable[[nn.Module], dict[str, Any]]) -> dict:
    from ...libraries.diffusers import attention_backends, set_attention_backend

    kept = retainable_ops()
    ran: dict[str, list[str]] = {}
    for backend in attention_backends():
        if not backend.is_available("cpu"):
            continue
        model = model_factory()
        try:
            set_attention_backend(model, backend.name)
            with torch.no_grad(), OpCounter() as counter:
                model(**inputs(model))
        except Exception as exc:
            ran[backend.name] = [f"failed: {exc!r}"]
            continue
        ran[backend.name] = sorted(op for op in counter.forward if op_matches(op, kept))
    return ran


def _attention_ops(
    model: nn.Module, blocks: Mapping[str, nn.Module], inputs: Mapping[str, Any]
) -> dict[str, Counter[str]]:
    """Block FQN -> attention-like op name -> calls in one forward."""

    def forward() -> None:
        with torch.no_grad():
            model(**inputs)

    return block_op_counts(blocks, forward, is_attention_like)[0]


def _builder(
    cls: type[nn.Module], config: Mapping[str, Any] | None, factory_ref: str | None
) -> tuple[Callable[[], nn.Module], dict[str, Any]]:
    """What builds the tiny model (again for each backend tried), and the config it builds from (none: a factory)."""
    if factory_ref is None:
        settings = {**derived_config(cls), **(config or {})}
        return functools.partial(build_model, cls, settings), settings
    if config is not None:
        raise DraftError("pass --config or --factory, not both: the factory builds the model, no config reaches it")
    return load_factory(factory_ref, cls), {}


def inspect_class(
    ref: str,
    *,
    config: Mapping[str, Any] | None = None,
    inputs_ref: str | None = None,
    factory_ref: str | None = None,
) -> tuple[Findings, ModelCase]:
    """Build ``ref``'s class tiny (from its derived config, or by ``factory_ref``), run it, and find its block
    containers, attention calls, backends and how its tokens are counted."""
    cls = load_class(ref)
    build, settings = _builder(cls, config, factory_ref)
    try:
        model = build()
    except DraftError:
        raise
    except Exception as exc:
        raise DraftError(
            f"could not build {cls.__name__} from the derived tiny config {json.dumps(settings)}: {exc!r}; "
            "pass --config '{...}' with settings that build (they override the derived ones), or, for a "
            "constructor that takes a config object, --factory module:function returning the built tiny model"
        ) from exc
    model.eval()
    if inputs_ref is not None:
        make = load_ref(inputs_ref, what="inputs function")
        input_spec = None

        def inputs_of(m: nn.Module) -> dict[str, Any]:
            torch.manual_seed(0)
            return dict(make(m))
    else:
        try:
            input_spec = probe_inputs(model)
        except InputsError as exc:
            raise DraftError(
                f"{exc}; pass --inputs module:function, a function(model) returning forward's keyword arguments"
            ) from exc

        def inputs_of(m: nn.Module) -> dict[str, Any]:
            torch.manual_seed(0)
            return build_inputs(input_spec)

    paths, declared = find_containers(model)
    if not paths:
        raise DraftError(
            f"{cls.__name__} has no container of repeated blocks; its block containers: {module_lists(model)}"
        )
    items = [
        (f"{p}.{name}", index, child)
        for p in paths
        for index, (name, child) in enumerate(model.get_submodule(p).named_children())
    ]
    blocks = {fqn: child for fqn, _, child in items}
    # attention_calls counts per position in the container, as Block.index does.
    positions = {fqn: index for fqn, index, _ in items}
    containers = {
        p: ", ".join(
            f"{n} x {k}" for k, n in Counter(type(c).__name__ for c in model.get_submodule(p).children()).items()
        )
        for p in paths
    }
    run_inputs = inputs_of(model)
    findings = Findings(cls, ref, dict(settings), input_spec, inputs_ref, containers, declared, factory_ref)
    _record_attention(findings, blocks, positions, _attention_ops(model, blocks, run_inputs))
    findings.tokens = measure_tokens(model, blocks, run_inputs)
    if findings.family == "diffusers" and callable(getattr(model, "set_attention_backend", None)):
        findings.backends = _probe_backends(lambda: build().eval(), inputs_of)
        # A processor that calls SDPA itself runs the fused kernel even when switched to the math backend.
        findings.dispatcher = not findings.backends.get("_native_math") and bool(findings.backends.get("native"))
    spec = draft_spec(findings)
    findings.uncovered = undeclared_containers(resolve_blocks(model, spec, check_versions=False))
    case = ModelCase(model, run_inputs, loss_of)
    return findings, case


def _record_attention(
    findings: Findings,
    blocks: Mapping[str, nn.Module],
    positions: Mapping[str, int],
    per_block: Mapping[str, Counter[str]],
) -> None:
    """Per block class: its attention calls (by position where blocks differ), the retainable ops a block runs
    on average, and the attention-like ops it runs that no backend retains."""
    kept = retainable_ops()
    by_class: dict[str, dict[int, int]] = {}
    totals: dict[str, Counter[str]] = {}
    runs: Counter[str] = Counter()
    for fqn, ops in per_block.items():
        kind = type(blocks[fqn]).__name__
        calls = sum(n for op, n in ops.items() if op_matches(op, kept))
        by_class.setdefault(kind, {})[positions[fqn]] = calls
        totals.setdefault(kind, Counter()).update(ops)
        runs[kind] += 1
        others = sorted(op for op in ops if not op_matches(op, kept))
        if others:
            findings.other_attention_ops.setdefault(kind, [])
            findings.other_attention_ops[kind] = sorted(set(findings.other_attention_ops[kind]) | set(others))
    for kind, calls in by_class.items():
        values = set(calls.values())
        findings.attention_calls[kind] = values.pop() if len(values) == 1 else dict(sorted(calls.items()))
        findings.ops_per_block[kind] = {
            op: n / runs[kind] for op, n in sorted(totals[kind].items()) if op_matches(op, kept)
        }
