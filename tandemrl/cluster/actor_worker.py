"""The actor worker: the trainer's `Actor` plus the weight sender, as one plain class.

It lives where the weights live (a Ray actor process, or the runner's own process), so the weight
push never copies tensors through the driver. Its asyncio calls (the sender's HTTP + collective
work) run on a private event loop, one call at a time: the worker is used by one runner, serially.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandemrl.config.actor import ActorSetup
    from tandemrl.rollout.client import HttpClient
    from tandemrl.rollout.weight_sync import DiskWeightSender, WeightSender

log = logging.getLogger(__name__)


class ActorWorker:
    """`startup_log`: the run's start-up timeline file, given to a worker that is a Ray actor (a process of
    its own, named `actor rank <RANK>` there); an in-process worker marks as its host process."""

    def __init__(self, setup: ActorSetup, startup_log: str | None = None, cpus: tuple[int, ...] = ()):
        """`setup`: the actor's part of the run's config (config/derive.py `actor_setup`); `cpus`: the
        cores this rank keeps to (cluster/cpus.py), before torch starts its threads."""
        from tandemrl.host.startup import adopt, mark, mark_process_started

        if cpus:
            from tandemrl.host.cpus import pin_process

            pin_process(cpus)

        if startup_log:
            adopt(startup_log, f"actor rank {os.environ.get('RANK', '0')}")
            mark_process_started()
        mark("actor worker init started")
        import torch

        from tandemrl.trainer.actor import Actor

        mark("actor: torch and trainer imported")
        if setup.actor.device == "cpu" or (setup.actor.device == "auto" and not torch.cuda.is_available()):
            # Ray gives a worker OMP_NUM_THREADS=1 (its CPU share); a CPU actor trains on every core
            torch.set_num_threads(os.cpu_count() or 1)
        self.actor = Actor(setup)
        mark("actor built (model loaded, placed, optimizer)")
        import tandemrl.rollout.weight_sync  # noqa: F401  connect_weight_sync's, here while the servers boot

        self._loop = asyncio.new_event_loop()
        self._sender: WeightSender | DiskWeightSender | None = None
        self._clients: list[HttpClient] = []

    def get_weight_version(self) -> int:
        return int(self.actor.weight_version)

    def cpus(self) -> list[int]:
        """The cores this process's main thread may run on."""
        from tandemrl.host.cpus import available_cpus

        return available_cpus()

    def train_step(self, samples: list[Any], profile_path: str | None = None) -> dict[str, float]:
        """`profile_path`: record the step with torch.profiler (runner.profile_steps)."""
        if profile_path is None:
            return self.actor.train_step(samples)
        from tandemrl.trainer.profile import profiled

        with profiled(profile_path, self.actor.device):
            return self.actor.train_step(samples)

    def connect_weight_sync(
        self,
        engine_urls: list[str],
        backend: str,
        bucket_mb: int,
        engine_backend: str = "embedded",
        sync_dir: str | None = None,
        api_key: str | None = None,
        tp_size: int = 1,
        pause_mode: str = "retract",
    ) -> None:
        """Join the engines' weight-update group (gloo on CPU, NCCL across GPUs, CUDA IPC on one GPU), or
        prepare the directory the engines reload safetensors from (disk); `api_key` is the engines' key
        (None for engines that need none); `tp_size` the TP size of an engine that does not report it;
        `pause_mode` says whether the engines are idle during a push (their cache is flushed then)."""
        from urllib.parse import urlparse

        from tandemrl.cluster.server_supervisor import node_address
        from tandemrl.rollout.backends import make_weight_sender

        # engines on other nodes join the group at this node's address; local ones at loopback
        is_local = all(urlparse(url).hostname in ("127.0.0.1", "localhost") for url in engine_urls)
        master_address = "127.0.0.1" if is_local else node_address()

        async def connect():
            self._sender = make_weight_sender(
                engine_backend,
                backend,
                engine_urls,
                bucket_mb,
                sync_dir,
                str(self.actor.model_path),
                tp_size=tp_size,
                master_address=master_address,
                api_key=api_key,
                pause_mode=pause_mode,
            )
            self._clients = list(self._sender.clients)
            await self._sender.connect()

        self._loop.run_until_complete(connect())

    def push_weights(self, weight_version: int) -> dict:
        """Send the full weights to every engine, tagged `weight_version` (the engines are paused or
        drained by the runner around this call)."""
        assert self._sender is not None or self.actor.rank != 0, "connect_weight_sync first"
        assert weight_version == self.actor.weight_version, (weight_version, self.actor.weight_version)
        return self._loop.run_until_complete(self.actor.sync_weights(self._sender))

    def greedy_gaps(
        self, prompts: list[list[int]], continuations: list[list[int]]
    ) -> list[tuple[list[int], list[float]]]:
        """For each prompt and an engine's greedy continuation of it: the actor's argmax token at each
        position and how many nats below it the actor ranks the engine's token (trainer/greedy_gaps.py).
        It uses exactly the weights a push sends (`iter_full_weights`, in the compute dtype), for
        runner/weights_check.py. Every rank takes part in gathering each tensor; only rank 0 keeps
        them, builds the model in the compute dtype and scores."""
        import torch
        from transformers import AutoModelForCausalLM

        from tandemrl.trainer.greedy_gaps import argmax_gaps

        weights = self.actor.iter_full_weights()
        if self.actor.rank != 0:
            for _ in weights:
                pass
            return []
        state = dict(weights)
        config = self.actor.policy.hf.config
        with torch.device(self.actor.device):
            model = AutoModelForCausalLM.from_config(config, dtype=self.actor.compute_dtype).eval()
        model.load_state_dict(state, strict=False)
        model.tie_weights()
        return [argmax_gaps(model, p, c) for p, c in zip(prompts, continuations, strict=True)]

    def save_checkpoint(self, directory: str, extra: dict[str, object] | None = None) -> None:
        """The actor's checkpoint with `extra` (relative path -> object, e.g. data/data.pt) inside it,
        written by the actor's atomic save so a crash mid-save leaves the previous checkpoint whole."""
        self.actor.save_checkpoint(directory, extra)

    def load_checkpoint(self, directory: str) -> int:
        self.actor.load_checkpoint(directory)
        return self.get_weight_version()

    def close(self) -> None:
        async def close_all():
            closer = getattr(self._sender, "close", None)
            if closer is not None:
                await closer()
            for client in self._clients:
                await client.close()

        self._loop.run_until_complete(close_all())
        self._loop.close()
