"""`ConfigError`, in a module of its own so that component configs outside `config/` (the engine's)
raise it without importing the schema, and `value_summary`, the bounded form in which every config
error shows a value."""

from __future__ import annotations

import reprlib


class ConfigError(ValueError):
    """A user error in the configuration; the message names the key, the value, why and how to fix it."""


_SUMMARY = reprlib.Repr()
_SUMMARY.maxlevel, _SUMMARY.maxstring, _SUMMARY.maxlong, _SUMMARY.maxother = 2, 60, 40, 60
_SUMMARY.maxdict = _SUMMARY.maxlist = _SUMMARY.maxtuple = _SUMMARY.maxset = _SUMMARY.maxfrozenset = 4


def value_summary(value: object, bare: bool = False) -> str:
    """A bounded repr for error messages: at most a few items per level and ~60 characters per string,
    never the whole value (a YAML alias bomb expands to billions of items when printed whole)."""
    if bare and isinstance(value, str):
        return value if len(value) <= 60 else f"{value[:50]}... ({len(value)} characters)"
    text = _SUMMARY.repr(value)
    if isinstance(value, (list, tuple, dict, set)) and len(value) > 4:
        text += f" ({len(value)} items)"
    return text
