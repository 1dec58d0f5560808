"""The homes a test run must leave alone, and what changed in a directory tree (tests/conftest.py's guard).

A snapshot maps each entry's path (relative to the root) to its kind, size and modification time, so a
file created, removed or rewritten between two snapshots shows up; an absent root has an empty snapshot.
"""

from __future__ import annotations

import os
from pathlib import Path


def guarded_homes(outer_tandem_home: str | None) -> list[Path]:
    """`~/.cache/tandemrl` (the default home) and the `$TANDEM_HOME` pytest was started with."""
    homes = [Path.home() / ".cache" / "tandemrl"]
    if outer_tandem_home:
        outer = Path(outer_tandem_home).expanduser()
        if outer.resolve() != homes[0].resolve():
            homes.append(outer)
    return homes


def snapshot(root: Path) -> dict[str, tuple]:
    """{relative path: (kind, size, mtime_ns)} of `root` (as ".") and everything under it (not following
    links); {} when `root` does not exist."""
    entries: dict[str, tuple] = {}
    if not root.is_dir():
        return {".": ("file", root.stat().st_size, root.stat().st_mtime_ns)} if root.exists() else entries
    entries["."] = ("dir", 0, root.stat().st_mtime_ns)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            try:
                st = path.lstat()
            except FileNotFoundError:  # removed while we walked: the next snapshot shows it gone
                continue
            kind = "dir" if path.is_dir() and not path.is_symlink() else "file"
            entries[str(path.relative_to(root))] = (kind, 0 if kind == "dir" else st.st_size, st.st_mtime_ns)
    return entries


def contents(entries: dict[str, tuple]) -> list[str]:
    """The paths of a snapshot below its root."""
    return sorted(path for path in entries if path != ".")


def tree_changes(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    """One line per entry created, removed or modified between two snapshots, sorted by path."""
    lines = []
    for path in sorted(set(before) | set(after)):
        if path not in before:
            lines.append(f"created  {path}")
        elif path not in after:
            lines.append(f"removed  {path}")
        elif before[path] != after[path]:
            lines.append(f"modified {path}")
    return lines
