"""One place that turns `rollout.backend` into a client and `rollout.weight_sync` into a weight sender.

embedded: `EngineClient` (the engine reports every token's weight version). sglang: `EngineClient`
streaming, versions from the update timeline. vllm: `VllmClient` (streaming, timeline versions). The
senders: a broadcast group or CUDA IPC (`WeightSender`, SGLang's routes), or safetensors on disk
(`DiskWeightSender`, the only route of the vLLM backend). Invariant: a client and the sender built
for one backend speak the same engine's protocol.
"""

from __future__ import annotations

from pathlib import Path

BACKENDS = ("embedded", "sglang", "vllm")


def make_client(backend: str, url: str, weight_version: int = 0, api_key: str | None = None):
    if backend not in BACKENDS:
        raise ValueError(f"rollout.backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "vllm":
        from tandemrl.rollout.vllm_client import VllmClient

        return VllmClient(url, api_key=api_key, weight_version=weight_version)
    from tandemrl.rollout.client import EngineClient

    return EngineClient(url, api_key=api_key, kind=backend, weight_version=weight_version)


def make_weight_sender(
    backend: str,
    sync: str,
    urls: list[str],
    bucket_mb: int,
    sync_dir: str | None = None,
    config_dir: str | None = None,
    tp_size: int = 1,
    master_address: str = "127.0.0.1",
    api_key: str | None = None,
):
    """The sender for `rollout.weight_sync` (already resolved from auto) to the engines at `urls`."""
    from tandemrl.rollout.weight_sync import DiskWeightSender, WeightSender

    clients = [make_client(backend, url, api_key=api_key) for url in urls]
    if sync == "disk":
        if sync_dir is None:
            raise ValueError(
                "rollout.weight_sync=disk needs a directory the engines can read (rollout.weight_sync_dir)"
            )
        return DiskWeightSender(clients, Path(sync_dir), config_dir)
    if backend == "vllm":
        raise ValueError(
            f"rollout.weight_sync={sync!r}: the vLLM backend reloads weights from disk; use disk"
        )
    return WeightSender(
        clients,
        backend=sync,
        bucket_mb=bucket_mb,
        master_address=master_address,
        engine_kind=backend,
        tp_size=tp_size,
    )
