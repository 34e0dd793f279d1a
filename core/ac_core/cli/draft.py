"""What an adapter must declare for a model class no adapter serves, found by building it tiny and running it.

``ac-core inspect module:Class`` prints a :class:`Findings`; ``--draft`` also prints :func:`draft_source`,
an ``AdapterSpec`` as Python source. Nothing here prints: the command does (``inspect.py``).

A diffusers ``ModelMixin`` is built from its ``__init__`` defaults scaled down (2 layers, 2 heads of 16,
small embedding widths); a transformers ``PreTrainedModel`` from its config class, likewise. Inputs are
found by probing ``forward``'s signature with candidate shapes until one forward runs, unless
``inputs`` (a function of the model returning the keyword arguments) is given.
"""

from __future__ import annotations

import inspect
import itertools
import json
import re
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..coverage import undeclared_containers
from ..errors import AdapterError
from ..measure import attribute_ops, op_matches
from ..ops import DEFAULT_RETAINED_OPS, is_attention_like
from ..plan import module_lists, resolve_blocks
from ..refs import load_ref
from ..spec import AdapterSpec, ModelCase, ModelSpec, class_path

# Sizes of the tiny build.
LAYERS = 2
HEADS = 2
HEAD_DIM = 16
WIDTH = HEADS * HEAD_DIM
SMALL_DIM = 16
CHANNELS = 4
BATCH = 2
TEXT = 4
SIDE = 8  # latent height and width
FRAMES = 2
SEQ = 8
VOCAB = 64

_TRANSFORMERS_LAYER_BASE = "GradientCheckpointingLayer"


class DraftError(Exception):
    """The model could not be built or run from derived settings: the message says what to pass instead."""


# ---------------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class TensorInput:
    """A tensor input, as built and as Python source: ``randn``/``zeros`` of ``shape``, ``randint(high)`` or a
    fixed ``tensor`` of ``values``."""

    kind: str
    shape: tuple[int, ...] = ()
    high: int = 0
    values: tuple[float, ...] = ()
    dtype: str | None = None

    def build(self) -> torch.Tensor:
        dtype = getattr(torch, self.dtype) if self.dtype else None
        if self.kind == "randn":
            return torch.randn(*self.shape)
        if self.kind == "zeros":
            return torch.zeros(*self.shape)
        if self.kind == "randint":
            return torch.randint(0, self.high, self.shape)
        return torch.tensor(list(self.values), dtype=dtype)

    def source(self) -> str:
        shape = ", ".join(map(str, self.shape))
        if self.kind in ("randn", "zeros"):
            return f"torch.{self.kind}({shape})"
        if self.kind == "randint":
            return f"torch.randint(0, {self.high}, ({shape}{',' if len(self.shape) == 1 else ''}))"
        values = ", ".join(repr(v) for v in self.values)
        return f"torch.tensor([{values}]" + (f", dtype=torch.{self.dtype})" if self.dtype else ")")


def build_inputs(spec: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.build() if isinstance(v, TensorInput) else v for k, v in spec.items()}


# ---------------------------------------------------------------------------------------------- building


def load_class(ref: str) -> type[nn.Module]:
    """The model class ``module:Class`` names (``diffusers:SD3Transformer2DModel``)."""
    obj = load_ref(ref, what="model class")
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        raise AdapterError(f"{ref!r} is a {type(obj).__name__}, not an nn.Module class")
    return obj


def _family(cls: type) -> str:
    names = {base.__module__.split(".")[0] + "." + base.__name__ for base in cls.__mro__}
    if "transformers.PreTrainedModel" in names:
        return "transformers"
    if "diffusers.ModelMixin" in names:
        return "diffusers"
    return "torch"


def _is_layer_count(name: str) -> bool:
    return (name.startswith("num_") and "layer" in name) or name in ("depth", "num_blocks", "layers")


def _scale_int(name: str, value: int, inner: int | None) -> int:
    if _is_layer_count(name):
        return min(value, LAYERS)
    if name in ("num_attention_heads", "num_heads", "num_key_value_heads", "num_kv_heads"):
        return min(value, HEADS)
    if name in ("attention_head_dim", "head_dim"):
        return min(value, HEAD_DIM)
    if inner is not None and value == inner:
        return WIDTH
    if name.endswith("channels") and "num_channels" not in name:
        return min(value, CHANNELS)
    if ("dim" in name or "channels" in name or (name.endswith("size") and "patch" not in name)) and value > WIDTH:
        return SMALL_DIM
    return value


def _scale_axes(axes: tuple[int, ...], total: int) -> tuple[int, ...]:
    # Rotary axes split the head dimension into even parts that must add up to it.
    scaled = [max(2, round(a * total / sum(axes) / 2) * 2) for a in axes]
    scaled[-1] += total - sum(scaled)
    return tuple(scaled)


def diffusers_config(cls: type) -> dict[str, Any]:
    """``cls.__init__``'s defaults scaled down to a tiny model (only the values that change)."""
    defaults = {
        name: p.default
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty and name != "self"
    }
    heads = defaults.get("num_attention_heads")
    head_dim = defaults.get("attention_head_dim")
    inner = heads * head_dim if isinstance(heads, int) and isinstance(head_dim, int) else None
    config: dict[str, Any] = {}
    for name, value in defaults.items():
        if isinstance(value, bool) or not isinstance(value, int | tuple):
            continue
        if isinstance(value, int):
            scaled = _scale_int(name, value, inner)
        elif name.startswith("axes_dims") and value and all(isinstance(v, int) for v in value):
            scaled = _scale_axes(value, min(head_dim or HEAD_DIM, HEAD_DIM))
        else:
            continue
        if scaled != value:
            config[name] = scaled
    return config


def transformers_config(cls: type) -> dict[str, Any]:
    config_class = cls.config_class
    defaults = config_class().to_dict()
    config: dict[str, Any] = {}
    for name, value in defaults.items():
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if name == "vocab_size":
            config[name] = min(value, VOCAB)
        elif name in ("hidden_size", "d_model", "n_embd"):
            config[name] = WIDTH
        elif name in ("intermediate_size", "ffn_dim", "n_inner"):
            config[name] = 2 * WIDTH
        elif name in ("num_hidden_layers", "n_layer", "num_layers"):
            config[name] = LAYERS
        elif name in ("num_attention_heads", "num_key_value_heads", "n_head"):
            config[name] = HEADS
        elif name == "head_dim":
            config[name] = HEAD_DIM
        elif name == "max_position_embeddings":
            config[name] = min(value, 64)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(defaults.get(name), int) and defaults[name] >= config.get("vocab_size", VOCAB):
            config[name] = 0
    return config


def derived_config(cls: type) -> dict[str, Any]:
    family = _family(cls)
    if family == "diffusers":
        return diffusers_config(cls)
    if family == "transformers":
        return transformers_config(cls)
    return {}


def build_model(cls: type, config: Mapping[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    if _family(cls) == "transformers":
        return cls(cls.config_class(**config))
    return cls(**config)


def _candidates(model: nn.Module) -> dict[str, list[Any]]:
    """Per forward parameter, candidate inputs to try in order (the first one is preferred)."""
    params = inspect.signature(model.forward).parameters
    config = getattr(model, "config", None)

    def get(*names: str, default: int = SMALL_DIM) -> int:
        for name in names:
            value = getattr(config, name, None) if config is not None else None
            if value is None and isinstance(config, Mapping):
                value = config.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return default

    if _family(type(model)) == "transformers":
        return {"input_ids": [TensorInput("randint", (BATCH, SEQ), high=get("vocab_size", default=VOCAB))]}
    channels = get("in_channels", default=CHANNELS)
    patch = get("patch_size", default=1)
    patch_t = get("patch_size_t", default=1)
    side = max(SIDE, 2 * patch)
    text = get("joint_attention_dim", "text_embed_dim", "cross_attention_dim", "caption_channels", "text_dim")
    pooled = get("pooled_projection_dim", default=SMALL_DIM)
    frames = FRAMES * patch_t
    found: dict[str, list[Any]] = {}
    for name, param in params.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if name == "hidden_states":
            found[name] = [
                TensorInput("randn", (BATCH, channels, side, side)),
                TensorInput("randn", (BATCH, SEQ * 2, channels)),
                TensorInput("randn", (BATCH, channels, frames, side, side)),
                TensorInput("randn", (BATCH, frames, channels, side, side)),
            ]
        elif name == "encoder_hidden_states":
            found[name] = [TensorInput("randn", (BATCH, TEXT, text))]
        elif name in ("pooled_projections", "pooled_text_emb"):
            found[name] = [TensorInput("randn", (BATCH, pooled))]
        elif name == "timestep":
            found[name] = [
                TensorInput("tensor", values=(10, 500), dtype="long"),
                TensorInput("tensor", values=(0.01, 0.5)),
            ]
        elif name == "img_ids":
            found[name] = [TensorInput("zeros", (SEQ * 2, 3))]
        elif name == "txt_ids":
            found[name] = [TensorInput("zeros", (TEXT, 3))]
        elif name == "return_dict":
            found[name] = [False]
        elif param.default is inspect.Parameter.empty:
            found[name] = [TensorInput("randn", (BATCH, SIDE, SMALL_DIM))]
    return found


def _first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    for name in ("sample", "logits", "last_hidden_state"):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, (tuple, list)) and output:
        return _first_tensor(output[0])
    if isinstance(output, Mapping) and output:
        return _first_tensor(next(iter(output.values())))
    raise DraftError(f"forward returned a {type(output).__name__} with no tensor in it")


def loss_of(output: Any) -> torch.Tensor:
    """Mean square of the model output's first tensor: the draft's loss."""
    return _first_tensor(output).float().pow(2).mean()


def probe_inputs(model: nn.Module) -> dict[str, Any]:
    """Input specs (name -> TensorInput or value) with which one forward of ``model`` runs; DraftError if none."""
    candidates = _candidates(model)
    names = list(candidates)
    last: Exception | None = None
    for combination in itertools.islice(itertools.product(*(candidates[n] for n in names)), 32):
        spec = dict(zip(names, combination, strict=True))
        torch.manual_seed(0)
        try:
            with torch.no_grad():
                loss_of(model(**build_inputs(spec)))
        except Exception as exc:  # a wrong guess: try the next one
            last = exc
            continue
        return spec
    raise DraftError(
        f"no input derived from {type(model).__name__}.forward{inspect.signature(model.forward)} ran a forward "
        f"(last error: {last!r}); pass --inputs module:function, a function(model) returning forward's keyword "
        "arguments"
    )


# ---------------------------------------------------------------------------------------------- findings


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
    attention_calls: dict[str, int | dict[int, int]] = field(default_factory=dict)
    ops_per_block: dict[str, dict[str, float]] = field(default_factory=dict)  # class -> op -> calls per block
    other_attention_ops: dict[str, list[str]] = field(default_factory=dict)  # class -> attention-like, unretainable
    dispatcher: bool | None = None  # processors go through diffusers' dispatcher (None: not a diffusers model)
    backends: dict[str, list[str]] = field(default_factory=dict)  # backend tried on CPU -> retainable ops it ran
    uncovered: dict[str, str] = field(default_factory=dict)

    @property
    def family(self) -> str:
        return _family(self.cls)

    @property
    def name(self) -> str:
        base = re.sub(r"(Transformer|Model|ForCausalLM|For\w+)+\d*\w*$", "", self.cls.__name__) or self.cls.__name__
        return re.sub(r"(?<!^)(?=[A-Z][a-z])", "_", base).lower().replace("__", "_")


def _block_names(model: nn.Module) -> frozenset[str]:
    names: set[str] = set()
    for attr in ("_no_split_modules", "_repeated_blocks"):
        value = getattr(model, attr, None) or ()
        names |= {value} if isinstance(value, str) else {str(v) for v in value}
    return frozenset(names)


def _is_block(module: nn.Module, declared: frozenset[str]) -> bool:
    return any(c.__name__ in declared or c.__name__ == _TRANSFORMERS_LAYER_BASE for c in type(module).__mro__)


def find_containers(model: nn.Module) -> tuple[list[str], frozenset[str]]:
    """Containers (ModuleList, ModuleDict, Sequential) of repeated blocks, outermost only; those of the model's
    declared block classes if it has any."""
    declared = _block_names(model)
    lists = [path for path in module_lists(model) if _is_block_list(model.get_submodule(path), declared)]
    outer = [p for p in lists if not any(p.startswith(q + ".") for q in lists)]
    return outer, declared


def _is_block_list(container: nn.Module, declared: frozenset[str]) -> bool:
    children = list(container.children())
    if not children:
        return False
    if declared or any(_is_block(c, declared) for c in children):
        return any(_is_block(c, declared) for c in children)
    return len(children) >= 2 and len({type(c) for c in children}) == 1 and any(children[0].children())


def _count_ops(model: nn.Module, blocks: Mapping[str, nn.Module], run: Callable[[], Any]) -> dict[str, Counter[str]]:
    """Block FQN -> attention-like op name -> calls in one forward."""
    seen: set[str] = set()

    def attention(name: str) -> bool:
        if is_attention_like(name):
            seen.add(name)
            return True
        return False

    with torch.no_grad(), attribute_ops(blocks, attention):
        run()
    per_block: dict[str, Counter[str]] = {fqn: Counter() for fqn in blocks}
    for op in sorted(seen):
        with torch.no_grad(), attribute_ops(blocks, lambda name, op=op: name == op) as counts:
            run()
        for fqn in blocks:
            if counts[fqn]:
                per_block[fqn][op] = counts[fqn]
    return per_block


def retainable_ops() -> frozenset[str]:
    """Op names some known backend retains: PyTorch's fused SDPA kernels and diffusers' dispatcher backends'."""
    from ..libraries.diffusers import BACKENDS

    return DEFAULT_RETAINED_OPS | frozenset(op for b in BACKENDS for op in b.ops)


def _probe_backends(model_factory: Callable[[], nn.Module], inputs: Callable[[nn.Module], dict[str, Any]]) -> dict:
    from ..libraries.diffusers import attention_backends, set_attention_backend

    kept = retainable_ops()
    ran: dict[str, list[str]] = {}
    for backend in attention_backends():
        if not backend.is_available("cpu"):
            continue
        model = model_factory()
        try:
            set_attention_backend(model, backend.name)
            from ..measure import OpCounter

            with torch.no_grad(), OpCounter() as counter:
                model(**inputs(model))
        except Exception as exc:
            ran[backend.name] = [f"failed: {exc!r}"]
            continue
        ran[backend.name] = sorted(op for op in counter.forward if op_matches(op, kept))
    return ran


def inspect_class(
    ref: str, *, config: Mapping[str, Any] | None = None, inputs_ref: str | None = None
) -> tuple[Findings, ModelCase]:
    """Build ``ref``'s class tiny, run it, and find its block containers, attention calls and backends."""
    cls = load_class(ref)
    settings = {**derived_config(cls), **(config or {})}
    try:
        model = build_model(cls, settings)
    except Exception as exc:
        raise DraftError(
            f"could not build {cls.__name__} from the derived tiny config {json.dumps(settings)}: {exc!r}; "
            "pass --config '{...}' with settings that build (they override the derived ones)"
        ) from exc
    model.eval()
    if inputs_ref is not None:
        make = load_ref(inputs_ref, what="inputs function")
        input_spec = None

        def inputs_of(m: nn.Module) -> dict[str, Any]:
            torch.manual_seed(0)
            return dict(make(m))
    else:
        input_spec = probe_inputs(model)

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
    per_block = _count_ops(model, blocks, lambda: model(**run_inputs))
    kept = retainable_ops()
    findings = Findings(cls, ref, dict(settings), input_spec, inputs_ref, containers, declared)
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
    if findings.family == "diffusers" and callable(getattr(model, "set_attention_backend", None)):
        findings.backends = _probe_backends(lambda: build_model(cls, settings).eval(), inputs_of)
        # A processor that calls SDPA itself runs the fused kernel even when switched to the math backend.
        findings.dispatcher = not findings.backends.get("_native_math") and bool(findings.backends.get("native"))
    spec = draft_spec(findings)
    findings.uncovered = undeclared_containers(resolve_blocks(model, spec, check_versions=False))
    case = ModelCase(model, run_inputs, loss_of)
    return findings, case


# ---------------------------------------------------------------------------------------------- the draft


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


def _py(value: Any) -> str:
    """Python source of a config or input value, strings in double quotes (as ruff formats them)."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_py, value)) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, list):
        return "[" + ", ".join(map(_py, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_py(k)}: {_py(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _inputs_source(findings: Findings) -> list[str]:
    if findings.inputs is None:
        module, _, attr = (findings.inputs_ref or "").partition(":")
        return [f"    from {module} import {attr} as make_inputs", "", "    inputs = dict(make_inputs(model))"]
    lines = ["    inputs = {"]
    for name, value in findings.inputs.items():
        text = value.source() if isinstance(value, TensorInput) else _py(value)
        lines.append(f"        {_py(name)}: {text},")
    return [*lines, "    }"]


def _token_count_source(findings: Findings) -> list[str]:
    inputs = findings.inputs or {}
    hidden = inputs.get("hidden_states")
    lines = [
        "def token_count(model: nn.Module, inputs: Mapping[str, Any]) -> int:",
        '    """Tokens one forward\'s main attention processes, over the whole batch (review it)."""',
    ]
    if "input_ids" in inputs:
        return [*lines, '    return inputs["input_ids"].numel()']
    text = '    text = inputs["encoder_hidden_states"].shape[:2].numel() if "encoder_hidden_states" in inputs else 0'
    if isinstance(hidden, TensorInput) and len(hidden.shape) in (4, 5):
        return [
            *lines,
            '    shape = inputs["hidden_states"].shape',
            '    patch = getattr(model.config, "patch_size", 1) or 1',
            "    frames = shape[2] if len(shape) == 5 else 1  # check which axis holds the frames of your model",
            text,
            "    return shape[0] * frames * (shape[-2] // patch) * (shape[-1] // patch) + text",
        ]
    return [*lines, text, '    return inputs["hidden_states"].shape[:2].numel() + text']


def _import_string(cls: type) -> str:
    """``diffusers.SD3Transformer2DModel`` where the top-level package exports the class, else its full path."""
    top = cls.__module__.split(".")[0]
    package = sys.modules.get(top)
    try:
        exported = getattr(package, cls.__name__, None) is cls
    except Exception:  # a lazy module that fails to resolve the name
        exported = False
    return f"{top}.{cls.__name__}" if exported else class_path(cls)


def _backend_source(findings: Findings) -> tuple[list[str], list[str], list[str]]:
    """(imports, AdapterSpec fields for backends, fields for prepare/set_backend)."""
    if findings.family == "transformers":
        return (
            ["from ac_core.libraries.transformers import BACKENDS, set_attn_implementation, train_without_kv_cache"],
            ["    backends=BACKENDS,  # transformers' attn_implementation values", '    default_backend="sdpa",'],
            ["    prepare=train_without_kv_cache,", "    set_backend=set_attn_implementation,"],
        )
    if findings.dispatcher:
        return (
            ["from ac_core.libraries.diffusers import attention_backends, set_attention_backend"],
            [
                "    # Its processors go through diffusers' attention dispatcher: its backends, switched per model.",
                "    backends=attention_backends(),",
                '    default_backend="native",',
            ],
            ["    set_backend=set_attention_backend,"],
        )
    why = (
        "Its processors call torch's SDPA themselves (diffusers' attention dispatcher does not reach them)"
        if findings.dispatcher is False
        else "The model calls torch's SDPA"
    )
    return (
        [],
        [
            f"    # {why}:",
            "    # its fused kernels carry the attention output.",
            "    # Declare more backends together with a set_backend that switches this model to each of them.",
            '    backends=(AttentionBackend("sdpa", ops=tuple(sorted(DEFAULT_RETAINED_OPS))),),',
            '    default_backend="sdpa",',
        ],
        [],
    )


def draft_source(findings: Findings) -> str:
    """An ``AdapterSpec`` for ``findings.cls`` as a Python module: save it, review it, run the suite on it."""
    cls = findings.cls
    name = findings.name
    factory = f"tiny_{name}"
    spec_name = f"{name.upper()}_ADAPTER"
    top = cls.__module__.split(".")[0]
    backend_imports, backend_fields, hooks = _backend_source(findings)
    core_names = ["AdapterSpec", "ModelCase", "ModelSpec"]
    if not backend_imports:
        core_names += ["DEFAULT_RETAINED_OPS", "AttentionBackend"]
    imports = [
        f'"""A draft ac-core adapter for {cls.__name__}: `ac-core inspect {findings.ref} --draft`.',
        "",
        f"Check it: pytest --pyargs ac_core_conformance --ac-core-adapter <module>:{spec_name} -n 2",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "from collections.abc import Mapping",
        "from typing import Any",
        "",
        "import torch",
        "from torch import nn",
        "",
        "from ac_core import " + ", ".join(sorted(core_names, key=lambda n: (not n.isupper(), n))),
        *backend_imports,
    ]
    config = [f"        {k}={_py(v)}," for k, v in findings.config.items()]
    construct = (
        [f"    model = {cls.__name__}(", f"        {cls.__name__}.config_class(", *config, "        )", "    )"]
        if findings.family == "transformers"
        else [f"    model = {cls.__name__}(", *config, "    )"]
    )
    body = [
        f"def {factory}() -> ModelCase:",
        f'    """A tiny {cls.__name__} built in code (no download), its inputs and a loss."""',
        f"    from {top if _import_string(cls).count('.') == 1 else cls.__module__} import {cls.__name__}",
        "",
        "    torch.manual_seed(0)",
        *construct,
        *_inputs_source(findings),
        "",
        "    def loss(output: Any) -> torch.Tensor:",
        "        first = output[0] if isinstance(output, (tuple, list)) else output",
        '        first = getattr(first, "sample", getattr(first, "logits", first))',
        "        return first.float().pow(2).mean()",
        "",
        "    return ModelCase(model, inputs, loss)",
    ]
    calls = []
    for kind, count in findings.attention_calls.items():
        ops = findings.ops_per_block.get(kind, {})
        note = ", ".join(f"{op.rpartition(':')[2]} x{n:g}" for op, n in ops.items()) or "no fused attention op"
        if isinstance(count, dict):
            calls.append("                # per block index in its container, as the tiny model lays them out")
        calls.append(f"                {_py(kind)}: {_py(count)},  # ran {note} per block")
    containers = _py(tuple(findings.containers))
    library = top if top in ("diffusers", "transformers") else None
    version = _installed(library) if library else None
    spec = [
        f"{spec_name} = AdapterSpec(",
        f"    name={_py(name)},",
        "    models=(",
        "        ModelSpec(",
        f"            cls={_py(_import_string(cls))},",
        f"            containers={containers},",
        "            attention_calls={",
        *calls,
        "            },",
        *(
            [f"            versions={_py(f'{library}>={version}')},  # the version this layout was read from"]
            if version
            else []
        ),
        f"            tiny={factory},",
        "        ),",
        "    ),",
        *backend_fields,
        *([f"    library={_py(library)},"] if library else []),
        *hooks,
        "    token_count=token_count,",
        ")",
    ]
    parts = [imports, body, _token_count_source(findings), spec]
    return "\n\n\n".join("\n".join(p) for p in parts) + "\n"


def _installed(library: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return ".".join(version(library).split(".")[:2])
    except PackageNotFoundError:
        return None


def load_config(value: str | None) -> dict[str, Any] | None:
    """``--config``: a JSON object, or ``@file.json``."""
    if value is None:
        return None
    text = open(value[1:]).read() if value.startswith("@") else value  # noqa: SIM115
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DraftError(f"--config is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise DraftError(f"--config must be a JSON object, got {type(config).__name__}")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}


__all__ = [
    "DraftError",
    "Findings",
    "TensorInput",
    "draft_source",
    "draft_spec",
    "inspect_class",
    "load_class",
    "load_config",
]
