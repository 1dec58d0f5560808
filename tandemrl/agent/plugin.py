"""Load a user's callable named in the config: `"module.path:callable"` or `"path/to/file.py:callable"`.

Invariant: whatever goes wrong (no colon, a file that is not there, an import that raises, a name the
module lacks, something not callable) is one `ConfigError` naming the config key, the value and the
cause; the user's traceback is never shown. Used by the reward (`reward.function`) and the plug-in
tools (`tools.<name>.function`).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from tandemrl.config.errors import ConfigError
from tandemrl.host.messages import one_line

FORMS = '"module.path:callable" or "path/to/file.py:callable"'


def load_callable(spec: str, key: str) -> Callable:
    """The callable `spec` names; `key` (e.g. `reward.function`) is named in every error."""
    where = f"{key}={spec!r}"
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{where}: not of the form {FORMS}. Name the module (or file) and the callable.")
    try:
        module = _import(module_name, where)
    except ConfigError:
        raise
    except BaseException as error:  # the user's module raised while importing (SyntaxError included)
        if isinstance(error, KeyboardInterrupt):
            raise
        raise ConfigError(f"{where}: importing {module_name!r} failed: {one_line(error)}.") from None
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(
                f"{where}: {module_name!r} has no attribute {part!r}. Check the name after ':'."
            )
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(
            f"{where}: {attr!r} is not callable (it is of type {type(target).__name__}). Name a function."
        )
    return target


def _import(module_name: str, where: str):
    if module_name.endswith(".py") or "/" in module_name:
        path = Path(module_name).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"{where}: the file {str(path)!r} does not exist (relative paths start at the "
                "current directory). Give the path of a .py file."
            )
        name = f"tandem_plugin_{path.stem}_{abs(hash(str(path.resolve())))}"
        if name in sys.modules:
            return sys.modules[name]
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise ConfigError(f"{where}: {str(path)!r} cannot be loaded as a Python module.")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # dataclasses and pickling look their module up by name
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and module_name.startswith(error.name):  # the module itself, not one it imports
            raise ConfigError(
                f"{where}: no module named {module_name!r} on the Python path. Install it, or give the "
                "path of its file (path/to/file.py:callable)."
            ) from None
        raise
