"""What ac-core knows about the libraries its models come from: diffusers, transformers, accelerate.

``ac_core.libraries.diffusers`` serves adapters of diffusers models, ``ac_core.libraries.transformers``
adapters of transformers models (and holds the KV-cache rule ac-core applies to every transformers model);
a third-party adapter for another model of those libraries uses them the same way. ``declarations`` reads
what a model says its repeated blocks are, and ``route`` derives an adapter from that for a model of either
library no adapter serves. The core reads the libraries' own gradient-checkpointing switches from
``checkpointing`` and their forward hooks from ``hooks``. Nothing here imports diffusers, transformers or
accelerate: the functions are duck-typed on the models and forwards they are given. Nothing here imports the
core above the adapter contract and the container shapes (the registry, checkpointing, the forward chain):
what a rule needs from there is handed to it.
"""
