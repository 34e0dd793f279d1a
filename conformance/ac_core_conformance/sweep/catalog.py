"""What the sweep covers: every transformer class diffusers ships, every causal-LM model type transformers maps.

Read from the installed library each run, so a new release's classes join the table by themselves.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass

LIBRARIES = ("diffusers", "transformers")


@dataclass(frozen=True)
class Target:
    """One row of the sweep: a model class, and for transformers the model type whose config builds it."""

    library: str
    name: str  # the row's label: the class name (diffusers) or the model type (transformers)
    module: str
    class_name: str
    model_type: str | None = None

    @property
    def ref(self) -> str:
        return f"{self.module}:{self.class_name}"

    def load(self) -> type:
        """The class, imported."""
        return getattr(importlib.import_module(self.module), self.class_name)


def _diffusers_targets() -> list[Target]:
    # Every ModelMixin defined in diffusers.models.transformers: the package the library files its transformers in.
    import diffusers.models.transformers as package
    from diffusers.models.modeling_utils import ModelMixin

    found: dict[str, Target] = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, type) and issubclass(obj, ModelMixin) and obj.__module__ == module.__name__:
                found[name] = Target("diffusers", name, module.__name__, name)
    return [found[name] for name in sorted(found)]


def _transformers_targets() -> list[Target]:
    # What every model module imports (seconds), imported once here rather than in each class's process.
    import transformers.generation
    import transformers.modeling_utils  # noqa: F401
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return [
        Target("transformers", model_type, "transformers", class_name, model_type)
        for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())
    ]


def targets(library: str, names: list[str] | None = None) -> list[Target]:
    """The sweep's rows for ``library``, or only those whose name or class is in ``names`` (an unknown name is an
    error naming the known ones)."""
    if library not in LIBRARIES:
        raise ValueError(f"the sweep covers {' and '.join(LIBRARIES)}, not {library!r}")
    found = _diffusers_targets() if library == "diffusers" else _transformers_targets()
    if not names:
        return found
    wanted = set(names)
    chosen = [t for t in found if t.name in wanted or t.class_name in wanted]
    unknown = wanted - {t.name for t in chosen} - {t.class_name for t in chosen}
    if unknown:
        raise ValueError(
            f"{library} has no {', '.join(sorted(unknown))} to sweep; its rows: {', '.join(t.name for t in found)}"
        )
    return chosen
