"""ac-core's adapter conformance suite: the checks every adapter must pass, runnable on anyone's adapter.

This package is a stable surface for third parties: the names exported here (the pytest base
classes, the check functions, the tolerances) and the pytest options ``--ac-core-adapter`` and
``--ac-core-compile-backend`` keep their meaning across minor releases; modules and names
starting with ``_`` are private.

Opt in one of two ways (the model is pandas' ``tests/extension/base`` and fsspec's ``tests/abstract``):

* subclass :class:`AdapterConformance` (or the per-check classes such as :class:`CoverageTests`)
  in a test module and set ``adapter`` to an AdapterSpec, its registered name, or ``"module:attr"``;
* or name the adapter to pytest: ``pytest --pyargs ac_core_conformance --ac-core-adapter NAME``.

The checks run for every model class the adapter serves (built by its ``tiny`` factory), under every
registered policy at its defaults (``Full()``, ``Ops()``, ``BlockSkip(every=2)``; a test class may set
``policies``), on CPU and, where present, CUDA.

``ac_core_conformance.sweep`` runs a light subset of these checks on every model class diffusers and
transformers declare, built tiny from its defaults (``ac-core sweep``).

Skips come only from the adapter's declarations (no tiny factory, no such backend on this device,
no ``set_backend``) and from the model's capabilities (no ``save_pretrained``), never from names.

The checks, as the package's check registry lists them (each a module of ``checks`` with its pytest class):

"""

from __future__ import annotations

import importlib
import textwrap
from typing import Any

from ._registry import CHECKS, numbered

_EXPORTS = {
    "AdapterConformance": "suite",
    "AdapterTests": "base",
    "DEVICES": "base",
    "default_policies": "policies",
    "Subject": "subjects",
    "load_adapter": "subjects",
    "portable_ref": "subjects",
    "subjects_of": "subjects",
    "EAGER_TOLERANCE": "training",
    "INDUCTOR_TOLERANCE": "training",
    "Tolerance": "training",
}
_EXPORTS.update((name, check.module) for check in CHECKS for name in (check.tests, *check.exports))


def _check_list() -> str:
    """The numbered list of the checks, as the docstring ends with it."""
    items = (
        textwrap.fill(
            f"{number}. {check.name} (:class:`{check.tests}`): {check.summary}.",
            width=110,
            subsequent_indent=" " * len(f"{number}. "),
            break_on_hyphens=False,
        )
        for number, check in numbered()
    )
    return "\n".join(items) + "\n"


__doc__ = (__doc__ or "") + _check_list()

__all__ = sorted(_EXPORTS)  # pyright: ignore[reportUnsupportedDunderAll]  # the lazy exports above


def __getattr__(name: str) -> Any:
    # Lazy: the pytest plugin in this package is loaded by every pytest run, and must not import torch.
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ac_core_conformance' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
