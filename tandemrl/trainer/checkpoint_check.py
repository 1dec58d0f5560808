"""What a checkpoint may contain, and the whole-checkpoint check that runs before one is used.

A checkpoint (`global_step_N/`, trainer/checkpoint.py) holds `actor/.metadata` (DCP's pickled
`Metadata`), `actor/__R_0.distcp` shards (one torch.save archive per tensor or plain value, at the
offsets `.metadata` records), `actor/meta.pt`, `actor/rng_rank{r}.pt` and `data/data.pt` (torch.save
archives of tensors and plain Python values), `actor/hf/` (JSON and tokenizer text) and
`manifest.json` (the size of every other file, written last, before the checkpoint is renamed into
place).

Invariants: nothing of a checkpoint is unpickled except through `RestrictedUnpickler`, which admits
only the globals a checkpoint's own format uses (DCP's metadata classes, torch.Size, dtypes, the tensor
rebuild functions and storage types, OrderedDict) and refuses any other global, naming it, before it is
looked up. `verify_checkpoint` needs no torch (it runs in `tandem config show`): every file of the
manifest present, readable and of the size recorded at save; every pickle parsed with inert stand-ins
for the admitted globals (so nothing is constructed or run); every shard extent `.metadata` names
inside its shard and every item there a torch.save archive; every torch.save file's CRCs intact.
Checkpoints written before the manifest existed get every check but the sizes.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
DATA_FILE = "data/data.pt"  # the runner's part (runner/checkpoint.py)
_DCP = "torch.distributed.checkpoint"
_DTYPES = (
    "float32 float64 float16 bfloat16 complex64 complex128 uint8 int8 int16 int32 int64 bool "
    "float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz uint16 uint32 uint64"
).split()
_STORAGES = "Float Double Half BFloat16 Byte Char Short Int Long Bool ComplexFloat ComplexDouble".split()
# DCP's .metadata: its own classes and what their fields hold
METADATA_GLOBALS = frozenset(
    {
        (f"{_DCP}.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }  # fmt: skip
    | {(f"{_DCP}.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout")}
    | {("pathlib", "PosixPath"), ("pathlib._local", "PosixPath"), ("collections", "OrderedDict")}
    | {("torch", dtype) for dtype in _DTYPES}
)
# torch.save archives of tensors and plain values (a subset of what torch's weights_only admits)
TORCH_SAVE_GLOBALS = frozenset(
    {("torch._utils", f) for f in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_parameter")}
    | {("torch", f"{kind}Storage") for kind in _STORAGES}
    | {("torch.storage", "UntypedStorage"), ("torch", "Size"), ("torch", "device")}
    | {("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("_codecs", "encode")}
    | {("builtins", name) for name in ("set", "frozenset", "bytearray", "complex")}
    | {("torch", dtype) for dtype in _DTYPES}
)


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, corrupted or unsafe; the message names the file and what is wrong."""


class UnsafePickleError(pickle.UnpicklingError):
    def __init__(self, module: str, name: str):
        super().__init__(f"{module}.{name}")
        self.qualname = f"{module}.{name}"


class _Stub:
    """What an admitted global becomes while a checkpoint is checked: the arguments and state it was
    given, recorded, nothing run."""

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def fields(self) -> dict:
        """The state as one dict (dataclasses pickle their __dict__; slotted ones a (dict, slots) pair)."""
        state = self.state
        if isinstance(state, tuple) and len(state) == 2:
            return {**(state[0] or {}), **(state[1] or {})}
        return state if isinstance(state, dict) else {}


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that admits only `allowed` globals. With `resolve` it returns the real objects (an
    admitted dtype name must name a torch dtype); without, inert `_Stub` classes (no import at all).
    Persistent ids (torch.save's storages) are handed to `on_storage`."""

    def __init__(self, file: BinaryIO, allowed: frozenset, resolve: bool = False, on_storage=None):
        super().__init__(file)
        self.allowed, self.resolve, self.on_storage = allowed, resolve, on_storage
        self._stubs: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str):
        if (module, name) not in self.allowed:
            raise UnsafePickleError(module, name)
        if not self.resolve:
            return self._stubs.setdefault(
                (module, name), type(name, (_Stub,), {"qualname": f"{module}.{name}"})
            )
        obj = getattr(importlib.import_module(module), name)
        if module == "torch" and name in _DTYPES:
            import torch

            if not isinstance(obj, torch.dtype):
                raise UnsafePickleError(module, name)
        return obj

    def persistent_load(self, pid):
        if self.on_storage is None:
            raise pickle.UnpicklingError("a persistent id outside a torch.save archive")
        return self.on_storage(pid)


def load_dcp_metadata(file: BinaryIO, where: str):
    """DCP's `Metadata` from an open `.metadata` file, through the restricted unpickler (real classes)."""
    try:
        return RestrictedUnpickler(file, METADATA_GLOBALS, resolve=True).load()
    except UnsafePickleError as error:
        raise CheckpointError(_unsafe_message(where, error.qualname)) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError) as error:
        raise CheckpointError(f"{where} is not DCP metadata ({type(error).__name__}: {error}).") from None


def _unsafe_message(where: str, qualname: str) -> str:
    return (
        f"{where} would call {qualname} when unpickled: a checkpoint holds only tensors, plain values and "
        "DCP's own metadata classes, so this file was not written by tandemrl (or was altered). Refused; "
        "nothing was loaded. Use a checkpoint written by `tandem train`."
    )


# ---- the whole-checkpoint check (no torch) ------------------------------------------------------------


def write_manifest(directory: Path) -> None:
    """Record every file's size (written last, in the not yet renamed checkpoint directory)."""
    files = {
        str(path.relative_to(directory)): path.stat().st_size
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }
    (directory / MANIFEST).write_text(
        json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1) + "\n"
    )


def verify_checkpoint(directory: str | Path, need_data: bool = True) -> None:
    """Raise CheckpointError unless `directory` is a whole, safe checkpoint (see the module doc)."""
    directory = Path(directory)
    name = str(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{name} is not a directory (a checkpoint is a global_step_N directory).")
    required = ["actor/.metadata", "actor/meta.pt", "actor/hf/config.json"] + (
        [DATA_FILE] if need_data else []
    )
    sizes = _manifest_sizes(directory)
    for rel in [*required, *(sizes or {})]:
        path = directory / rel
        if not path.is_file():
            raise CheckpointError(
                f"{path} is missing: the checkpoint is incomplete. Resume from another global_step_N directory."
            )
        try:
            os.close(os.open(path, os.O_RDONLY))
        except OSError as error:
            raise CheckpointError(f"{path} cannot be read ({error.strerror}).") from None
        if sizes is not None and rel in sizes and path.stat().st_size != sizes[rel]:
            raise CheckpointError(
                f"{path} has {path.stat().st_size} bytes but {sizes[rel]} were written at save: the file was "
                "truncated or replaced. Resume from another global_step_N directory."
            )
    _check_metadata_and_shards(directory / "actor")
    for path in sorted((directory / "actor").glob("*.pt")) + ([directory / DATA_FILE] if need_data else []):
        with open(path, "rb") as handle:
            check_torch_archive(handle, str(path), check_crc=True)
    _check_json(directory / "actor" / "hf" / "config.json")


def _manifest_sizes(directory: Path) -> dict[str, int] | None:
    path = directory / MANIFEST
    if not path.exists():
        return None  # written before checkpoints recorded sizes: every check but the sizes
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
        assert manifest["format"] == MANIFEST_FORMAT and isinstance(files, dict)
        assert all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in files.items())
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        raise CheckpointError(f"{path} is not a checkpoint manifest; the checkpoint is damaged.") from None
    for rel in files:
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise CheckpointError(f"{path} names {rel!r}, a file outside the checkpoint; refused.")
    return files


def _check_json(path: Path) -> None:
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path} is not valid JSON ({error}).") from None


def _check_metadata_and_shards(actor_dir: Path) -> None:
    where = str(actor_dir / ".metadata")
    with open(actor_dir / ".metadata", "rb") as handle:
        metadata = _stub_load(handle, METADATA_GLOBALS, where)
    fields = metadata.fields() if isinstance(metadata, _Stub) else {}
    if getattr(metadata, "qualname", None) != f"{_DCP}.metadata.Metadata" or not isinstance(
        fields.get("storage_data"), dict
    ):
        raise CheckpointError(f"{where} is not DCP metadata (no storage table).")
    for index, info in fields["storage_data"].items():
        fqn = index.fields().get("fqn") if isinstance(index, _Stub) else None
        entry = info.fields() if isinstance(info, _Stub) else {}
        rel, offset, length = entry.get("relative_path"), entry.get("offset"), entry.get("length")
        if not isinstance(rel, str) or type(offset) is not int or type(length) is not int:
            raise CheckpointError(f"{where}: the entry of {fqn!r} has no file, offset and length.")
        if Path(rel).name != rel or rel in ("", ".", ".."):
            raise CheckpointError(
                f"{where}: the entry of {fqn!r} names {rel!r}, a file outside actor/; refused."
            )
        shard = actor_dir / rel
        size = shard.stat().st_size if shard.is_file() else None
        if size is None or offset < 0 or length <= 0 or offset + length > size:
            found = "missing" if size is None else f"{size} bytes"
            raise CheckpointError(
                f"{shard}: {fqn!r} is recorded at bytes {offset}..{offset + length} but the shard is {found}: "
                "truncated or incomplete. Resume from another global_step_N directory."
            )
        with open(shard, "rb") as handle:
            check_torch_archive(
                _Slice(handle, offset, length), f"{shard} ({fqn})", check_crc=length < 1 << 20
            )


def check_torch_archive(file: BinaryIO, where: str, check_crc: bool) -> None:
    """A torch.save zip archive whose data.pkl unpickles with TORCH_SAVE_GLOBALS only; with `check_crc`
    every member is read and its CRC compared."""
    try:
        archive = zipfile.ZipFile(file)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        head = _head(file)
        if head[:1] == b"\x80":  # a bare pickle: say what it would run, if it would run anything
            _stub_load(io.BytesIO(head + file.read()), TORCH_SAVE_GLOBALS, where)
        raise CheckpointError(
            f"{where} is not a torch.save archive (truncated, or not written by tandemrl). Resume from another "
            "global_step_N directory."
        ) from None
    with archive:
        names = archive.namelist()
        pickles = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pickles) != 1:
            raise CheckpointError(f"{where} is not a torch.save archive (no data.pkl).")
        prefix = pickles[0][: -len("data.pkl")]
        try:
            if check_crc and archive.testzip() is not None:
                raise zipfile.BadZipFile("CRC mismatch")
            data = archive.read(pickles[0])
        except (zipfile.BadZipFile, OSError, EOFError, RuntimeError, ValueError) as error:
            raise CheckpointError(f"{where} is damaged ({error}).") from None

        def on_storage(pid):
            if not (
                isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[2], str)
            ):
                raise CheckpointError(f"{where}: data.pkl names storage {pid!r}, not a torch.save storage.")
            if f"{prefix}data/{pid[2]}" not in names:
                raise CheckpointError(f"{where}: storage {pid[2]!r} is missing from the archive.")
            return None

        _stub_load(io.BytesIO(data), TORCH_SAVE_GLOBALS, where, on_storage)


def _stub_load(file: BinaryIO, allowed: frozenset, where: str, on_storage=None) -> Any:
    try:
        return RestrictedUnpickler(file, allowed, resolve=False, on_storage=on_storage).load()
    except UnsafePickleError as error:
        raise CheckpointError(_unsafe_message(where, error.qualname)) from None
    except CheckpointError:
        raise
    except Exception as error:  # a damaged pickle fails in many ways; none of them is ours to raise
        raise CheckpointError(
            f"{where} cannot be unpickled ({type(error).__name__}): it is damaged."
        ) from None


def _head(file: BinaryIO) -> bytes:
    try:
        file.seek(0)
        return file.read(1 << 16)
    except (OSError, ValueError):
        return b""


class _Slice(io.RawIOBase):
    """A read-only, seekable view of bytes [offset, offset + length) of an open file (one shard item)."""

    def __init__(self, file: BinaryIO, offset: int, length: int):
        self.file, self.offset, self.length, self.position = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = max(0, min(self.length, base + position))
        return self.position

    def readinto(self, buffer) -> int:
        size = min(len(buffer), self.length - self.position)
        if size <= 0:
            return 0
        self.file.seek(self.offset + self.position)
        data = self.file.read(size)
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)
