"""One place that turns `rollout.backend` into a client and `rollout.weight_sync` into a weight sender.

embedded: `EngineClient` (the engine reports every token's weight version). sglang: `EngineClient`
streaming, versions from the update timeline. vllm: `VllmClient` (streaming, timeline versions). The
senders: a broadcast group or CUDA IPC (`WeightSender`: SGLang's routes, and vLLM's through our worker
extension), or safetensors on disk (`DiskWeightSender`, every backend's fallback). Invariant: a client
and the sender built for one backend speak the same engine's protocol.
"""

from __future__ import annotations

from pathlib import Path

BACKENDS = ("embedded", "sglang", "vllm")
# pause modes under which no request is at the engine during a push, so its cache may be flushed after
# it (SGLang flushes only then; in_place keeps requests frozen with their KV)
IDLE_PAUSE_MODES = ("retract", "drain")


def pushes_atomically(engine_kind: str, route: str) -> bool:
    """Whether a push reaches every engine as one update that lands between two of its steps: CUDA IPC to the
    embedded engine (one bucket, loaded by one command of its loop thread, engine/weight_updates.py). Other
    routes send buckets the engine loads one at a time, so steps between them would mix two versions."""
    return route == "cuda_ipc" and engine_kind == "embedded"


def make_client(
    backend: str,
    url: str,
    weight_version: int = 0,
    api_key: str | None = None,
    max_context_len: int | None = None,
):
    """`max_context_len` (rollout.max_context_len): SGLang and vLLM clients cut a request's max_new_tokens to
    the context left (rollout/client.py `fit_to_context`)."""
    if backend not in BACKENDS:
        raise ValueError(f"rollout.backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "vllm":
        from tandemrl.rollout.vllm_client import VllmClient

        return VllmClient(
            url, api_key=api_key, weight_version=weight_version, max_context_len=max_context_len
        )
    from tandemrl.rollout.client import EngineClient

    return EngineClient(
        url, api_key=api_key, kind=backend, weight_version=weight_version, max_context_len=max_context_len
    )


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
    pause_mode: str = "retract",
):
    """The sender for `rollout.weight_sync` (already resolved from auto) to the engines at `urls`;
    `tp_size` stands for an engine that does not report its own (rollout.tensor_parallel_size)."""
    from tandemrl.rollout.weight_sync import DiskWeightSender, WeightSender

    clients = [make_client(backend, url, api_key=api_key) for url in urls]
    flush = pause_mode in IDLE_PAUSE_MODES
    if sync == "disk":
        if sync_dir is None:
            raise ValueError(
                "rollout.weight_sync=disk needs a directory the engines can read (rollout.weight_sync_dir)"
            )
        return DiskWeightSender(clients, Path(sync_dir), config_dir, flush_cache=flush)
    return WeightSender(
        clients,
        backend=sync,
        bucket_mb=bucket_mb,
        master_address=master_address,
        engine_kind=backend,
        tp_size=tp_size,
        flush_cache=flush,
        is_one_bucket=pushes_atomically(backend, sync),
    )
