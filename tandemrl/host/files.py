"""Reading the files a user names (`metrics.jsonl`, question files, a run's `config.yaml`): bounded and
line-numbered, so bad input is one line naming the file, the line and what is wrong, never a traceback,
a hang or memory run out.

Invariant: nothing is opened that is not a regular file (a FIFO would block the open, `/dev/zero` never
ends), nothing larger than the caller's bound is read, no line longer than its bound is held, and every
error is an `InputFileError` whose message names the path (and the line, where there is one).
"""

from __future__ import annotations

import errno
import heapq
import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

MAX_LINE_BYTES = 1 << 20  # a question record or a metrics row is a few KB
MAX_FILE_BYTES = 1 << 30  # a large QA train set (NQ + HotpotQA, ~170k questions) is ~100 MB


class InputFileError(ValueError):
    """A file the user named cannot be used; the message names it, the line where there is one, and why."""


def _size(num_bytes: int) -> str:
    return f"{num_bytes >> 20} MiB" if num_bytes >= 1 << 20 else f"{num_bytes >> 10} KiB"


def open_regular(path: str | Path, what: str, max_bytes: int = MAX_FILE_BYTES) -> BinaryIO:
    """`path` opened for binary reading, refused unless it is a regular file of at most `max_bytes`.
    The open is non-blocking (a FIFO swapped in after the check cannot block it) and the type is checked
    again on the open descriptor."""
    where = f"{what} {str(path)!r}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as error:  # ValueError: a NUL byte in the name
        raise InputFileError(os_error_message(where, error)) from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise InputFileError(f"{where} is a directory, not a file. Pass the file inside it.")
        if not stat.S_ISREG(info.st_mode):
            raise InputFileError(
                f"{where} is not a regular file (a pipe, socket or device): it could block or never end. "
                "Pass a file on disk."
            )
        if info.st_size > max_bytes:
            raise InputFileError(
                f"{where} is {_size(info.st_size)}, more than the {_size(max_bytes)} tandem reads from one "
                "such file. Split it, or check that it is the file you meant."
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def is_missing(path: str | Path) -> bool:
    """True only when nothing is at `path` (a name the system refuses, too long or with a NUL byte, is not
    missing: opening it says what is wrong)."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except (OSError, ValueError):
        return False
    return False


def check_directory(path: str | Path, what: str) -> None:
    """Refuse, naming it, a `path` that is not a directory (missing, a file, a name the system refuses)."""
    where = f"{what} {str(path)!r}"
    try:
        info = os.stat(path)
    except (OSError, ValueError) as error:
        raise InputFileError(os_error_message(where, error)) from None
    if not stat.S_ISDIR(info.st_mode):
        raise InputFileError(f"{where} is not a directory.")


def os_error_message(where: str, error: OSError | ValueError) -> str:
    """One line for what the system said about a path."""
    if not isinstance(error, OSError):
        return f"{where} is not a usable path ({error})."
    if error.errno in (errno.ENOENT, errno.ENOTDIR):
        return f"{where} does not exist."
    if error.errno == errno.ELOOP:
        return f"{where} is a symbolic link that points back at itself (a link loop)."
    if error.errno == errno.EISDIR:
        return f"{where} is a directory, not a file. Pass the file inside it."
    return f"{where} cannot be read: {error.strerror}."


def iter_json_lines(
    path: str | Path,
    what: str,
    max_bytes: int = MAX_FILE_BYTES,
    max_line_bytes: int = MAX_LINE_BYTES,
    skipped: list[str] | None = None,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, JSON object) of each non-blank line, in file order. With `skipped` (a list), a last
    line without its newline that is not valid JSON (a writer caught mid-line) is skipped and described
    there; without it, it is an error like any other bad line."""
    where = f"{what} {str(path)!r}"
    with open_regular(path, what, max_bytes) as stream:
        num_read, line_number = 0, 0
        while True:
            raw = stream.readline(max_line_bytes + 1)
            if not raw:
                return
            line_number += 1
            num_read += len(raw)
            if num_read > max_bytes:  # a file that grows while it is read
                raise InputFileError(f"{where} grew past {_size(max_bytes)} while it was read.")
            if len(raw) > max_line_bytes:
                raise InputFileError(
                    f"{where} line {line_number} is longer than {_size(max_line_bytes)}: one record per line "
                    "is expected, a few KB each. Check that it is a JSON-lines file."
                )
            is_last_partial = not raw.endswith(b"\n") and not stream.peek(1)
            try:
                value = parse_json_line(raw, where, line_number)
            except InputFileError as error:
                if is_last_partial and skipped is not None:
                    skipped.append(
                        f"{where} line {line_number}: incomplete last line skipped (still being written?)"
                    )
                    return
                raise error from None
            if value is not None:
                yield line_number, value


def parse_json_line(raw: bytes, where: str, line_number: int) -> dict[str, Any] | None:
    """One line as a JSON object (None for a blank line)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputFileError(
            f"{where} line {line_number} is not UTF-8 text (byte {error.start}); it looks like a binary file."
        ) from None
    if not text.strip():
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise InputFileError(
            f"{where} line {line_number} is not valid JSON ({error.msg} at column {error.colno}); the file "
            "must hold one JSON object per line."
        ) from None
    except RecursionError:
        raise InputFileError(f"{where} line {line_number} nests too deeply to be a record.") from None
    except ValueError as error:  # e.g. an integer of more than 4300 digits
        raise InputFileError(f"{where} line {line_number} cannot be read as JSON ({error}).") from None
    if not isinstance(value, dict):
        raise InputFileError(
            f"{where} line {line_number} is a JSON {_json_type(value)}, not an object; the file must hold one "
            "JSON object per line."
        )
    return value


def read_json_document(path: str | Path, what: str, max_bytes: int = MAX_FILE_BYTES) -> Any:
    """A whole-file JSON document (e.g. a `.json` array of records), bounded; errors name the line."""
    where = f"{what} {str(path)!r}"
    with open_regular(path, what, max_bytes) as stream:
        data = stream.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InputFileError(f"{where} grew past {_size(max_bytes)} while it was read.")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise InputFileError(f"{where} is not UTF-8 text (byte {error.start}).") from None
    except json.JSONDecodeError as error:
        raise InputFileError(f"{where} line {error.lineno} is not valid JSON ({error.msg}).") from None
    except RecursionError:
        raise InputFileError(f"{where} nests too deeply to be a list of records.") from None
    except ValueError as error:  # e.g. an integer of more than 4300 digits
        raise InputFileError(f"{where} cannot be read as JSON ({error}).") from None


def read_text(path: str | Path, what: str, max_bytes: int) -> str:
    """A small text file (e.g. a run's config.yaml), bounded, as UTF-8."""
    with open_regular(path, what, max_bytes) as stream:
        data = stream.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InputFileError(f"{what} {str(path)!r} grew past {_size(max_bytes)} while it was read.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputFileError(f"{what} {str(path)!r} is not UTF-8 text (byte {error.start}).") from None


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"


MAX_NAMES_SHOWN = 5  # foreign entries named in a refusal; the rest are counted


def foreign_entries(directory: str | Path, is_ours: Callable[[str], bool]) -> str | None:
    """The entries of `directory` that `is_ours` does not accept, as `'a', 'b' and 3 more` (the first
    MAX_NAMES_SHOWN by name), or None when every entry is ours: what a command that replaces a directory
    whole (index build, export) names before it refuses to."""
    names, num_foreign = [], 0
    with os.scandir(directory) as entries:
        for entry in entries:
            if not is_ours(entry.name):
                num_foreign += 1
                names = heapq.nsmallest(MAX_NAMES_SHOWN, [*names, entry.name])
    if not num_foreign:
        return None
    more = f" and {num_foreign - len(names)} more" if num_foreign > len(names) else ""
    return ", ".join(map(repr, names)) + more


def creatable_problem(path: str | Path) -> str | None:
    """Why nothing could be made at or under `path`, or None when it can: the nearest thing that exists
    along `path` and its parents must be a directory this user can write to. What every command that
    creates an output folder (train, sft, index build, export) checks before it starts work."""
    for place in (Path(path), *Path(path).parents):
        try:
            info = os.stat(place)
        except (FileNotFoundError, NotADirectoryError):
            if os.path.islink(place):  # a link to nothing: making the folder there would fail
                return f"{str(place)!r} is a link to {os.readlink(place)!r}, which does not exist"
            continue  # made by the command
        except (OSError, ValueError) as error:  # ValueError: a NUL byte in the name
            reason = error.strerror if isinstance(error, OSError) else str(error)
            return f"{str(place)!r} cannot be used ({reason})"
        if not stat.S_ISDIR(info.st_mode):
            return f"{str(place)!r} is a file, not a directory, so nothing can be made inside it"
        if not os.access(place, os.W_OK | os.X_OK):
            return f"the directory {str(place)!r} is not writable"
        return None
    return None
