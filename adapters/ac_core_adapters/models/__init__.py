"""What the adapters' specs name by ``"module:attr"``: per family, the tiny models (``tiny_<model>``), the
real-width presets (``preset_<model>``) and ``token_count``.

Importing these modules imports nothing of diffusers or transformers: each factory imports its library
when called.
"""
