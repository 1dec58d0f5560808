"""Trainer-side weight sync to the engines: a broadcast group (gloo on CPU, NCCL between GPUs), CUDA IPC
handles (one GPU shared by trainer and engine), in buckets of about `bucket_mb`; or safetensors on a
shared disk that the engines reload (`DiskWeightSender`, every backend's fallback).

Protocol per bucket (SGLang's): POST /update_weights_from_distributed with names/dtypes/shapes to every
engine, then broadcast the tensors from rank 0 (us) in that order; the engines answer once loaded. The
group holds every tensor-parallel rank of every engine: engine i joins at `rank_offset` = 1 + the ranks
of the engines before it and each of its TP ranks takes `rank_offset + tp_rank` (SGLang's rule, and our
vLLM worker extension's), so the world is 1 + the sum of the engines' TP sizes, which each engine
reports (`num_tp_ranks`). CUDA IPC goes through SGLang's /update_weights_from_tensor body, one
`serialized_named_tensors` entry per TP rank (SGLang's rank r opens entry r): to a real SGLang each entry
is what SGLang's own serializer makes (a base64 pickle that SGLang opens, the GPU named by UUID as
SGLang's patched torch reductions expect); the embedded engine and our vLLM worker extension unpickle
nothing, so to them each entry is base64 JSON of checked IPC descriptions (engine/weight_transport.py).
After the last bucket each engine finishes the update (`finish_weight_update`: SGLang flushes its cache
when the pause mode left it idle, vLLM records the version and resets its prefix cache).
Invariant: every bucket of one `push` carries the same `weight_version`, so the engines end on exactly
that version; names are the HF parameter names.
CUDA IPC to the embedded engine is one bucket, whatever `bucket_mb` says (`is_one_bucket`, set where
`rollout/backends.py` `pushes_atomically` holds): the engine's loop thread loads it as one command between
two steps, so an `in_place` update needs no pause around it (runner/step.py, `sync_weights`). The bucket's tensors are the actor's own where it already holds the
compute dtype, else one cast copy of the weights, alive until the engine has copied them.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from tandemrl.engine.weight_transport import (
    broadcast,
    describe_cuda_tensor,
    dtype_name,
    new_process_group,
    run_in_daemon_thread,
)
from tandemrl.rollout.client import EngineError

BACKENDS = ("gloo", "nccl", "cuda_ipc")
ENGINE_KINDS = ("embedded", "sglang", "vllm")
JSON_IPC_KINDS = ("embedded", "vllm")  # receivers that open JSON IPC descriptions, never a pickle
DEVICE_ARG = 6  # the device index in torch's `reduce_tensor` arguments of a CUDA tensor


def _reduce_with_device_uuid(tensor: torch.Tensor):
    """torch's reduction of a CUDA tensor with the GPU named by UUID, as SGLang's patched
    `rebuild_cuda_tensor` takes it (the two processes may number their GPUs differently)."""
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(tensor)
    if tensor.is_cuda:
        uuid = str(torch.cuda.get_device_properties(args[DEVICE_ARG]).uuid)
        args = (*args[:DEVICE_ARG], uuid, *args[DEVICE_ARG + 1 :])
    return rebuild, args


def ipc_payload(bucket: list[tuple[str, torch.Tensor]], engine_kind: str) -> str:
    """One `serialized_named_tensors` entry for a bucket of CUDA tensors (see the module docstring)."""
    if engine_kind in JSON_IPC_KINDS:
        described = [{"name": n, "tensor": describe_cuda_tensor(t)} for n, t in bucket]
        return base64.b64encode(json.dumps(described).encode()).decode()
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  registers torch's storage reductions with ForkingPickler

    buffer = io.BytesIO()
    pickler = ForkingPickler(buffer)
    pickler.dispatch_table = {**pickler.dispatch_table, torch.Tensor: _reduce_with_device_uuid}
    pickler.dump(list(bucket))
    return base64.b64encode(buffer.getvalue()).decode()


def rank_offsets(tp_sizes: list[int]) -> tuple[list[int], int]:
    """(each engine's `rank_offset`, the world size) of a weight group of the trainer (rank 0) and every
    TP rank of every engine: engine i's rank r is `rank_offset[i] + r`."""
    offsets, next_rank = [], 1
    for tp_size in tp_sizes:
        if tp_size < 1:
            raise ValueError(f"an engine reported {tp_size} tensor-parallel ranks; expected >= 1")
        offsets.append(next_rank)
        next_rank += tp_size
    return offsets, next_rank


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of about `bucket_bytes` (a larger tensor forms its own bucket)."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


class WeightSender:
    """`tp_size`: the TP size of an engine that does not report its own; `flush_cache`: whether the pause
    mode leaves the engines idle during a push (retract, drain), so SGLang may flush after it."""

    def __init__(
        self,
        clients: list,
        backend: str,
        bucket_mb: int = 256,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        group_name: str = "tandem_weight_sync",
        engine_kind: str = "embedded",
        tp_size: int = 1,
        flush_cache: bool = False,
        is_one_bucket: bool = False,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"weight sync backend must be one of {BACKENDS}, got {backend!r}")
        if engine_kind not in ENGINE_KINDS:
            raise ValueError(f"engine_kind must be one of {ENGINE_KINDS}, got {engine_kind!r}")
        self.engine_kind, self.tp_size, self.flush_cache = engine_kind, tp_size, flush_cache
        # every tensor in one bucket, which the engine loads between two of its steps
        self.is_one_bucket = is_one_bucket
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.clients, self.backend, self.bucket_bytes = clients, backend, bucket_mb * 2**20
        self.master_address, self.group_name = master_address, group_name
        self.master_port = master_port
        self.group = None
        self.tp_sizes: list[int] = []  # per engine, read in connect()

    async def connect(self) -> None:
        """Learn every engine's TP size, then form the broadcast group with all their ranks (none for
        CUDA IPC)."""
        self.tp_sizes = list(await asyncio.gather(*(c.num_tp_ranks(self.tp_size) for c in self.clients)))
        if self.backend == "cuda_ipc":
            return
        if self.master_port is None:
            from tandemrl.host.child_server import free_port

            self.master_port = free_port()
        offsets, world_size = rank_offsets(self.tp_sizes)
        joins = [
            asyncio.create_task(
                client.init_weights_update_group(
                    self.master_address, self.master_port, offset, world_size, self.group_name, self.backend
                )
            )
            for client, offset in zip(self.clients, offsets, strict=True)
        ]
        create = run_in_daemon_thread(  # not a pool thread: an engine dying mid-join must not hold our exit
            new_process_group,
            self.master_address,
            self.master_port,
            0,
            world_size,
            self.group_name,
            self.backend,
        )
        self.group, *_ = await asyncio.gather(create, *joins)

    async def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> dict:
        """Send all tensors to every engine; returns {"bytes", "seconds", "num_buckets"}."""
        if self.backend != "cuda_ipc" and self.group is None:
            raise RuntimeError("WeightSender.push before connect(); call `await sender.connect()` once first")
        start, num_bytes, num_buckets = time.perf_counter(), 0, 0
        bucket_bytes = sys.maxsize if self.is_one_bucket else self.bucket_bytes
        for bucket in iter_buckets(named_tensors, bucket_bytes):
            bucket = [(name, self._prepare(t)) for name, t in bucket]
            if self.backend == "cuda_ipc":
                await self._send_ipc(bucket, weight_version)
            else:
                await self._send_broadcast(bucket, weight_version)
            num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            num_buckets += 1
        await asyncio.gather(
            *(c.finish_weight_update(weight_version, self.flush_cache) for c in self.clients)
        )
        return {"bytes": num_bytes, "seconds": time.perf_counter() - start, "num_buckets": num_buckets}

    def _prepare(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if self.backend == "gloo":
            tensor = tensor.cpu()
        elif not tensor.is_cuda:
            tensor = tensor.cuda()
        return tensor.contiguous()

    async def _send_broadcast(self, bucket: list[tuple[str, torch.Tensor]], weight_version: int) -> None:
        names = [n for n, _ in bucket]
        dtypes = [dtype_name(t.dtype) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        posts = [
            asyncio.create_task(
                c.update_weights_from_distributed(names, dtypes, shapes, self.group_name, weight_version)
            )
            for c in self.clients
        ]

        def send_all() -> None:
            for _, tensor in bucket:
                broadcast(self.group, tensor, root=0)

        # a pool thread, not a daemon one: gloo raising in a daemon thread during the interpreter's exit aborts
        # the process; one blocked on an engine that died is ended by `tandem train`'s exit guard
        sending = asyncio.create_task(asyncio.to_thread(send_all))
        done, _ = await asyncio.wait([sending, *posts], return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise EngineError(f"weight update failed: {task.exception()}") from task.exception()
        await asyncio.gather(sending, *posts)

    async def _send_ipc(self, bucket: list[tuple[str, torch.Tensor]], weight_version: int) -> None:
        torch.cuda.current_stream().synchronize()  # the engine reads the memory as soon as it opens it
        payload = ipc_payload(bucket, self.engine_kind)
        await asyncio.gather(
            *(
                client.update_weights_from_tensor(self.ipc_entries(index, payload), weight_version)
                for index, client in enumerate(self.clients)
            )
        )
        del bucket  # the engines have copied: the IPC memory may be freed now

    def ipc_entries(self, index: int, payload: str) -> list[str]:
        """`serialized_named_tensors` for engine `index`: one entry per TP rank (each opens its own)."""
        return [payload] * self.tp_sizes[index]


class DiskWeightSender:
    """Weights as one safetensors file under `sync_dir/v<version>/` that every engine reloads through its
    own route (vLLM: `reload_weights` by collective RPC; SGLang and the embedded engine:
    /update_weights_from_disk, with `flush_cache` as the pause mode allows: SGLang asserts on a flush
    that finds requests running). The engines must see `sync_dir` (one machine or a shared filesystem).
    Invariant: a version directory is complete (written aside, then renamed) before any engine is told
    of it; only the newest one is kept."""

    def __init__(
        self,
        clients: list,
        sync_dir: str | Path,
        config_dir: str | Path | None = None,
        flush_cache: bool = True,
    ):
        self.clients, self.sync_dir, self.flush_cache = clients, Path(sync_dir), flush_cache
        self.config_dir = None if config_dir is None else Path(config_dir)

    async def connect(self) -> None:
        self.sync_dir.mkdir(parents=True, exist_ok=True)

    async def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> dict:
        start = time.perf_counter()
        target = await asyncio.to_thread(self._write, named_tensors, weight_version)
        await asyncio.gather(
            *(c.update_weights_from_disk(str(target), weight_version, self.flush_cache) for c in self.clients)
        )
        for old in self.sync_dir.glob("v*"):
            if old != target and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
        num_bytes = (target / "model.safetensors").stat().st_size
        return {"bytes": num_bytes, "seconds": time.perf_counter() - start, "num_buckets": 1}

    def _write(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> Path:
        from safetensors.torch import save_file

        state = {name: t.detach().cpu().contiguous().clone() for name, t in named_tensors}
        target, partial = self.sync_dir / f"v{weight_version}", self.sync_dir / f".v{weight_version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        save_file(state, str(partial / "model.safetensors"), metadata={"format": "pt"})
        for name in ("config.json", "generation_config.json"):  # SGLang reloads a whole model directory
            if self.config_dir is not None and (self.config_dir / name).exists():
                shutil.copy(self.config_dir / name, partial / name)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
        return target
