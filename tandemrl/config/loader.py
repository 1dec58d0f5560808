"""Load YAML + Hydra-style dotted overrides into the typed `TandemConfig`.

Invariant: the raw mapping is checked key by key against the dataclass fields before any object
is built, so every unknown key or wrong type fails with the full dotted key and a suggestion.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from tandemrl.config.schema import MOVED_KEYS, ConfigError, TandemConfig


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> TandemConfig:
    """Read `path` (or only defaults when None), apply `key=value` overrides, build and derive."""
    from tandemrl.config.derive import derive_and_validate

    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_yaml(path)
    for override in overrides:
        apply_override(raw, override)
    config = build(TandemConfig, raw, prefix="")
    derive_and_validate(config)
    return config


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(
                    f"key {key!r} appears twice in one section (line {key_node.start_mark.line + 1}); YAML would "
                    "silently keep the last value. Delete one of them."
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    where = f"config file {str(path)!r}"
    if not path.exists():
        raise ConfigError(
            f"{where} does not exist. Pass the path of a YAML file, "
            "e.g. examples/searchr1/config/embedded_cpu_async.yaml."
        )
    if path.is_dir():
        raise ConfigError(f"{where} is a directory. Pass the path of a YAML file inside it.")
    if not path.is_file():
        raise ConfigError(
            f"{where} is not a regular file (a device or a pipe). Pass the path of a YAML file."
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{where} is not UTF-8 text (byte {error.start} is not valid UTF-8): it looks like a binary "
            "file. Pass the path of a YAML file."
        ) from None
    except OSError as error:
        raise ConfigError(f"{where} cannot be read: {error.strerror}.") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{where} is not valid YAML: {error}") from None
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must hold a mapping of sections, not {type(raw).__name__}.")
    return raw


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Apply one `a.b.c=value` override; the value is parsed as YAML (`null`, numbers, lists...)."""
    if "=" not in override:
        raise ConfigError(
            f"override {override!r} is not of the form key=value, e.g. data.rollout_batch_size=64."
        )
    key, text = override.split("=", 1)
    key = key.strip().lstrip("+")
    if not key:
        raise ConfigError(f"override {override!r} has an empty key.")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {part!r} is a value, not a section.")
        node = child
    node[parts[-1]] = value


def build(cls: type, raw: Any, prefix: str) -> Any:
    """Build dataclass `cls` from mapping `raw`, checking keys and types; `prefix` is the dotted path."""
    section = prefix.rstrip(".") or "the top level"
    if not isinstance(raw, dict):
        raise ConfigError(f"{section}: expected a mapping of keys, got {raw!r}.")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in raw:
        moved = MOVED_KEYS.get(f"{prefix}{key}")
        if moved:
            raise ConfigError(f"{prefix}{key} is now {moved} (the engine's own name for it). Rename the key.")
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" Did you mean {prefix}{close[0]}?" if close else f" Known keys: {', '.join(names)}."
            raise ConfigError(f"unknown key {prefix}{key}: {section} has no such setting.{hint}")
    kwargs = {key: _convert(hints[key], value, f"{prefix}{key}") for key, value in raw.items()}
    return cls(**kwargs)


def _convert(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return build(hint, value if value is not None else {}, key + ".")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, key)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            value = [value] if isinstance(value, str) else _type_error(key, value, "a list")
        return [_convert(args[0], item, f"{key}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            _type_error(key, value, "a mapping")
        return {str(k): _convert(args[1], v, f"{key}.{k}") for k, v in value.items()}
    return _convert_scalar(hint, value, key)


def _convert_scalar(hint: Any, value: Any, key: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        _type_error(key, value, "true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        _type_error(key, value, "an integer")
    if hint is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and math.isfinite(number):
            return number
        _type_error(key, value, "a finite number")
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        _type_error(key, value, "a string")
    return value


def _type_error(key: str, value: Any, expected: str) -> typing.NoReturn:
    raise ConfigError(
        f"{key}={value!r}: wrong type, expected {expected} (got {type(value).__name__}). "
        f"Fix the value of {key} in the YAML file or the override."
    )


def to_dict(config: Any) -> dict[str, Any]:
    """The user-facing keys as nested dicts (internal fields such as `derived` left out)."""
    if dataclasses.is_dataclass(config):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config) if f.init}
    if isinstance(config, list):
        return [to_dict(item) for item in config]
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    return config
