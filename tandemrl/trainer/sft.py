"""The supervised cold start on the actor's own machinery (`tandem sft`, commands/sft.py, renders the
demonstrations and calls `train_sft`).

Demonstration samples (token ids with their loss mask, rendered by commands/sft.py) are trained on with token-mean cross-entropy over the model turns
(loss_mask 1; prompt and information blocks 0). The result is an HF directory that RL starts from
(`actor.model.model_path` / `rollout.model.model_path`).
Invariant: SFT uses `Actor.sft_step`, so packing, FSDP, precision and export are those of RL.
Samples are checked against the model (vocabulary, context, a 0/1 mask) before training, and nothing is
exported after a non-finite loss or weights, so a failed cold start keeps the model already there.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

from tandemrl.trainer.batching import TrainSample

log = logging.getLogger(__name__)


RENDERED_FORMAT = '{"input_ids": [...], "loss_mask": [...]}'


@dataclass(frozen=True)
class SampleLimits:
    """What the model can train on: token ids below `vocab_size` (its embedding rows), samples of at most
    `max_tokens` (its `max_position_embeddings`); None: unchecked. `model` names the model in errors."""

    vocab_size: int | None
    max_tokens: int | None
    model: str


def sample_limits(config) -> SampleLimits:
    """The limits of the model the cold start fine-tunes, from its config.json (the weights stay unread)."""
    from tandemrl.host.home import default_model_dir
    from tandemrl.trainer.loading import read_config

    model = str(sft_init_model_path(config) or default_model_dir())
    hf_config = read_config(model)
    text_config = getattr(hf_config, "text_config", None) or hf_config
    return SampleLimits(
        getattr(text_config, "vocab_size", None), getattr(text_config, "max_position_embeddings", None), model
    )


def sample_problem(ids: list[int], mask: list[int], limits: SampleLimits | None) -> str | None:
    """What makes one sample untrainable (a token id outside the vocabulary, a mask value other than 0/1,
    more tokens than the model's context), or None."""
    bad_mask = next(((t, m) for t, m in enumerate(mask) if m not in (0, 1)), None)
    if bad_mask is not None:
        return (
            f"`loss_mask` holds {bad_mask[1]} at position {bad_mask[0]}; each entry must be 0 (prompt, tool "
            "output) or 1 (a model token trained on)"
        )
    if limits is None:
        return None
    if limits.max_tokens is not None and len(ids) > limits.max_tokens:
        return (
            f"the sample has {len(ids)} tokens, more than the context of {limits.model} "
            f"(max_position_embeddings={limits.max_tokens}); shorten or drop it"
        )
    if limits.vocab_size is not None and not 0 <= min(ids) <= max(ids) < limits.vocab_size:
        position, token = next((t, v) for t, v in enumerate(ids) if not 0 <= v < limits.vocab_size)
        return (
            f"`input_ids` holds token id {_bounded(token)} at position {position}, outside the vocabulary of "
            f"{limits.model} (ids 0 to {limits.vocab_size - 1}); render the samples with this model's tokenizer"
        )
    return None


def _bounded(value: int) -> str:
    text = str(value)
    return text if len(text) <= 30 else f"{text[:20]}... ({len(text)} digits)"


def read_rendered(path: str | Path, limits: SampleLimits | None = None) -> list[TrainSample]:
    """The samples of a rendered jsonl, each checked (`sample_problem`); refused when it holds none or
    none has a token to train on, so a cold start never runs (and exports) on nothing."""
    from tandemrl.host.files import InputFileError, is_missing, iter_json_lines

    path = Path(path)
    where = f"actor.sft.rendered_path {str(path)!r}"
    if is_missing(path):
        raise FileNotFoundError(
            f"actor.sft.rendered_path={str(path)!r} does not exist; write a jsonl of "
            f"{RENDERED_FORMAT} or unset it to render the demos."
        )
    samples = []
    for line_number, row in iter_json_lines(path, "actor.sft.rendered_path"):
        ids, mask = row.get("input_ids"), row.get("loss_mask")
        if not _is_int_list(ids) or not _is_int_list(mask) or len(ids) != len(mask) or not ids:
            raise InputFileError(
                f"{where} line {line_number}: needs `input_ids` and `loss_mask`, "
                "non-empty lists of integers of the same length."
            )
        problem = sample_problem(ids, mask, limits)
        if problem is not None:
            raise InputFileError(f"{where} line {line_number}: {problem}.")
        samples.append(TrainSample(ids, mask, [0.0] * len(ids)))
    if not samples:
        raise InputFileError(
            f"{where} holds no sample (it is empty): nothing to train on. Write one {RENDERED_FORMAT} per "
            "line, or unset actor.sft.rendered_path to render the demos."
        )
    if not any(s.num_loss_tokens for s in samples):
        raise InputFileError(
            f"{where}: no sample has a token to train on (a `loss_mask` 1 after the first token); mark the "
            "model's tokens with 1."
        )
    return samples


def _is_int_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def write_rendered(path: Path, samples: list[TrainSample]) -> None:
    """Written aside and renamed into place: an interrupted write leaves the previous file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.writing-{os.getpid()}")
    try:
        with partial.open("w") as f:
            for s in samples:
                f.write(json.dumps({"input_ids": s.input_ids, "loss_mask": s.loss_mask}) + "\n")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def train_sft(config, samples: list[TrainSample]) -> tuple[Path, dict[str, float]]:
    """`actor.sft.num_epochs` passes of shuffled batches of `actor.sft.batch_size`; exports the policy.
    Nothing is exported unless an update was applied and the loss and the weights stayed finite: the
    model already at the output directory is kept (`check_trained`)."""
    from tandemrl.config.derive import actor_setup
    from tandemrl.metrics.logger import MetricsLogger
    from tandemrl.trainer.actor import Actor

    if not samples:
        raise ValueError("train_sft got no samples: there is nothing to train on.")
    sft = config.actor.sft
    config = copy.deepcopy(config)
    config.actor.optim.lr = sft.lr
    config.actor.model.model_path = sft_init_model_path(config)  # None: the embedded SmolLM2
    num_batches = math.ceil(len(samples) / sft.batch_size)
    num_updates = sft.num_epochs * num_batches
    actor = Actor(actor_setup(config, total_updates=num_updates))
    output_dir = Path(config.runner.output_dir)
    logger = MetricsLogger(output_dir / "sft", max_steps=num_updates) if actor.rank == 0 else None
    rng, metrics = random.Random(config.data.seed), {}
    out_dir = sft_out_dir(config)
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
                        num_updates,
                        metrics["train/sft/loss"],
                    )
                check_trained(actor, metrics, sft.lr, out_dir, num_updates)
    finally:
        if logger is not None:
            logger.close()
    check_trained(actor, metrics, sft.lr, out_dir, num_updates, is_final=True)
    actor.export_hf(out_dir)
    return out_dir, metrics


def check_trained(
    actor, metrics: dict[str, float], lr: float, out_dir: Path, num_updates: int, is_final: bool = False
) -> None:
    """Refuse (a `ConfigError`, before anything is exported) a loss that is not finite, and at the end a
    run whose every update was skipped or whose weights are not all finite."""
    from tandemrl.config.errors import ConfigError

    kept = f"nothing was exported and {out_dir} is left as it was"
    loss = metrics.get("train/sft/loss", math.nan)
    if not math.isfinite(loss):
        raise ConfigError(
            f"actor.sft.lr={lr}: the SFT loss became {loss} at update {actor.num_updates}/{num_updates}; "
            f"{kept}. Lower actor.sft.lr, or check the samples."
        )
    if not is_final:
        return
    if actor.num_updates - actor.num_skipped_updates <= 0:
        raise ConfigError(
            f"actor.sft.lr={lr}: every one of the {actor.num_updates} SFT updates was skipped (non-finite "
            f"gradients); {kept}. Lower actor.sft.lr, or check the samples."
        )
    if not _weights_finite(actor):
        raise ConfigError(
            f"actor.sft.lr={lr}: the weights hold NaN or infinite values after {actor.num_updates} SFT "
            f"updates; {kept}. Lower actor.sft.lr."
        )


def _weights_finite(actor) -> bool:
    """Whether every parameter shard of every rank is finite (one collective when sharded)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    is_finite = all(
        bool(torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all())
        for p in actor.policy.parameters()
    )
    if actor.world_size > 1:
        flag = torch.tensor([float(is_finite)], device=actor.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        is_finite = bool(flag.item())
    return is_finite


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
