"""Weight transport shared by the trainer side (`rollout/weight_sync.py`) and the engine side.

Two transports: a torch.distributed group (gloo on CPU, NCCL between GPUs) on a TCPStore of its
own, keyed as SGLang keys it, so it never touches either process's default group; and CUDA IPC handles for one GPU,
described in JSON. Invariant: nothing is unpickled from the network; an IPC handle is rebuilt only by
torch's own `rebuild_cuda_tensor`, from values checked here (types, dtypes, sizes, base64 bytes).
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import threading
from concurrent.futures import Future

import torch
import torch.distributed as dist

DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool")
}
BACKENDS = ("gloo", "nccl")


def parse_dtype(value: str) -> torch.dtype:
    name = str(value).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {value!r} is not supported for weight updates; use one of {sorted(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def run_in_daemon_thread(fn, *args) -> asyncio.Future:
    """`fn(*args)` on a daemon thread, awaitable. For a group's rendezvous: when the other side dies mid-join
    it blocks until the group's timeout, and a pool thread (`asyncio.to_thread`'s) is joined at interpreter
    exit, so the process could not end; a daemon thread is left behind instead. Not for a collective: gloo
    raising in a daemon thread while the interpreter exits aborts the process (rollout/weight_sync.py)."""
    future: Future = Future()

    def target() -> None:
        if not future.set_running_or_notify_cancel():  # cancelled before it started
            return
        try:
            future.set_result(fn(*args))
        except BaseException as error:
            future.set_exception(error)

    threading.Thread(target=target, name=f"weights-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return asyncio.wrap_future(future)


def new_process_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = 600.0,
):
    """A process group of its own (not the default one), joined the way SGLang's
    `init_custom_process_group` joins it, so either side may be a real SGLang engine.

    That is: a TCPStore (rank 0 hosts it: what `tcp://` rendezvous builds), the bare `group_name` as
    the store prefix, then torch's own group helper (which adds `<group_name>/` and a per-device
    prefix and, for gloo, a sequence number). Any other key layout makes the peer wait for keys that
    never come. A group of the same name made earlier by this process is replaced.
    """
    from torch.distributed.distributed_c10d import (
        _cleanup_process_group_global_state,
        _new_process_group_helper,
        _world,
    )

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    for old, name in list(_world.pg_names.items()):
        if name == group_name:  # torch refuses a second group of one name; forget the first
            _cleanup_process_group_global_state(old)
    store = dist.TCPStore(master_address, int(master_port), int(world_size), rank == 0, timeout=timeout)
    store = dist.PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(
        int(world_size), int(rank), [], dist.Backend(backend), store, group_name=group_name, timeout=timeout
    )
    return group


def broadcast(group, tensor: torch.Tensor, root: int = 0) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = root, 0
    group.broadcast([tensor], opts).wait()
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


# ---- CUDA IPC -------------------------------------------------------------------------------------------

_STORAGE_CLASSES = {"TypedStorage": torch.storage.TypedStorage, "UntypedStorage": torch.UntypedStorage}


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode()


def describe_cuda_tensor(tensor: torch.Tensor) -> dict:
    """JSON-safe description of a CUDA tensor's IPC handle (the sender keeps the tensor alive)."""
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(tensor.detach())
    assert rebuild.__name__ == "rebuild_cuda_tensor", "only CUDA tensors travel by IPC"
    (
        _,
        size,
        stride,
        offset,
        storage_cls,
        dtype,
        device,
        handle,
        storage_size,
        storage_offset,
        _,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
    ) = args
    return dict(
        size=list(size),
        stride=list(stride),
        offset=int(offset),
        storage_cls=storage_cls.__name__,
        dtype=dtype_name(dtype),
        device=int(device),
        # the index is the sender's; a receiver that sees other devices (its own CUDA_VISIBLE_DEVICES)
        # finds the GPU by this
        device_uuid=str(torch.cuda.get_device_properties(int(device)).uuid),
        handle=_b64(handle),
        storage_size_bytes=int(storage_size),
        storage_offset_bytes=int(storage_offset),
        ref_counter_handle=_b64(ref_handle),
        ref_counter_offset=int(ref_offset),
        event_handle=_b64(event_handle),
        event_sync_required=bool(event_sync),
    )


def _int_list(value, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and v >= 0 for v in value):
        raise ValueError(f"IPC handle field {what!r} must be a list of non-negative ints")
    return value


def local_device_index(desc: dict) -> int:
    """The receiver's index of the GPU the handle lives on: the one whose UUID the sender named (the two
    processes may number their visible GPUs differently), else the sender's index as it is."""
    uuid = desc.get("device_uuid")
    if uuid is None:
        return desc["device"]
    if not isinstance(uuid, str):
        raise ValueError("IPC handle field 'device_uuid' must be text or null")
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise ValueError(
        f"IPC handle names GPU {uuid}, which this process does not see (CUDA_VISIBLE_DEVICES): the "
        "trainer and the engine must share that GPU for rollout.weight_sync=cuda_ipc"
    )


def rebuild_cuda_tensor(desc: dict) -> torch.Tensor:
    """Open a CUDA IPC handle described by `describe_cuda_tensor`, after checking every field."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor as torch_rebuild

    if desc.get("storage_cls") not in _STORAGE_CLASSES:
        raise ValueError(f"IPC storage_cls must be one of {sorted(_STORAGE_CLASSES)}")
    ints = ("offset", "device", "storage_size_bytes", "storage_offset_bytes", "ref_counter_offset")
    for key in ints:
        if not isinstance(desc.get(key), int) or desc[key] < 0:
            raise ValueError(f"IPC handle field {key!r} must be a non-negative int")
    handles = {}
    for key in ("handle", "ref_counter_handle", "event_handle"):
        value = desc.get(key)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"IPC handle field {key!r} must be base64 text or null")
        handles[key] = None if value is None else base64.b64decode(value, validate=True)
    return torch_rebuild(
        torch.Tensor,
        torch.Size(_int_list(desc.get("size"), "size")),
        tuple(_int_list(desc.get("stride"), "stride")),
        desc["offset"],
        _STORAGE_CLASSES[desc["storage_cls"]],
        parse_dtype(desc.get("dtype")),
        local_device_index(desc),
        handles["handle"],
        desc["storage_size_bytes"],
        desc["storage_offset_bytes"],
        False,
        handles["ref_counter_handle"],
        desc["ref_counter_offset"],
        handles["event_handle"],
        bool(desc.get("event_sync_required", False)),
    )
