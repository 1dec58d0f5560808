"""Trainer-side weight sync to the engines: a broadcast group (gloo on CPU, NCCL between GPUs) or CUDA
IPC handles (one GPU shared by trainer and engine), in buckets of about `bucket_mb`.

Protocol per bucket (SGLang's): POST /update_weights_from_distributed with names/dtypes/shapes to every
engine, then broadcast the tensors from rank 0 (us) in that order; the engines answer once loaded.
Invariant: every bucket of one `push` carries the same `weight_version`, so the engines end on exactly
that version; names are the HF parameter names.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator

import torch

from tandemrl.engine.weight_transport import broadcast, describe_cuda_tensor, dtype_name, new_process_group
from tandemrl.rollout.client import EngineClient, EngineError

BACKENDS = ("gloo", "nccl", "cuda_ipc")


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
    def __init__(
        self,
        clients: list[EngineClient],
        backend: str,
        bucket_mb: int = 256,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        group_name: str = "tandem_weight_sync",
    ):
        if backend not in BACKENDS:
            raise ValueError(f"weight sync backend must be one of {BACKENDS}, got {backend!r}")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.clients, self.backend, self.bucket_bytes = clients, backend, bucket_mb * 2**20
        self.master_address, self.group_name = master_address, group_name
        self.master_port = master_port
        self.group = None

    async def connect(self) -> None:
        """Form the broadcast group with every engine (no-op for CUDA IPC)."""
        if self.backend == "cuda_ipc":
            return
        if self.master_port is None:
            from tandemrl.cluster.child_server import free_port

            self.master_port = free_port()
        world_size = 1 + len(self.clients)
        joins = [
            asyncio.create_task(
                client.post(
                    "/init_weights_update_group",
                    {
                        "master_address": self.master_address,
                        "master_port": self.master_port,
                        "rank_offset": 1 + i,
                        "world_size": world_size,
                        "group_name": self.group_name,
                        "backend": self.backend,
                    },
                )
            )
            for i, client in enumerate(self.clients)
        ]
        create = asyncio.to_thread(
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
        for bucket in iter_buckets(named_tensors, self.bucket_bytes):
            bucket = [(name, self._prepare(t)) for name, t in bucket]
            if self.backend == "cuda_ipc":
                await self._send_ipc(bucket, weight_version)
            else:
                await self._send_broadcast(bucket, weight_version)
            num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            num_buckets += 1
        return {"bytes": num_bytes, "seconds": time.perf_counter() - start, "num_buckets": num_buckets}

    def _prepare(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if self.backend == "gloo":
            tensor = tensor.cpu()
        elif not tensor.is_cuda:
            tensor = tensor.cuda()
        return tensor.contiguous()

    async def _send_broadcast(self, bucket: list[tuple[str, torch.Tensor]], weight_version: int) -> None:
        body = {
            "names": [n for n, _ in bucket],
            "dtypes": [dtype_name(t.dtype) for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": self.group_name,
            "flush_cache": False,
            "weight_version": str(weight_version),
        }
        posts = [asyncio.create_task(c.post("/update_weights_from_distributed", body)) for c in self.clients]

        def send_all() -> None:
            for _, tensor in bucket:
                broadcast(self.group, tensor, root=0)

        sending = asyncio.create_task(asyncio.to_thread(send_all))
        done, _ = await asyncio.wait([sending, *posts], return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise EngineError(f"weight update failed: {task.exception()}") from task.exception()
        await asyncio.gather(sending, *posts)

    async def _send_ipc(self, bucket: list[tuple[str, torch.Tensor]], weight_version: int) -> None:
        torch.cuda.current_stream().synchronize()  # the engine reads the memory as soon as it opens it
        body = {
            "named_tensors": [{"name": n, "tensor": describe_cuda_tensor(t)} for n, t in bucket],
            "weight_version": str(weight_version),
            "flush_cache": False,
        }
        await asyncio.gather(*(c.post("/update_weights_from_tensor", body) for c in self.clients))
        del bucket  # the engines have copied: the IPC memory may be freed now
