"""What a checkpoint may contain, and the whole-checkpoint check that runs before one is used.

A checkpoint (`global_step_N/`, trainer/checkpoint.py) holds `actor/.metadata` (DCP's pickled
`Metadata`), `actor/__R_0.distcp` shards (one torch.save archive per tensor or plain value, at the
offsets `.metadata` records), `actor/meta.pt`, `actor/rng_rank{r}.pt` and `data/data.pt` (torch.save
archives of tensors and plain Python values), `actor/hf/` (JSON and tokenizer text) and
`manifest.json` (the size and SHA-256 of every other file, written last, before the checkpoint is
renamed into place; trainer/checkpoint_manifest.py).

Invariants: nothing of a checkpoint is unpickled except through `RestrictedUnpickler`, which admits
only the globals a checkpoint's own format uses (DCP's metadata classes, torch.Size, dtypes, the tensor
rebuild functions and storage types, OrderedDict) and refuses any other global, naming it, before it is
looked up. `verify_checkpoint` needs no torch (it runs in `tandem config show`): a tree of regular files
only (a link, FIFO or device anywhere is refused); every file of the manifest present, of the size
recorded at save, and no other file; every byte hashed, streamed, and compared with the manifest's
SHA-256 before anything is parsed; every pickle parsed with inert stand-ins for the admitted globals (so
nothing is constructed or run); every shard extent `.metadata` names inside its shard, every item there
a torch.save archive holding a tensor of the shape and dtype `.metadata` records; every torch.save
file's CRCs intact, no archive member compressed (torch.save stores them, so a file never expands past
its own size) and no data.pkl over MAX_PICKLE_BYTES. A checkpoint without a hashed manifest (written
before hashes, or its manifest removed) gets every other check, then is refused: its bytes cannot be
checked.
"""

from __future__ import annotations

import importlib
import io
import json
import pickle
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

from tandemrl.trainer.checkpoint_manifest import (
    MANIFEST,
    CheckpointError,
    check_files,
    check_hashes,
    list_files,
    open_regular,
    read_manifest,
    write_manifest,
)

__all__ = ["CheckpointError", "verify_checkpoint", "write_manifest", "load_dcp_metadata", "MANIFEST"]

# bounds on what a checkpoint's pickles and JSON may expand to when read (torch.save stores its
# members uncompressed, so an archive never holds more than its own size)
MAX_PICKLE_BYTES = 256 << 20
MAX_JSON_BYTES = 16 << 20
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


def verify_checkpoint(directory: str | Path, need_data: bool = True) -> None:
    """Raise CheckpointError unless `directory` is a whole, safe checkpoint (see the module doc)."""
    directory = Path(directory)
    name = str(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{name} is not a directory (a checkpoint is a global_step_N directory).")
    on_disk = list_files(directory)  # regular files only: a link or a FIFO is refused here
    required = ["actor/.metadata", "actor/meta.pt", "actor/hf/config.json"] + (
        [DATA_FILE] if need_data else []
    )
    for rel in required:
        if rel not in on_disk:
            raise CheckpointError(
                f"{directory / rel} is missing: the checkpoint is incomplete. Resume from another "
                "global_step_N directory."
            )
    entries = read_manifest(directory)
    if entries is not None:
        check_files(directory, entries, on_disk)
        check_hashes(directory, entries)  # every byte, before anything is parsed
    _check_metadata_and_shards(directory / "actor")
    for rel in sorted(
        r for r in on_disk if r.startswith("actor/") and r.count("/") == 1 and r.endswith(".pt")
    ):
        with open_regular(directory / rel) as handle:
            check_torch_archive(handle, str(directory / rel), check_crc=True)
    if DATA_FILE in on_disk:  # checked whole whenever it is there, even where only the actor is used
        with open_regular(directory / DATA_FILE) as handle:
            check_torch_archive(handle, str(directory / DATA_FILE), check_crc=True)
    _check_json(directory / "actor" / "hf" / "config.json")
    if entries is None or any(digest is None for _, digest in entries.values()):
        what = "is missing" if entries is None else "records sizes only, no hashes"
        raise CheckpointError(
            f"{directory / MANIFEST} {what}: the checkpoint was written by an older tandemrl or its "
            "manifest was replaced, so its bytes cannot be checked. Refused; resume from a checkpoint "
            "written by this version."
        )


def _check_json(path: Path) -> None:
    with open_regular(path) as handle:
        data = handle.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise CheckpointError(f"{path} is over {MAX_JSON_BYTES >> 20} MiB: not a model config.")
    try:
        json.loads(data)
    except (ValueError, RecursionError) as error:
        raise CheckpointError(f"{path} is not valid JSON ({str(error)[:200]}).") from None


def _check_metadata_and_shards(actor_dir: Path) -> None:
    where = str(actor_dir / ".metadata")
    with open_regular(actor_dir / ".metadata") as handle:
        metadata = _stub_load(handle, METADATA_GLOBALS, where)
    fields = metadata.fields() if isinstance(metadata, _Stub) else {}
    if getattr(metadata, "qualname", None) != f"{_DCP}.metadata.Metadata" or not isinstance(
        fields.get("storage_data"), dict
    ):
        raise CheckpointError(f"{where} is not DCP metadata (no storage table).")
    tensors = fields.get("state_dict_metadata")
    tensors = tensors if isinstance(tensors, dict) else {}
    stored: set[tuple] = set()  # (fqn, chunk index) of every storage entry
    for index, info in fields["storage_data"].items():
        index_fields = index.fields() if isinstance(index, _Stub) else {}
        fqn = index_fields.get("fqn")
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
        with open_regular(shard) as handle:
            item = check_torch_archive(
                _Slice(handle, offset, length), f"{shard} ({fqn})", check_crc=length < 1 << 20
            )
        _check_item_matches(item, tensors.get(fqn), index_fields.get("index"), f"{shard} ({fqn})", where)
        stored.add((fqn, index_fields.get("index")))
    for fqn, meta in tensors.items():  # every value the metadata describes has its bytes somewhere
        chunks = meta.fields().get("chunks") if isinstance(meta, _Stub) else None
        wanted = [(fqn, i) for i in range(len(chunks))] if isinstance(chunks, list) else [(fqn, None)]
        if not all(key in stored for key in wanted):
            raise CheckpointError(
                f"{where}: {fqn!r} has no stored item in the shards: the metadata is incomplete or altered. "
                "Resume from another global_step_N directory."
            )


# torch.save names a tensor's storage by its legacy typed-storage class
_STORAGE_OF_DTYPE = {
    "float32": "Float",
    "float64": "Double",
    "float16": "Half",
    "bfloat16": "BFloat16",
    "int64": "Long",
    "int32": "Int",
    "int16": "Short",
    "int8": "Char",
    "uint8": "Byte",
    "bool": "Bool",
}


def _size_of(stub: Any) -> tuple | None:
    """The tuple inside a torch.Size stub (None for anything else)."""
    if getattr(stub, "qualname", None) == "torch.Size" and stub.args and isinstance(stub.args[0], tuple):
        return stub.args[0]
    return None


def _check_item_matches(item: Any, tensor_meta: Any, chunk_index: Any, where: str, metadata: str) -> None:
    """A tensor item holds a tensor of the shape and dtype `.metadata` records for its chunk: entries
    swapped or pointed at another item are refused even when every file's hash was rewritten to match."""
    if getattr(tensor_meta, "qualname", None) != f"{_DCP}.metadata.TensorStorageMetadata":
        return  # a plain value (optimizer hyperparameters): its content was unpickled above
    chunks = tensor_meta.fields().get("chunks")
    if not isinstance(chunks, list) or type(chunk_index) is not int or not 0 <= chunk_index < len(chunks):
        raise CheckpointError(f"{metadata}: the entry of {where} names no chunk of its tensor.")
    chunk = chunks[chunk_index]
    expected = _size_of(chunk.fields().get("sizes")) if isinstance(chunk, _Stub) else None
    args = item.args if getattr(item, "qualname", None) == "torch._utils._rebuild_tensor_v2" else ()
    found = args[2] if len(args) > 2 and isinstance(args[2], tuple) else None
    if expected is None or found != expected:
        raise CheckpointError(
            f"{where} holds {'a tensor of shape ' + str(list(found)) if found is not None else 'no tensor'} "
            f"but {metadata} records shape {list(expected) if expected else '?'} for it: the metadata and the "
            "shard disagree (entries swapped or altered). Refused; resume from another global_step_N directory."
        )
    properties = tensor_meta.fields().get("properties")
    dtype = properties.fields().get("dtype") if isinstance(properties, _Stub) else None
    dtype_name = getattr(dtype, "qualname", "").removeprefix("torch.")
    storage = getattr(args[0], "qualname", "") if args else ""
    if dtype_name in _STORAGE_OF_DTYPE and storage != f"torch.{_STORAGE_OF_DTYPE[dtype_name]}Storage":
        raise CheckpointError(
            f"{where} holds a {storage.removeprefix('torch.') or 'storage of no type'} but {metadata} records "
            f"dtype {dtype_name}: the metadata and the shard disagree. Refused; resume from another "
            "global_step_N directory."
        )


def check_torch_archive(file: BinaryIO, where: str, check_crc: bool) -> Any:
    """A torch.save zip archive whose data.pkl unpickles with TORCH_SAVE_GLOBALS only (returned as
    stubs); with `check_crc` every member is read and its CRC compared. A compressed member (torch.save
    stores them as they are) or a data.pkl over MAX_PICKLE_BYTES is refused before it is read, so no
    small file expands in memory."""
    try:
        archive = zipfile.ZipFile(file)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        head = _head(file)
        if head[:1] == b"\x80":  # a bare pickle: say what it would run, if it would run anything
            _stub_load(io.BytesIO(head + file.read(MAX_PICKLE_BYTES)), TORCH_SAVE_GLOBALS, where)
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
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                raise CheckpointError(
                    f"{where}: member {info.filename!r} is compressed (it would expand to {info.file_size} "
                    "bytes); torch.save never compresses, so this file was not written by tandemrl. Refused."
                )
        if archive.getinfo(pickles[0]).file_size > MAX_PICKLE_BYTES:
            raise CheckpointError(
                f"{where}: its data.pkl is {archive.getinfo(pickles[0]).file_size} bytes, over the "
                f"{MAX_PICKLE_BYTES} bytes a checkpoint's pickle may hold. Refused."
            )
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
            return pid[1]  # the storage type: its dtype is checked against .metadata's

        return _stub_load(io.BytesIO(data), TORCH_SAVE_GLOBALS, where, on_storage)


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
