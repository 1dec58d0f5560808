"""`ConfigError`, in a module of its own so that component configs outside `config/` (the engine's)
raise it without importing the schema."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user error in the configuration; the message names the key, the value, why and how to fix it."""
