"""Where `tandem index build` may put an index: the checks on `--index` made before the encoder loads.

Invariant: a build replaces `--index` whole (retrieval/build.py: it is built in `.<name>.building` beside
it and moved in), so `--index` must be a folder of its own that can be renamed, under a folder the
staging directory can be made in, holding nothing but what a build writes there (`index.json`,
`qdrant/`); the staging directory likewise, since a build discards it. Anything else is refused in one
line naming `--index`, never replaced.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tandemrl.host.files import creatable_problem, foreign_entries
from tandemrl.retrieval.retriever import META_FILE
from tandemrl.retrieval.store import LOCAL_DIR

INDEX_ENTRIES = frozenset({META_FILE, LOCAL_DIR})  # all that a build writes in an index directory


def staging_dir(index_dir: Path) -> Path:
    """Where the index of `index_dir` is built before it is moved in."""
    return index_dir.parent / f".{index_dir.name}.building"


def check_index_place(index_dir: Path) -> None:
    """`--index` names a directory (or nothing yet) that can be renamed, beside which the staging directory
    can be made: not the current directory or one holding it, and under a directory, not a file."""
    if index_dir.name in ("", ".", ".."):
        raise ValueError(
            f"--index {str(index_dir)!r} names no folder of its own; the build writes beside the folder and "
            "then moves it in. Name a new or empty folder, e.g. --index indexes/wiki."
        )
    try:
        resolved, cwd = index_dir.resolve(), Path.cwd().resolve()
    except (OSError, RuntimeError) as error:  # a symlink loop, a removed current directory
        raise ValueError(
            f"--index {index_dir} cannot be resolved ({error}); choose another folder."
        ) from None
    if resolved == cwd or resolved in cwd.parents:
        raise ValueError(
            f"--index {index_dir} is the current directory or holds it, which a build cannot replace. Name a "
            "new or empty folder inside it, e.g. --index indexes/wiki."
        )
    info = _stat(index_dir, index_dir)
    if info is not None and not stat.S_ISDIR(info.st_mode):
        raise ValueError(
            f"--index {index_dir} is a file; an index is a directory. Choose a new or empty folder."
        )
    problem = creatable_problem(index_dir.parent)  # where the staging folder is made
    if problem:
        raise ValueError(f"--index {index_dir}: {problem}. Choose --index inside a folder you can write to.")


def _stat(path: Path, index_dir: Path) -> os.stat_result | None:
    """`path`'s status, None when nothing is there; a name the system refuses is named by `--index`."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as error:  # ValueError: a NUL byte in the name
        reason = error.strerror if isinstance(error, OSError) else str(error)
        raise ValueError(
            f"--index {index_dir}: {path} cannot be used ({reason}). Choose another folder."
        ) from None


def is_within(path: Path, directory: Path) -> bool:
    try:
        resolved, folder = path.resolve(), directory.resolve()
    except (OSError, RuntimeError):
        return False
    return folder in resolved.parents


def refuse_foreign_entries(directory: Path, what: str = "--index") -> None:
    """Refuse a directory that holds anything a build does not write there: replacing it would lose it.
    `what` names it in the message (`--index`, or the staging folder)."""
    info = _stat(directory, directory)
    if info is None:
        return
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(
            f"{what} {directory} is a file where the build puts a folder. Move it away, or choose another "
            "--index."
        )
    foreign = foreign_entries(directory, INDEX_ENTRIES.__contains__)
    if foreign:
        raise ValueError(
            f"{what} {directory} holds files a build does not write ({foreign}); a "
            "build replaces that folder whole, so they would be lost. Choose an empty or new folder for "
            "--index, or move them out."
        )
