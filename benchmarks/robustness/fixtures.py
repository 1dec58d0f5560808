"""What the hostile-input harnesses run on: a small KB with its index, tiny-run overrides, an actor
and random training samples. The same values as the integration tests' helpers (tests/integration/
runner_helpers.py, trainer_helpers.py), kept here because the harnesses also measure older trees, run
as separate processes, and must import neither `tests/` nor a module the measured tree may lack; only
long-standing package APIs (`generate_kb`, `build_index`, `load_config`, `TrainSample`) are used."""

from __future__ import annotations

import random
from pathlib import Path


def build_small_kb(root: Path, minilm_dir: Path) -> tuple[Path, Path]:
    """A 40-entity KB and its MiniLM index: (kb_dir, index_dir)."""
    from tandemrl.data.kb import generate_kb
    from tandemrl.retrieval.build import build_index

    kb_dir = generate_kb(root / "kb", seed=0, num_entities=40, num_train=60, num_val=6, num_test=4)
    index_dir = root / "index"
    build_index(kb_dir / "corpus.jsonl", index_dir, encoder=str(minilm_dir), show_progress=False)
    return kb_dir, index_dir


def tiny_overrides(model_dir: Path, kb_dir: Path, index_dir: Path, output_dir: Path) -> list[str]:
    """A CPU run of the tiny model: rollout_batch_size 2, group_size 2, <= 40 response tokens."""
    return [
        f"rollout.model.model_path={model_dir}",
        f"actor.model.model_path={model_dir}",
        f"data.train_data_paths=[{kb_dir / 'train.jsonl'}]",
        f"data.val_data_paths=[{kb_dir / 'val.jsonl'}]",
        f"retrieval.index_dir={index_dir}",
        f"retrieval.corpus_path={kb_dir / 'corpus.jsonl'}",
        f"runner.output_dir={output_dir}",
        "runner.max_steps=4",
        "runner.save_interval=0",
        "runner.val_interval=4",
        "data.rollout_batch_size=2",
        "data.val_limit=4",
        "algorithm.group_size=2",
        "algorithm.n_minibatches=2",
        "agentloop.task_name=searchr1",
        "agentloop.max_turns=1",
        "agentloop.max_new_tokens_per_turn=12",
        "agentloop.max_response_tokens=40",
        "agentloop.max_info_tokens=24",
        "rollout.device=cpu",
        "rollout.dtype=float32",
        "rollout.max_running_requests=8",
        "rollout.max_context_len=1024",
        "actor.device=cpu",
        "actor.optim.lr=1.0e-4",
        "cluster.use_ray=false",
        "runner.engine_health_interval_s=0.5",
    ]


def cpu_actor(model_dir: Path, *overrides: str):
    """An `Actor` on the CPU on `model_dir`, from the default config with `overrides`. Trees since issue
    36 build it from the actor's part of the config (`config.derive.actor_setup`), older ones from the
    whole config: the harness measures both."""
    from tandemrl.config import derive
    from tandemrl.config.loader import load_config
    from tandemrl.trainer.actor import Actor

    config = load_config(
        None,
        [
            f"actor.model.model_path={model_dir}",
            "actor.device=cpu",
            "runner.output_dir=/tmp/tandem-unused",
            *overrides,
        ],
    )
    return Actor(derive.actor_setup(config) if hasattr(derive, "actor_setup") else config)


def make_samples(
    seed: int = 0, num_samples: int = 8, vocab: int = 1000, min_len: int = 10, max_len: int = 40
):
    """Ragged random trajectories: a prompt (mask 0), then model tokens with a masked tool span."""
    from tandemrl.trainer.batching import TrainSample

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
