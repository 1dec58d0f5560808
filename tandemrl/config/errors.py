"""`ConfigError`, in a module of its own so that component configs outside `config/` (the engine's)
raise it without importing the schema, and `value_summary`, the bounded form in which every config
error shows a value."""

from __future__ import annotations

import math
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


def check(ok: bool, key: str, value: object, why: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value_summary(value)}: {why}. {fix}")


def check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    check(value in choices, key, value, f"must be one of {', '.join(choices)}", f"Set {key} to one of them.")


def check_positive(key: str, value: int | float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    check(value is not None and value > 0, key, value, "must be > 0", f"Set {key} to a positive number.")


def check_finite_positive(key: str, value: float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    check(
        value is not None and math.isfinite(value) and value > 0,
        key,
        value,
        "must be a finite number > 0",
        f"Set {key} to a positive number of seconds.",
    )


def one_line(error: BaseException) -> str:
    """An exception as one line of at most ~300 characters, its type first (for one-line CLI errors)."""
    text = " ".join(str(error).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
