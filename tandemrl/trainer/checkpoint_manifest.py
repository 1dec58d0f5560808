"""A checkpoint's manifest: the size and SHA-256 of every file, written at save, checked before use.

`manifest.json` is written last, in the not yet renamed `.tmp-global_step_N/` (trainer/checkpoint.py),
so every byte a checkpoint holds is covered by a hash taken while nothing else could write there.
Before a resume or an export uses the checkpoint, every file is read back, streamed (1 MiB at a time,
never whole in memory), and its hash compared: a damaged byte anywhere, inside a multi-GB tensor
included, is refused with a line that names the file. The cost is one sequential read of the
checkpoint at SHA-256 speed (benchmarks/actor/checkpoint_hash.py).

Invariant: a checkpoint is a tree of regular files and real directories only. `list_files` walks it
without following anything and refuses a symbolic link, FIFO, socket or device wherever it sits, so
nothing outside the checkpoint is ever read (or waited on) through it; every file is opened with
O_NOFOLLOW | O_NONBLOCK and checked to be regular once open. The manifest guards against damage and
stray edits, not against someone who rewrites the manifest too: that is not a signature.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 2  # 1: sizes only (refused: its bytes cannot be checked)
HASH_NAME = "sha256"
MAX_MANIFEST_BYTES = 64 << 20
_CHUNK = 1 << 20
HASH_THREADS = 4


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, corrupted or unsafe; the message names the file and what is wrong."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _refuse_special(path: Path, mode: int) -> CheckpointError:
    target = ""
    if stat.S_ISLNK(mode):
        try:
            target = f" to {os.readlink(path)}"
        except OSError:
            pass
    return CheckpointError(
        f"{path} is {_kind(mode)}{target}: a checkpoint holds only regular files and directories, and "
        "nothing outside it is read. Refused; replace it with the file itself, or use another "
        "global_step_N directory."
    )


def list_files(directory: Path) -> dict[str, int]:
    """Every regular file under `directory` (relative path -> size), the manifest aside; anything that
    is neither a regular file nor a real directory is refused (CheckpointError naming it)."""
    files: dict[str, int] = {}
    pending = [directory]
    while pending:
        folder = pending.pop()
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as error:
            raise CheckpointError(f"{folder} cannot be listed ({error.strerror}).") from None
        for entry in entries:
            path = Path(entry.path)
            mode = entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):
                pending.append(path)
            elif stat.S_ISREG(mode):
                rel = str(path.relative_to(directory))
                if rel != MANIFEST:
                    files[rel] = entry.stat(follow_symlinks=False).st_size
            else:
                raise _refuse_special(path, mode)
    return files


def open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading only if it is a regular file: a link is not followed and a FIFO is
    not waited on (CheckpointError naming it otherwise)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise _refuse_special(path, os.lstat(path).st_mode) from None
        raise CheckpointError(f"{path} cannot be read ({error.strerror}).") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _refuse_special(path, mode)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def file_hash(path: Path) -> str:
    """The SHA-256 of a regular file, read 1 MiB at a time."""
    with open_regular(path) as handle:
        digest = hashlib.new(HASH_NAME)
        buffer = memoryview(bytearray(_CHUNK))
        while size := handle.readinto(buffer):
            digest.update(buffer[:size])
    return digest.hexdigest()


def write_manifest(directory: Path) -> None:
    """Record every file's size and hash (written last, in the not yet renamed checkpoint directory). The
    files are hashed on a few threads (hashlib lets go of the GIL over large buffers): the DCP shards are
    written as several files of similar size (trainer/checkpoint.py, `WRITE_THREADS`)."""
    sizes = sorted(list_files(directory).items())
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        digests = pool.map(file_hash, [directory / rel for rel, _ in sizes])
        files = {
            rel: {"size": size, HASH_NAME: digest} for (rel, size), digest in zip(sizes, digests, strict=True)
        }
    text = json.dumps({"format": MANIFEST_FORMAT, "hash": HASH_NAME, "files": files}, indent=1)
    (directory / MANIFEST).write_text(text + "\n")


def read_manifest(directory: Path) -> dict[str, tuple[int, str | None]] | None:
    """relative path -> (size, hash; None in a format-1 manifest), or None without a manifest."""
    path = directory / MANIFEST
    if not os.path.lexists(path):
        return None
    damaged = CheckpointError(f"{path} is not a checkpoint manifest; the checkpoint is damaged.")
    with open_regular(path) as handle:
        data = handle.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path} is over {MAX_MANIFEST_BYTES >> 20} MiB: not a checkpoint manifest.")
    try:
        manifest = json.loads(data)
        files, version = manifest["files"], manifest["format"]
        if version == 1:
            entries = {rel: (size, None) for rel, size in files.items()}
        else:
            assert version == MANIFEST_FORMAT and manifest["hash"] == HASH_NAME
            entries = {rel: (item["size"], item[HASH_NAME]) for rel, item in files.items()}
        for rel, (size, digest) in entries.items():
            assert isinstance(rel, str) and type(size) is int and size >= 0
            assert digest is None or (isinstance(digest, str) and len(digest) == 64)
    except (ValueError, KeyError, TypeError, AttributeError, AssertionError, RecursionError):
        raise damaged from None
    for rel in entries:
        if Path(rel).is_absolute() or ".." in Path(rel).parts or rel in ("", "."):
            raise CheckpointError(f"{path} names {rel!r}, a file outside the checkpoint; refused.")
    return entries


def check_files(directory: Path, entries: dict[str, tuple[int, str | None]], on_disk: dict[str, int]) -> None:
    """Every file of the manifest there, with its size; no file the manifest does not name."""
    for rel, (size, _) in entries.items():
        path = directory / rel
        if rel not in on_disk:
            raise CheckpointError(
                f"{path} is missing: the checkpoint is incomplete. Resume from another global_step_N directory."
            )
        if on_disk[rel] != size:
            raise CheckpointError(
                f"{path} has {on_disk[rel]} bytes but {size} were written at save: the file was truncated "
                "or replaced. Resume from another global_step_N directory."
            )
    extra = sorted(set(on_disk) - set(entries))
    if extra:
        raise CheckpointError(
            f"{directory / extra[0]} was not written at save (manifest.json does not name it"
            f"{f', nor {len(extra) - 1} more' if len(extra) > 1 else ''}): refused, since it would be read "
            "unchecked. Remove it, or use another global_step_N directory."
        )


def check_hashes(directory: Path, entries: dict[str, tuple[int, str | None]]) -> None:
    """Every file read whole, streamed, and its hash compared with the manifest's."""
    for rel, (_, expected) in sorted(entries.items()):
        if expected is None:
            continue
        if file_hash(directory / rel) != expected:
            raise CheckpointError(
                f"{directory / rel}: its {HASH_NAME} differs from the one recorded at save, so its bytes "
                "changed (disk damage, or an edit). Refused; resume from another global_step_N directory."
            )
