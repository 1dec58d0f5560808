"""The supervised cold start on the actor's own machinery (`tandem sft`, commands/sft.py, renders the
demonstrations and calls `train_sft`).

Demonstration samples (token ids with their loss mask, rendered by commands/sft.py) are trained on with token-mean cross-entropy over the model turns
(loss_mask 1; prompt and information blocks 0). The result is an HF directory that RL starts from
(`actor.model.model_path` / `rollout.model.model_path`).
Invariant: SFT uses `Actor.sft_step`, so packing, FSDP, precision and export are those of RL.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import random
from pathlib import Path

from tandemrl.trainer.batching import TrainSample

log = logging.getLogger(__name__)


def read_rendered(path: str | Path) -> list[TrainSample]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"actor.sft.rendered_path={str(path)!r} does not exist; write a jsonl of "
            '{"input_ids": [...], "loss_mask": [...]} or unset it to render the demos.'
        )
    from tandemrl.host.files import InputFileError, iter_json_lines

    samples = []
    for line_number, row in iter_json_lines(path, "actor.sft.rendered_path"):
        ids, mask = row.get("input_ids"), row.get("loss_mask")
        if not _is_int_list(ids) or not _is_int_list(mask) or len(ids) != len(mask) or not ids:
            raise InputFileError(
                f"actor.sft.rendered_path {str(path)!r} line {line_number}: needs `input_ids` and `loss_mask`, "
                "non-empty lists of integers of the same length."
            )
        samples.append(TrainSample(ids, mask, [0.0] * len(ids)))
    return samples


def _is_int_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def write_rendered(path: Path, samples: list[TrainSample]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for s in samples:
            f.write(json.dumps({"input_ids": s.input_ids, "loss_mask": s.loss_mask}) + "\n")


def train_sft(config, samples: list[TrainSample]) -> tuple[Path, dict[str, float]]:
    """`actor.sft.num_epochs` passes of shuffled batches of `actor.sft.batch_size`; exports the policy."""
    from tandemrl.config.derive import actor_setup
    from tandemrl.metrics.logger import MetricsLogger
    from tandemrl.trainer.actor import Actor

    sft = config.actor.sft
    config = copy.deepcopy(config)
    config.actor.optim.lr = sft.lr
    config.actor.model.model_path = sft_init_model_path(config)  # None: the embedded SmolLM2
    num_batches = math.ceil(len(samples) / sft.batch_size)
    actor = Actor(actor_setup(config, total_updates=sft.num_epochs * num_batches))
    output_dir = Path(config.runner.output_dir)
    logger = (
        MetricsLogger(output_dir / "sft", max_steps=sft.num_epochs * num_batches) if actor.rank == 0 else None
    )
    rng, metrics = random.Random(config.data.seed), {}
    try:
        for epoch in range(sft.num_epochs):
            order = list(range(len(samples)))
            rng.shuffle(order)
            for b in range(num_batches):
                batch = [samples[i] for i in order[b * sft.batch_size : (b + 1) * sft.batch_size]]
                metrics = actor.sft_step(batch)
                if logger is not None:
                    logger.log(actor.num_updates, {**metrics, "train/sft/epoch": float(epoch)})
                    log.info(
                        "sft update %d/%d: loss %.4f",
                        actor.num_updates,
                        sft.num_epochs * num_batches,
                        metrics["train/sft/loss"],
                    )
    finally:
        if logger is not None:
            logger.close()
    out_dir = sft_out_dir(config)
    actor.export_hf(out_dir)
    return out_dir, metrics


def sft_out_dir(config) -> Path:
    """Where the cold-started model goes: `actor.sft.out_dir`, else the embedded recipe's `coldstart`
    directory when fine-tuning the embedded SmolLM2, else `<runner.output_dir>/sft_model`."""
    from tandemrl.host.home import default_coldstart_dir

    sft = config.actor.sft
    if sft.out_dir:
        return Path(sft.out_dir)
    if sft_init_model_path(config) is None:
        return default_coldstart_dir()
    return Path(config.runner.output_dir) / "sft_model"


def sft_init_model_path(config) -> str | None:
    """The model the cold start fine-tunes: `actor.sft.init_model_path`, else the actor's model unless
    that is the cold start's own output (`model_path: coldstart`), else None (the embedded SmolLM2)."""
    from tandemrl.host.home import default_coldstart_dir

    if config.actor.sft.init_model_path:
        return config.actor.sft.init_model_path
    actor_path = config.actor.model.model_path
    if actor_path is None or Path(actor_path) == default_coldstart_dir():
        return None
    return actor_path
