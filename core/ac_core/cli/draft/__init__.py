"""What an adapter must declare for a model class no adapter serves, found by building it tiny and running it.

``ac-core inspect module:Class`` prints a :class:`Findings`; ``--draft`` also prints :func:`draft_source`,
an ``AdapterSpec`` as Python source. Nothing here prints: the command does (``inspect.py``).

The class is built from a tiny config derived from its defaults (``ac_core.libraries.configs``), or by the
function ``factory_ref`` names where its constructor takes a config object; inputs are found by probing
``forward``'s signature (``ac_core.libraries.inputs``) unless ``inputs_ref`` names a function of the model
returning them; its block containers are found without an adapter (``containers``); ``findings`` runs it,
``tokens`` finds its patch embedding and the tokens its blocks see, and ``source`` writes the draft.
"""

from __future__ import annotations

from ...libraries.inputs import TensorInput
from .containers import find_containers
from .findings import Findings, draft_spec, inspect_class
from .options import DraftError, load_class, load_config
from .source import draft_source
from .tokens import TokenDerivation, token_line

__all__ = [
    "DraftError",
    "Findings",
    "TensorInput",
    "TokenDerivation",
    "draft_source",
    "draft_spec",
    "find_containers",
    "inspect_class",
    "load_class",
    "load_config",
    "token_line",
]
