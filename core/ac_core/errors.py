"""Exceptions raised for bad input. Each is a ValueError so callers can catch the usual type."""

from __future__ import annotations


class AdapterError(ValueError):
    """An adapter spec is malformed, missing, ambiguous or does not match the model it is applied to."""


class ConflictingCheckpointError(ValueError):
    """The model is already checkpointed by a mechanism ac-core cannot safely take over."""


class UnsupportedVersionError(ValueError):
    """The installed library version lays the model out differently from what the adapter declares."""
