"""`tandem export CHECKPOINT --out DIR`: a checkpoint's policy as a Hugging Face model directory.

Weights are written in float32 (the actor's master precision): a bf16 export would round away updates
smaller than bf16's resolution, which at RL learning rates are most of them.
Invariant: the exported directory loads with `AutoModelForCausalLM.from_pretrained` and its weights
equal the actor's full (unsharded) weights at the checkpoint. It is written beside its place and moved
in whole: an export that fails or is interrupted leaves the model that was there before.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def save_hf_dir(
    state: dict[str, torch.Tensor], hf_config, tokenizer_dir: str | Path | None, out_dir: str | Path
) -> Path:
    """Build the HF model of `hf_config`, load `state` (HF names), save it with the tokenizer files."""
    out = check_replaceable(Path(out_dir))
    staging = out.with_name(f".{out.name}.writing-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        _write_hf_dir(state, hf_config, tokenizer_dir, staging)
        _swap_in(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def check_replaceable(out: Path) -> Path:
    """`out` when an export may replace it: new, empty, or a model directory (a file or a folder of other
    things is never replaced)."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a directory; cannot write a model there.")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise FileExistsError(
            f"{out}: a directory with other files and no model in it; the export replaces its directory "
            "whole, so give a new or empty directory, or one that holds a model to replace."
        )
    return out


def _swap_in(staging: Path, out: Path) -> None:
    """Put the finished `staging` directory at `out`, the old `out` kept until the new one is in place."""
    previous = out.with_name(f".{out.name}.previous-{os.getpid()}")
    if out.exists():
        os.replace(out, previous)
    try:
        os.replace(staging, out)
    except BaseException:
        if previous.exists() and not out.exists():
            os.replace(previous, out)
        raise
    shutil.rmtree(previous, ignore_errors=True)


def _write_hf_dir(
    state: dict[str, torch.Tensor], hf_config, tokenizer_dir: str | Path | None, out: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from tandemrl.trainer.checkpoint import TOKENIZER_FILES

    out.parent.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(hf_config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise ValueError(
            f"export: the weights do not match the model config (missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}); the checkpoint and its actor/hf/config.json "
            "disagree."
        )
    if tied:
        model.tie_weights()
    model.config.dtype = torch.float32
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy2(Path(tokenizer_dir) / name, out / name)


def load_checkpoint_weights(ckpt_dir: str | Path) -> tuple[dict[str, torch.Tensor], object]:
    """Full HF-named weights and the HF config of an actor checkpoint, in this process (no ranks needed)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tandemrl.trainer.checkpoint import dcp_load
    from tandemrl.trainer.checkpoint_check import CheckpointError, verify_checkpoint
    from tandemrl.trainer.policy import PolicyModel

    actor_dir = Path(ckpt_dir) / "actor"
    if not (actor_dir / "hf" / "config.json").is_file():
        raise FileNotFoundError(
            f"{str(ckpt_dir)!r} is not an actor checkpoint (no actor/hf/config.json). Pass "
            "a global_step_N directory, e.g. runs/<name>/checkpoints/global_step_10."
        )
    verify_checkpoint(ckpt_dir, need_data=False)  # whole and safe, before anything is unpickled
    config_path = actor_dir / "hf" / "config.json"
    try:
        hf_config = AutoConfig.from_pretrained(actor_dir / "hf")
        with torch.device("meta"):  # shapes only: a config of absurd sizes allocates nothing
            skeleton = PolicyModel(AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32))
    except Exception as error:  # transformers fails on a bad config in many ways, all of them the file's
        raise CheckpointError(
            f"{config_path} does not describe a model transformers can build ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:200] if str(error) else ''}). Refused; export with the config.json "
            "written at save."
        ) from None
    _check_config_matches_weights(
        {f"model.{k}": tuple(v.shape) for k, v in skeleton.state_dict().items()}, actor_dir
    )
    policy = PolicyModel(AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32))
    state = {"model": policy.state_dict()}
    dcp_load(state, actor_dir)
    policy.load_state_dict(state["model"])
    weights = {name: p.detach() for name, p in policy.hf.named_parameters()}
    return weights, hf_config


def _check_config_matches_weights(expected: dict[str, tuple], actor_dir: Path) -> None:
    """The model `actor/hf/config.json` builds has exactly the tensors, of the same shapes, that the
    checkpoint's weights hold (CheckpointError naming the first difference otherwise)."""
    from tandemrl.trainer.checkpoint_check import CheckpointError, load_dcp_metadata

    with open(actor_dir / ".metadata", "rb") as handle:
        metadata = load_dcp_metadata(handle, str(actor_dir / ".metadata"))
    saved = {
        fqn: tuple(meta.size)
        for fqn, meta in metadata.state_dict_metadata.items()
        if fqn.startswith("model.") and hasattr(meta, "size")
    }
    problems = [f"{k.removeprefix('model.')} is missing from the weights" for k in expected if k not in saved]
    problems += [
        f"{k.removeprefix('model.')} is in the weights but not in the model"
        for k in saved
        if k not in expected
    ]
    problems += [
        f"{k.removeprefix('model.')} is {list(saved[k])} in the weights but {list(shape)} by the config"
        for k, shape in expected.items()
        if k in saved and saved[k] != shape
    ]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(
            f"{actor_dir / 'hf' / 'config.json'} disagrees with the checkpoint's weights: {problems[0]}{more}. "
            "Refused; export with the config.json written at save."
        )


def run_export(args) -> int:
    from tandemrl.trainer.checkpoint_check import CheckpointError

    ckpt = Path(args.checkpoint)
    check_replaceable(Path(args.out))  # before the weights are loaded
    try:
        weights, hf_config = load_checkpoint_weights(ckpt)
    except CheckpointError as error:
        print(f"tandem export: {error}", file=sys.stderr)
        return 2
    out = save_hf_dir(weights, hf_config, ckpt / "actor" / "hf", args.out)
    log.info("exported %s -> %s (%d tensors, float32)", ckpt, out, len(weights))
    print(f"exported {ckpt} -> {out}")
    return 0
