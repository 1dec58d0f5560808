"""Where the compile of the actor's layers goes: into the actor's build, or into its first train step.

    python3 -m benchmarks.actor.first_step [--config examples/searchr1/config/smollm2_h200_async.yaml]
        [--no-warm-up] [--steps 3] [--tiny] [--out benchmarks/results/actor/first_step_<gpu>.json]

Builds the actor of `--config` (its actor and algorithm sections as a run derives them, `actor.compile_layers`
as the recipe sets it) with Inductor's cache in a fresh directory, so the compile is cold, and times the build
(which runs `Actor.warm_up` when the layers are compiled, trainer/actor.py), then `--steps` train steps on
Search-R1-shaped samples (256 trajectories of 300-1000 tokens; `--tiny`: a tiny random model on the CPU, 8 of
24-64, a smoke check with no figures). After the build and after each step it reads Dynamo's count of traced
graphs and of frames it compiled: with the warm-up the first step should trace nothing new and take about what the
later ones take. `--no-warm-up` skips `Actor.warm_up` (the behaviour before it), so the first step pays the
compile. The model is the prepared SmolLM2 where `tandem prepare` left one, else random weights of its shape.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from benchmarks import write_json  # noqa: E402
from benchmarks.actor.trainer_smollm2 import make_rl_samples, model_dir_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "examples/searchr1/config/smollm2_h200_async.yaml"))
    p.add_argument(
        "--no-warm-up", action="store_true", help="skip Actor.warm_up: the compile lands in step 1"
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="tiny random model on the CPU: a smoke check")
    p.add_argument("--out", default=None)
    p.add_argument("overrides", nargs="*", help="key=value for the config")
    return p.parse_args(argv)


def dynamo_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "frames": int(counters["frames"]["total"]),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from tandemrl.config.derive import actor_setup
    from tandemrl.config.loader import load_config
    from tandemrl.trainer.actor import Actor

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    tmp = Path(tempfile.mkdtemp(prefix="tandem-first-step-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "inductor_cache")  # cold: nothing compiled before
    model_args = argparse.Namespace(tiny=args.tiny)
    model_dir, model_source = model_dir_for(model_args, tmp)
    overrides = [
        f"actor.device={device.type}",
        f"rollout.model.model_path={model_dir}",  # the actor follows the engines' model
        f"runner.output_dir={tmp / 'run'}",
        *(["actor.dtype=float32", "actor.micro_batch_tokens=256"] if args.tiny else []),
        *args.overrides,
    ]
    setup = actor_setup(load_config(args.config, overrides))
    if args.no_warm_up:
        Actor.warm_up = lambda self: None  # the behaviour before trainer/actor.py `warm_up`
    num, lo, hi = (8, 24, 64) if args.tiny else (256, 300, 1000)
    start = time.perf_counter()
    actor = Actor(setup)
    build_s = time.perf_counter() - start
    counts = [dynamo_counts()]
    vocab = int(actor.hf_model.config.vocab_size)
    steps = []
    for step in range(args.steps):
        samples = make_rl_samples(num, lo, hi, vocab, seed=step)
        start = time.perf_counter()
        actor.train_step(samples)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        steps.append(time.perf_counter() - start)
        counts.append(dynamo_counts())
    result = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "config": args.config,
        "overrides": args.overrides,
        "model": model_source,
        "compile_layers": setup.actor.compile_layers,
        "warm_up": not args.no_warm_up,
        "trajectories_per_step": num,
        "build_s": build_s,
        "step_s": steps,
        "first_over_later_steps": steps[0] / (sum(steps[1:]) / len(steps[1:])) if len(steps) > 1 else None,
        "dynamo_after_build_and_each_step": counts,
        "graphs_traced_in_step_1": counts[1]["unique_graphs"] - counts[0]["unique_graphs"] if steps else None,
        "command": " ".join([sys.executable, "-m", "benchmarks.actor.first_step", *(argv or sys.argv[1:])]),
    }
    print(
        f"{result['gpu']}: build {build_s:.1f} s (warm-up {'on' if result['warm_up'] else 'off'}), steps "
        + ", ".join(f"{s:.2f}" for s in steps)
        + f" s; graphs traced in the build {counts[0]['unique_graphs']}, in step 1 {result['graphs_traced_in_step_1']}"
    )
    out = args.out or (
        "/tmp/first_step_tiny.json"
        if args.tiny
        else str(
            ROOT
            / "benchmarks/results/actor"
            / f"first_step_{'h100' if 'H100' in result['gpu'] else 'h200'}.json"
        )
    )
    write_json(out, result)
    return result


if __name__ == "__main__":
    main()
