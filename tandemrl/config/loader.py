"""Load YAML + Hydra-style dotted overrides into the typed `TandemConfig`.

Invariants: the raw mapping is checked key by key against the dataclass fields before any object
is built, so every unknown key or wrong type fails with the full dotted key and a suggestion. Input is
bounded before it is built: a config file of at most MAX_CONFIG_BYTES, an override of at most
MAX_OVERRIDE_CHARS, nesting of at most MAX_DEPTH levels and at most MAX_VALUES values once YAML aliases
are expanded (counted on the parser's events, so an alias bomb or 100,000 levels of brackets is
refused before it is composed). An error shows a bounded summary of a value (`value_summary`), never
the whole (expanded) value.
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from tandemrl.config.errors import value_summary
from tandemrl.config.schema import MOVED_KEYS, ConfigError, TandemConfig

MAX_CONFIG_BYTES = 1 << 20  # a full config is a few KB
MAX_OVERRIDE_CHARS = 1 << 16
MAX_DEPTH = 32  # the deepest key is 4 levels down
MAX_VALUES = 100_000  # scalars and collections, aliases expanded
MAX_INT = 2**63 - 1  # every integer key fits in 64 bits (counts, sizes, seeds)
MAX_STRING_CHARS = 4096  # paths, names and addresses (PATH_MAX is 4096)
_BaseLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser when installed


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> TandemConfig:
    """Read `path` (or only defaults when None), apply `key=value` overrides, build and derive."""
    from tandemrl.config.derive import derive_and_validate

    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_yaml(path)
    for override in overrides:
        _refuse_whole_section(override)
        apply_override(raw, override)
    config = build(TandemConfig, raw, prefix="")
    derive_and_validate(config)
    return config


class _UniqueKeyLoader(_BaseLoader):
    """safe_load that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: explicit keys override it
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                is_seen = key in seen
            except TypeError:  # `? [a, b]`: a list or a mapping as a key
                raise ConfigError(
                    f"the key at line {line} is a {type(key).__name__}; keys are names."
                ) from None
            if is_seen:
                raise ConfigError(
                    f"key {value_summary(key)} appears twice in one section (line {line}); "
                    "YAML would silently keep the last value. Delete one of them."
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _SourceInt(int):
    """A YAML integer that keeps the text it was read from: a key that takes a string gets that text, not the
    number's (`runner.name: 0123` is YAML 1.1's octal 83, `1:30` its base-60 90)."""

    source: str


class _SourceFloat(float):
    source: str  # `1.10` is 1.1


def _keep_source(number_type: type, construct: Any) -> Any:
    def constructor(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
        number = number_type(construct(loader, node))
        number.source = node.value
        return number

    return constructor


_UniqueKeyLoader.add_constructor(
    "tag:yaml.org,2002:int", _keep_source(_SourceInt, _BaseLoader.construct_yaml_int)
)
_UniqueKeyLoader.add_constructor(
    "tag:yaml.org,2002:float", _keep_source(_SourceFloat, _BaseLoader.construct_yaml_float)
)


def read_yaml(path: str | Path) -> dict[str, Any]:
    if not str(path).strip():  # Path("") is ".", which would be named as a directory the user never typed
        raise ConfigError(
            f"config file {str(path)!r} is an empty path. Pass the path of a YAML file, "
            "e.g. examples/searchr1/config/embedded_cpu_async.yaml."
        )
    path = Path(path)
    where = f"config file {str(path)!r}"
    _check_config_path(path, where)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"{where} cannot be read: {error.strerror}.") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{where} is larger than {MAX_CONFIG_BYTES // 1024} KiB: a tandem config is a few KB of YAML. "
            "Pass the path of a YAML config file."
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{where} is not UTF-8 text (byte {error.start} is not valid UTF-8): it looks like a binary "
            "file. Pass the path of a YAML file."
        ) from None
    raw = load_bounded_yaml(text, where) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must hold a mapping of sections, not {type(raw).__name__}.")
    return raw


def _check_config_path(path: Path, where: str) -> None:
    try:
        path.stat()
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ConfigError(
                f"{where} is a symbolic link that points back at itself (a link loop). Point at the YAML "
                "file the link should name."
            ) from None
        if error.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise ConfigError(f"{where} cannot be read: {error.strerror}.") from None
        raise ConfigError(
            f"{where} does not exist. Pass the path of a YAML file, "
            "e.g. examples/searchr1/config/embedded_cpu_async.yaml."
        ) from None
    if path.is_dir():
        raise ConfigError(f"{where} is a directory. Pass the path of a YAML file inside it.")
    if not path.is_file():
        raise ConfigError(
            f"{where} is not a regular file (a device or a pipe). Pass the path of a YAML file."
        )


def load_bounded_yaml(text: str, where: str) -> Any:
    """YAML `text` as Python values, refused (ConfigError naming `where`) past the depth and size bounds,
    which are checked on the parser's events before anything is composed."""
    try:
        _check_bounds(text, where)
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as error:
        if "maximum nesting depth" in str(error):  # libyaml's own limit, met while it scans ahead
            raise ConfigError(_too_deep(where, getattr(error, "problem_mark", None))) from None
        raise ConfigError(f"{where} is not valid YAML: {error}") from None
    except ConfigError as error:
        message = str(error)
        raise ConfigError(message if message.startswith(where) else f"{where}: {message}") from None
    except (ValueError, RecursionError) as error:  # an integer of more than 4300 digits, for one
        raise ConfigError(
            f"{where} holds a value YAML cannot convert ({value_summary(str(error))})."
        ) from None


def _too_deep(where: str, mark) -> str:
    line = f" (line {mark.line + 1})" if mark is not None else ""
    return f"{where} nests deeper than {MAX_DEPTH} levels{line}; a tandem config is a few levels of sections. Flatten it."


def _check_bounds(text: str, where: str) -> None:
    """Depth and number of values after alias expansion, counted on events (no recursion, no copies)."""
    sizes: dict[str, int] = {}  # anchor -> values in its node, its own aliases expanded
    open_nodes: list[list] = []  # [anchor, values so far] of each collection being parsed
    depth = num_values = 0
    for event in yaml.parse(text, Loader=_BaseLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise ConfigError(_too_deep(where, event.start_mark))
            open_nodes.append([event.anchor, 1])
            continue
        if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            anchor, count = open_nodes.pop()
            depth -= 1
            if anchor is not None:
                sizes[anchor] = count
            added = count
        elif isinstance(event, yaml.ScalarEvent):
            added = 1
            if not event.style and len(event.value) > 64 and event.value.lstrip("+-").isdigit():
                raise ConfigError(  # Python refuses to convert more than 4300 digits; none is a real value
                    f"{where}: line {event.start_mark.line + 1} holds an integer of {len(event.value)} digits; "
                    "every integer of a tandem config fits in 64 bits."
                )
            if event.anchor is not None:
                sizes[event.anchor] = 1
        elif isinstance(event, yaml.AliasEvent):
            added = sizes.get(event.anchor, 1)
            num_values += added - 1  # the alias's copy of the node (its own 1 is counted below)
        else:
            continue
        if open_nodes:
            open_nodes[-1][1] += added
        num_values += 1
        if num_values > MAX_VALUES:
            raise ConfigError(
                f"{where} expands to more than {MAX_VALUES} values (line {event.start_mark.line + 1}); with "
                "YAML aliases (*name) repeating anchors (&name) this can grow exponentially. A tandem "
                "config has a few hundred; remove the aliases or the long lists."
            )


def _refuse_whole_section(override: str) -> None:
    """`runner=` or `runner={name: x}` would replace the file's whole section (its other keys back to their
    defaults, silently): a section is overridden key by key. Sections of named entries (`tools.<name>`)
    and mapping-valued keys (`cluster.component_placement`) are values, not sections, and pass."""
    key = override.split("=", 1)[0].strip().lstrip("+")
    cls: Any = TandemConfig
    for part in key.split("."):
        if not (
            dataclasses.is_dataclass(cls) and part in {f.name for f in dataclasses.fields(cls) if f.init}
        ):
            return  # not a schema key: build() names it
        cls = typing.get_type_hints(cls)[part]
    if dataclasses.is_dataclass(cls):
        example = next(f.name for f in dataclasses.fields(cls) if f.init)
        raise ConfigError(
            f"override {value_summary(override)}: {key} is a section, and this would reset every key of it "
            f"that the override does not name to its default. Override its keys one by one, e.g. "
            f"{key}.{example}=..."
        )


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Apply one `a.b.c=value` override; the value is parsed as YAML (`null`, numbers, lists...)."""
    shown = value_summary(override)
    if len(override) > MAX_OVERRIDE_CHARS:
        raise ConfigError(
            f"override {shown} has {len(override)} characters; at most {MAX_OVERRIDE_CHARS}. Put long "
            "values in the YAML file."
        )
    if "=" not in override:
        raise ConfigError(f"override {shown} is not of the form key=value, e.g. data.rollout_batch_size=64.")
    try:
        override.encode("utf-8")
    except UnicodeEncodeError as error:  # command-line bytes that are not UTF-8 (surrogate escapes)
        raise ConfigError(
            f"override {shown} is not valid UTF-8 text ({error.reason} at character {error.start}). Type "
            "it again in UTF-8."
        ) from None
    key, text = override.split("=", 1)
    key = key.strip().lstrip("+")
    if not key:
        raise ConfigError(f"override {shown} has an empty key.")
    parts = key.split(".")
    if len(parts) > MAX_DEPTH:
        raise ConfigError(f"override {shown}: the key has {len(parts)} parts; a tandem key has at most 4.")
    try:
        value = load_bounded_yaml(text, f"override {value_summary(key)}") if text.strip() else None
    except ConfigError as error:
        if "is not valid YAML" not in str(error):
            raise
        value = text
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {shown}: {part!r} is a value, not a section.")
        node = child
    node[parts[-1]] = value


def build(cls: type, raw: Any, prefix: str) -> Any:
    """Build dataclass `cls` from mapping `raw`, checking keys and types; `prefix` is the dotted path."""
    section = prefix.rstrip(".") or "the top level"
    if not isinstance(raw, dict):
        raise ConfigError(f"{section}: expected a mapping of keys, got {value_summary(raw)}.")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    extra_field = getattr(cls, "EXTRA_KEYS_FIELD", None)  # a section of named entries (tools.<name>)
    if extra_field is not None:
        raw = _file_extra_keys(raw, names, extra_field, prefix)
    for key in raw:
        if not isinstance(key, str):
            raise ConfigError(f"{section}: key {value_summary(key)} is not a name; keys are words.")
        moved = MOVED_KEYS.get(f"{prefix}{key}")
        if moved:
            raise ConfigError(f"{prefix}{key} is now {moved} (the engine's own name for it). Rename the key.")
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" Did you mean {prefix}{close[0]}?" if close else f" Known keys: {', '.join(names)}."
            raise ConfigError(
                f"unknown key {prefix}{value_summary(key, bare=True)}: {section} has no such setting.{hint}"
            )
    kwargs = {  # named entries keep their own key in errors: tools.calculator, not tools.custom.calculator
        key: _convert(hints[key], value, prefix.rstrip(".") if key == extra_field else f"{prefix}{key}")
        for key, value in raw.items()
    }
    return cls(**kwargs)


def _file_extra_keys(raw: dict, names: list[str], extra_field: str, prefix: str) -> dict:
    """`tools.calculator: {...}` -> `tools.custom.calculator`: keys that are no field are named entries."""
    if extra_field in raw:
        raise ConfigError(
            f"{prefix}{extra_field} is not a key: write each entry directly under {prefix.rstrip('.')}, "
            f"e.g. {prefix}calculator.function=... ."
        )
    extra = {key: value for key, value in raw.items() if key not in names}
    for key, value in extra.items():
        close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.8)
        if close and not (isinstance(value, dict) and "function" in value):  # a typo, not an entry
            raise ConfigError(
                f"unknown key {prefix}{value_summary(key, bare=True)}: did you mean {prefix}{close[0]}? (A "
                f"plug-in entry of this name needs {prefix}{value_summary(key, bare=True)}.function.)"
            )
    if not extra:
        return raw
    return {**{key: value for key, value in raw.items() if key in names}, extra_field: extra}


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
        return {
            str(k): _convert(args[1], v, f"{key}.{value_summary(k, bare=True)}") for k, v in value.items()
        }
    return _convert_scalar(hint, value, key)


def _convert_scalar(hint: Any, value: Any, key: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        _type_error(key, value, "true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) <= MAX_INT:
            return int(value)  # a plain int, not the YAML reader's _SourceInt
        _type_error(
            key, value, "an integer" if not isinstance(value, int) else f"an integer of at most {MAX_INT}"
        )
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
            return _check_text(key, getattr(value, "source", None) or str(value))  # the text as typed
        _type_error(key, value, "a string")
    return value


def _check_text(key: str, text: str) -> str:
    if len(text) > MAX_STRING_CHARS:
        raise ConfigError(
            f"{key}={value_summary(text)}: {len(text)} characters, at most {MAX_STRING_CHARS} (paths, names and "
            f"addresses are short). Fix the value of {key}."
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:  # bytes of a command-line override that are not UTF-8
        raise ConfigError(
            f"{key}: the value is not valid UTF-8 text ({error.reason} at character {error.start}). Fix the "
            f"value of {key} in the YAML file or the override."
        ) from None
    nul_at = text.find("\0")  # YAML's "\0": no path, name or argument holds one (mkdir raised ValueError)
    if nul_at >= 0:
        raise ConfigError(
            f"{key}={value_summary(text)}: holds a NUL character (at character {nul_at}), which no path, name or "
            f"command-line argument can contain. Fix the value of {key}."
        )
    return text


def _type_error(key: str, value: Any, expected: str) -> typing.NoReturn:
    raise ConfigError(
        f"{key}={value_summary(value)}: wrong type, expected {expected} (got {type(value).__name__}). "
        f"Fix the value of {key} in the YAML file or the override."
    )


def flatten_keys(tree: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dicts (`to_dict`'s) as one dict of dotted keys, the form overrides take (`actor.optim.lr`)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def to_dict(config: TandemConfig) -> dict[str, Any]:
    """The user-facing keys as nested dicts (internal fields such as `derived` left out)."""
    if dataclasses.is_dataclass(config):
        out = {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config) if f.init}
        extra_field = getattr(config, "EXTRA_KEYS_FIELD", None)
        if extra_field:
            out.update(out.pop(extra_field))
        return out
    if isinstance(config, list):
        return [to_dict(item) for item in config]
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    return config
