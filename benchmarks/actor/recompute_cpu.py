"""What the proximal-logprob recompute adds to a train step (`algorithm.off_policy_correction=decoupled`,
trainer/actor.py `_recompute_proximal`), against the same step without a correction, on the CPU: a tiny
random Llama (so the forward is cheap and the host's share shows) and a step shaped like the H200
recipe's hand-off (256 trajectories, prompts of 250 tokens, 310-token responses, four minibatches).

    python -m benchmarks.actor.recompute_cpu [--trajectories 256] [--repeats 3] \
        [--out benchmarks/results/actor/recompute_cpu.json]

Absolute times are this machine's; the figure to read is the extra seconds of the recompute.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import write_json
from benchmarks.engine.model_shapes import TINY
from tandemrl.config.derive import actor_setup
from tandemrl.config.loader import load_config
from tandemrl.trainer.actor import Actor
from tandemrl.trainer.batching import TrainSample

VOCAB = TINY["vocab_size"]


def tiny_llama(out_dir: Path) -> Path:
    """A random Llama of the benchmarks' TINY shape (benchmarks/engine/model_shapes.py), without a tokenizer:
    the actor reads token ids only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = {k: v for k, v in TINY.items() if k != "use_sliding_window"}  # a Qwen2 key
    LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(out_dir)
    return out_dir


def make_samples(num: int, prompt_len: int, response_len: int) -> list[TrainSample]:
    rng = random.Random(0)
    samples = []
    for _ in range(num):
        n = prompt_len + response_len
        mask = [0] * prompt_len + [1] * response_len
        logprobs = [-rng.uniform(0.0, 2.0) * m for m in mask]
        samples.append(
            TrainSample([rng.randrange(VOCAB) for _ in range(n)], mask, logprobs, rng.uniform(-1, 1))
        )
    return samples


def step_time(model_dir: Path, samples: list[TrainSample], repeats: int, *overrides: str) -> float:
    config = load_config(
        None,
        [
            f"actor.model.model_path={model_dir}",
            "actor.device=cpu",
            "runner.output_dir=/tmp/tandem-unused",
            "algorithm.n_minibatches=4",
            *overrides,
        ],
    )
    actor = Actor(actor_setup(config))
    times = []
    for _ in range(repeats):
        start_s = time.perf_counter()
        actor.train_step(samples)
        times.append(time.perf_counter() - start_s)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/actor/recompute_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    samples = make_samples(args.trajectories, 250, 310)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_llama(Path(tmp))
        plain = step_time(model_dir, samples, args.repeats, "algorithm.off_policy_correction=none")
        decoupled = step_time(model_dir, samples, args.repeats, "algorithm.off_policy_correction=decoupled")
    result = {
        "trajectories": args.trajectories,
        "tokens": sum(s.num_tokens for s in samples),
        "cpu_count": os.cpu_count(),
        "train_step_none_s": round(plain, 4),
        "train_step_decoupled_s": round(decoupled, 4),
        "recompute_extra_s": round(decoupled - plain, 4),
        "command": "python -m benchmarks.actor.recompute_cpu "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
    }
    print(json.dumps(result, indent=2))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
