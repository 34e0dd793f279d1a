"""ac-core's adapter conformance suite: nine checks every adapter must pass, runnable on anyone's adapter.

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
``policies``), on CPU and, where present, CUDA:

1. coverage: exactly the declared blocks are checkpointed; a container of blocks that is neither
   declared nor declared excluded fails by name;
2. gradients: loss and every gradient equal the plain model's (float32, :data:`EAGER_TOLERANCE`),
   with dropout active too, and with randomness no dropout module carries (``torch.rand`` masks inside
   every block, so recompute must replay the RNG state);
3. attention: under ``ops`` each retainable backend's kernel runs once per call in forward and never in
   backward, per-block calls match ``attention_calls``, retained outputs stay on the compute device;
   a backend declared not retainable warns once and trains correctly;
4. memory: bytes held for backward satisfy full < ops < none (printed);
5. names: parameter/state_dict/module names unchanged; save_pretrained/from_pretrained round trip;
6. torch.compile gives the eager loss and gradients (``aot_eager`` by default);
7. FSDP2 on two gloo ranks equals one plain process; no collective is retained;
8. the library's own gradient checkpointing is turned off with a warning, and training is right; switched on
   after ac-core (``Trainer(gradient_checkpointing=True)``), it is found at the next forward, turned off and
   said once, so no block is checkpointed twice;
9. pickling: ``torch.save(model)`` / ``copy.deepcopy`` of a checkpointed model come back checkpointed on the
   same blocks and train like the plain model.

Skips come only from the adapter's declarations (no tiny factory, no such backend on this device,
no ``set_backend``) and from the model's capabilities (no ``save_pretrained``), never from names.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AdapterConformance": "suite",
    "AdapterTests": "suite",
    "AttentionTests": "suite",
    "CompileTests": "suite",
    "CoverageTests": "suite",
    "FSDPTests": "suite",
    "GradientTests": "suite",
    "LibraryCheckpointingTests": "suite",
    "MemoryTests": "suite",
    "NameTests": "suite",
    "DEVICES": "suite",
    "default_policies": "policies",
    "Subject": "subjects",
    "load_adapter": "subjects",
    "portable_ref": "subjects",
    "subjects_of": "subjects",
    "EAGER_TOLERANCE": "training",
    "INDUCTOR_TOLERANCE": "training",
    "Tolerance": "training",
    "AttentionContext": "checks",
    "check_attention_recomputed": "checks",
    "check_attention_retained": "checks",
    "check_budget": "checks",
    "check_meta_planning": "checks",
    "check_compile": "checks",
    "check_coverage": "checks",
    "check_fsdp": "checks",
    "check_gradients": "checks",
    "check_gradients_with_dropout": "checks",
    "check_gradients_with_random_ops": "checks",
    "check_library_checkpointing": "checks",
    "check_library_checkpointing_after": "checks",
    "check_memory": "checks",
    "check_names": "checks",
    "check_not_retainable_backend": "checks",
    "check_pickle_round_trip": "checks",
    "check_save_pretrained": "checks",
}

__all__ = sorted(_EXPORTS)  # pyright: ignore[reportUnsupportedDunderAll]  # the lazy exports above


def __getattr__(name: str) -> Any:
    # Lazy: the pytest plugin in this package is loaded by every pytest run, and must not import torch.
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ac_core_conformance' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
