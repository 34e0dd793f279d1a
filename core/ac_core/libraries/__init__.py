"""What ac-core knows about the libraries its adapters' models come from, shared by every adapter of one library.

``ac_core.libraries.diffusers`` serves adapters of diffusers models, ``ac_core.libraries.transformers``
adapters of transformers models; a third-party adapter for another model of those libraries uses them
the same way. Nothing here imports diffusers or transformers: the functions are duck-typed on the model
they are given. ``import ac_core`` does not import this package.
"""
