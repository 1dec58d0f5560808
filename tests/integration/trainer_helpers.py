"""Shared pieces of the trainer's integration tests: random samples, configs and a rank worker for
`torch.multiprocessing.spawn` (real gloo process groups, one process per rank)."""

from __future__ import annotations

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


def rank_worker(
    rank: int, world_size: int, port: int, model_dir: str, out_file: str, num_steps: int, overrides: list[str]
) -> None:
    """One rank: `num_steps` train steps on the same samples, then rank 0 saves the full weights."""
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    result = train_steps(Path(model_dir), num_steps, overrides, Path(out_file).parent / "ckpt")
    if rank == 0:
        torch.save(result, out_file)
    # leave together: a rank that tears gloo down while its peer is still using the group can abort
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # The result is on disk. Skip interpreter teardown: once in CI a gloo thread still joinable at static
    # destruction aborted the child ("terminate called without an active exception") after it had done
    # its work, which mp.spawn reports as a failed rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
