"""A drafted adapter as Python source: an ``AdapterSpec`` module to save, review and run the suite on."""

from __future__ import annotations

import json
import sys
from typing import Any

from ...libraries.inputs import TensorInput
from ...spec import class_path
from .findings import Findings
from .token_source import needs_math, token_count_source


def _py(value: Any) -> str:
    """Python source of a config or input value (tensor specs inside containers too), strings in double quotes
    (as ruff formats them)."""
    if isinstance(value, TensorInput):
        return value.source()
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
        lines.append(f"        {_py(name)}: {_py(value)},")
    return [*lines, "    }"]


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


def _construct_source(findings: Findings) -> list[str]:
    """The tiny factory's docstring and the lines that build the model: by the user's ``--factory`` function, or
    the class from the tiny config."""
    cls = findings.cls
    if findings.factory_ref is not None:
        module, _, attr = findings.factory_ref.partition(":")
        return [
            f'    """A tiny {cls.__name__} built by {findings.factory_ref}, its inputs and a loss."""',
            f"    from {module} import {attr.partition('.')[0]}",
            "",
            "    torch.manual_seed(0)",
            f"    model = {attr}()",
        ]
    config = [f"        {k}={_py(v)}," for k, v in findings.config.items()]
    construct = (
        [f"    model = {cls.__name__}(", f"        {cls.__name__}.config_class(", *config, "        )", "    )"]
        if findings.family == "transformers"
        else [f"    model = {cls.__name__}(", *config, "    )"]
    )
    top = cls.__module__.split(".")[0]
    return [
        f'    """A tiny {cls.__name__} built in code (no download), its inputs and a loss."""',
        f"    from {top if _import_string(cls).count('.') == 1 else cls.__module__} import {cls.__name__}",
        "",
        "    torch.manual_seed(0)",
        *construct,
    ]


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
    command = f"ac-core inspect {findings.ref} --draft"
    if findings.factory_ref is not None:
        command += f" --factory {findings.factory_ref}"
    imports = [
        f'"""A draft ac-core adapter for {cls.__name__}: `{command}`.',
        "",
        f"Check it: pytest --pyargs ac_core_conformance --ac-core-adapter <module>:{spec_name} -n 2",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        *(["import math"] if needs_math(findings) else []),
        "from collections.abc import Mapping",
        "from typing import Any",
        "",
        "import torch",
        "from torch import nn",
        "",
        "from ac_core import " + ", ".join(sorted(core_names, key=lambda n: (not n.isupper(), n))),
        *backend_imports,
    ]
    body = [
        f"def {factory}() -> ModelCase:",
        *_construct_source(findings),
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
    parts = [imports, body, token_count_source(findings), spec]
    return "\n\n\n".join("\n".join(p) for p in parts) + "\n"


def _installed(library: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return ".".join(version(library).split(".")[:2])
    except PackageNotFoundError:
        return None
