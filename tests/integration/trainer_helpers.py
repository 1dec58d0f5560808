"""Shared pieces of the trainer's integration tests: random samples, configs and a rank worker for
`torch.multiprocessing.spawn` (real gloo process groups, one process per rank)."""

from __future__ import annotations

import json
import math
import os
import random
import sys
from pathlib import Path

import torch

from tandemrl.config.actor import ActorSetup
from tandemrl.config.derive import actor_setup
from tandemrl.config.loader import load_config
from tandemrl.trainer.batching import TrainSample


def make_samples(
    seed: int = 0, num_samples: int = 8, vocab: int = 1000, min_len: int = 10, max_len: int = 40
) -> list[TrainSample]:
    """Ragged random trajectories: a prompt (mask 0), then model tokens with a masked tool span."""
    rng = random.Random(seed)
    samples = []
    for _ in range(num_samples):
        n = rng.randint(min_len, max_len)
        num_prompt = rng.randint(3, 8)
        mask = [0] * num_prompt + [1] * (n - num_prompt)
        if n - num_prompt > 8:  # a tool-output span in the middle, as after a search
            for t in range(num_prompt + 3, num_prompt + 6):
                mask[t] = 0
        samples.append(
            TrainSample(
                [rng.randrange(vocab) for _ in range(n)],
                mask,
                [rng.uniform(-12.0, -9.0) * m for m in mask],
                rng.uniform(-1.5, 1.5),
            )
        )
    return samples


def cpu_actor_setup(model_dir: Path, *overrides: str) -> ActorSetup:
    """The actor's part of the default config with `overrides`, on the CPU on `model_dir`."""
    return actor_setup(
        load_config(
            None,
            [
                f"actor.model.model_path={model_dir}",
                "actor.device=cpu",
                "runner.output_dir=/tmp/tandem-unused",
                *overrides,
            ],
        )
    )


def join_as_rank(rank: int, world_size: int, port: int) -> None:
    """A process started by `mp.spawn`: one torch thread, and the env:// rendezvous of rank `rank` of
    `world_size` at 127.0.0.1:`port` (the actor's `init_distributed` joins it)."""
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )


def leave_together() -> None:
    """End a spawned rank whose results are on disk."""
    # leave together: a rank that tears gloo down while its peer is still using the group can abort
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # Skip interpreter teardown: once in CI a gloo thread still joinable at static destruction aborted the
    # child ("terminate called without an active exception") after it had done its work, which mp.spawn
    # reports as a failed rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rank_worker(
    rank: int, world_size: int, port: int, model_dir: str, out_file: str, num_steps: int, overrides: list[str]
) -> None:
    """One rank: `num_steps` train steps on the same samples, then rank 0 saves the full weights."""
    join_as_rank(rank, world_size, port)
    result = train_steps(Path(model_dir), num_steps, overrides, Path(out_file).parent / "ckpt")
    if rank == 0:
        torch.save(result, out_file)
    leave_together()


def train_steps(model_dir: Path, num_steps: int, overrides: list[str], ckpt_dir: Path | None = None) -> dict:
    """A fresh actor's metrics and full weights after `num_steps` steps on make_samples(seed=step),
    checkpointed to `ckpt_dir` when given."""
    from tandemrl.trainer.actor import Actor

    actor = Actor(cpu_actor_setup(model_dir, *overrides))
    metrics = [actor.train_step(make_samples(seed=step, num_samples=6)) for step in range(num_steps)]
    if ckpt_dir is not None:
        actor.save_checkpoint(ckpt_dir)
    return {"weights": {name: t.clone() for name, t in actor.iter_full_weights()}, "metrics": metrics}


def train_save_then_hang_mid_save(model_dir: str, output_dir: str, marker: str) -> None:
    """Child process of the crash test: save global_step_1 whole, then start global_step_2 and stop
    between two of its files (until the parent SIGKILLs it)."""
    import time

    from tandemrl.trainer import checkpoint
    from tandemrl.trainer.actor import Actor

    torch.set_num_threads(1)
    actor = Actor(cpu_actor_setup(Path(model_dir), "actor.optim.lr=0.001", "algorithm.n_minibatches=1"))
    actor.train_step(make_samples(seed=0, num_samples=4))
    actor.save_checkpoint(checkpoint.checkpoint_dir(output_dir, 1), extra={"data/data.pt": {"position": 1}})
    torch.save({n: t.clone() for n, t in actor.iter_full_weights()}, Path(output_dir) / "weights_step1.pt")
    actor.train_step(make_samples(seed=1, num_samples=4))
    real_save = torch.save

    def save_then_hang(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        Path(marker).write_text(str(f))
        time.sleep(600)

    torch.save = save_then_hang
    actor.save_checkpoint(checkpoint.checkpoint_dir(output_dir, 2), extra={"data/data.pt": {"position": 2}})


def num_checkpoint_params(model_dir: Path) -> int:
    """The parameters stored in `model_dir`'s safetensors (tied weights once), read from the headers."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                total += math.prod(f.get_slice(name).get_shape())
    return total


def load_peak_rss(model_dir: Path, world_size: int, out_dir: Path) -> list[dict[str, int]]:
    """Host memory of building the actor on `model_dir` (load, shard, optimizer) in each of `world_size`
    gloo ranks (processes by mp.spawn, as a multi-rank run has them), measured from the rank's RSS just
    before `Actor(...)`: per rank, `peak_bytes` is the highest RSS during the build (the kernel's high-water
    mark, reset to the current RSS first) less that RSS, `rss_bytes` what the built actor keeps. The process
    group and the model's classes exist before the baseline, so only the build is counted. (`ru_maxrss`
    would not do: it keeps the peak of the process spawn forked from, across the exec.)"""
    import torch.multiprocessing as mp

    from tandemrl.host.child_server import free_port

    mp.spawn(
        _load_rss_rank,
        args=(world_size, free_port(), str(model_dir), str(out_dir)),
        nprocs=world_size,
        join=True,
    )
    return [json.loads((Path(out_dir) / f"rss_rank{rank}.json").read_text()) for rank in range(world_size)]


def _load_rss_rank(rank: int, world_size: int, port: int, model_dir: str, out_dir: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from tandemrl.trainer.actor import Actor
    from tandemrl.trainer.policy import init_distributed

    join_as_rank(rank, world_size, port)
    init_distributed(torch.device("cpu"))
    with torch.device("meta"):  # imports the model's modules (a lazy import would count as the load)
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark := the current RSS (Linux >= 4.0)
    rss_before = _proc_status_bytes("VmRSS")
    actor = Actor(cpu_actor_setup(Path(model_dir)))
    result = {
        "peak_bytes": _proc_status_bytes("VmHWM") - rss_before,
        "rss_bytes": _proc_status_bytes("VmRSS") - rss_before,
    }
    (Path(out_dir) / f"rss_rank{rank}.json").write_text(json.dumps(result))
    del actor
    leave_together()


def _proc_status_bytes(key: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)
