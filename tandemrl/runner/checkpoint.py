"""Run checkpoints (docs/DESIGN.md, Checkpoints and resume): the actor's own checkpoint plus `data/data.pt`,
the loader position and the open prompts.

Invariant: the loader position, the step and the open prompts (drawn before the save but not trained
or dropped: in-flight + buffered groups + prefetched prompts) are taken at one instant (no await in
between). On resume the open prompts are issued first, before the loader's next one
(`runner.reissue_on_resume`, the default), or skipped until the loader's next epoch; either way one
log line says how many. The actor writes the directory atomically, `data/data.pt` included.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandemrl.config.schema import ConfigError

if TYPE_CHECKING:
    from tandemrl.runner.context import RunContext

log = logging.getLogger(__name__)

DATA_FILE = "data/data.pt"


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    """The actor's naming (tandemrl.trainer.checkpoint), so `latest_checkpoint` finds run checkpoints."""
    return Path(output_dir) / "checkpoints" / f"global_step_{step}"


def resume_summary(ctx: RunContext, step: int) -> dict:
    """The data state of a save: what resuming from it restores and re-issues (or skips)."""
    buffer, feed = ctx.driver.buffer, ctx.driver.feed
    open_groups = sorted(buffer.unfinished_groups(), key=lambda group: group.issue_id)
    counts = {
        "num_inflight": buffer.num_inflight,
        "num_buffered": buffer.num_buffered,
        "num_prefetched": feed.num_prefetched,
    }
    return {
        "step": step,
        "weight_version": ctx.weight_version,
        "loader": feed.loader_state(),
        "loader_position": list(feed.position()),
        **counts,
        "num_skipped_on_resume": sum(counts.values()),  # the open prompts (name kept for old checkpoints)
        "open_prompt_ids": [g.prompt_id for g in open_groups] + [p.prompt_id for p in feed.prefetched()],
    }


def resume_prompts(state: dict, prompts_by_id: dict[str, Any], reissue: bool, resume_from: str) -> list[Any]:
    """The prompts to issue first after resuming from `state` (none when skipping); logs one line."""
    num_open = int(state["num_skipped_on_resume"])
    where = (
        f"resuming from {resume_from} at step {state['step']}: {num_open} prompts were open at the save "
        f"(in-flight {state['num_inflight']} + buffered {state['num_buffered']} + prefetched "
        f"{state['num_prefetched']})"
    )
    open_ids = state.get("open_prompt_ids")
    if not reissue or open_ids is None:
        why = "runner.reissue_on_resume=false" if reissue is False else "the checkpoint predates re-issue"
        log.info("%s; 0 prompts re-issued, %d skipped until the next epoch (%s)", where, num_open, why)
        return []
    missing = [prompt_id for prompt_id in open_ids if prompt_id not in prompts_by_id]
    if missing:
        raise ConfigError(
            f"runner.resume_from={resume_from!r}: prompts {missing[:3]} of the checkpoint are not in "
            "data.train_data_paths. Resume with the original training data, or set "
            "runner.reissue_on_resume=false to skip the open prompts."
        )
    log.info("%s; %d prompts re-issued", where, len(open_ids))
    return [prompts_by_id[prompt_id] for prompt_id in open_ids]


async def save_checkpoint(ctx: RunContext, step: int, row: dict[str, float] | None = None) -> Path:
    """`row`: the step's metrics so far (its row is logged once the save is timed); a resume writes it
    if the run was killed before the row was (`restore_row`)."""
    from tandemrl.runner.records import write_ledger

    summary = resume_summary(ctx, step)
    if row is not None:
        summary[ROW_KEY] = {key: float(value) for key, value in row.items() if value is not None}
    write_ledger(ctx, step)  # the ledger up to this line is what the saved position covers
    with ctx.ledger_path.open("a") as f:
        f.write(
            json.dumps(
                {
                    "step": step,
                    "event": "checkpoint",
                    "loader_position": summary["loader_position"],
                    "num_skipped_on_resume": summary["num_skipped_on_resume"],
                }
            )
            + "\n"
        )
    directory = checkpoint_dir(ctx.output_dir, step)
    await ctx.actor.call("save_checkpoint", str(directory), {DATA_FILE: summary})
    log.info(
        "checkpoint step %d saved to %s; %d prompts are open at the save "
        "(in-flight %d + buffered %d + prefetched %d)",
        step,
        directory,
        summary["num_skipped_on_resume"],
        summary["num_inflight"],
        summary["num_buffered"],
        summary["num_prefetched"],
    )
    return directory


ROW_KEY = "metrics_row"  # in a checkpoint's data: its step's metrics as they stood before the save
RESTORED_METRIC = "runner/row_restored"  # 1.0 on a row a resume wrote from its checkpoint


def restore_row(logger, state: dict) -> bool:
    """After resuming from the checkpoint `state` into a metrics.jsonl that has the steps before it but not
    its own row (the run was killed between the save and the row), write the row the save kept, marked
    with `RESTORED_METRIC` (its `time/step` ends where the save began; it has no `time/checkpoint`). Returns
    whether it wrote one."""
    from tandemrl.metrics.logger import read_history

    step, row = int(state["step"]), state.get(ROW_KEY)
    history = read_history(logger.jsonl_path)
    if not row or not history or any(r["step"] == step for r in history):
        return False
    if max(r["step"] for r in history) > step:  # resumed from an older checkpoint: its row is there or was
        return False
    logger.log(step, {**row, RESTORED_METRIC: 1.0}, advance=False)
    log.warning(
        "the row of step %d was missing from %s (a kill after its checkpoint): written from the checkpoint",
        step,
        logger.jsonl_path,
    )
    return True


def load_resume_state(resume_from: str) -> dict:
    """`data/data.pt` of a checkpoint directory (plain Python values only, loaded with weights_only)."""
    from tandemrl.trainer.checkpoint import load_plain
    from tandemrl.trainer.checkpoint_check import CheckpointError

    path = Path(resume_from) / DATA_FILE
    if not path.is_file():
        raise ConfigError(
            f"runner.resume_from={resume_from!r}: {path} does not exist, so this is not a tandemrl "
            "checkpoint directory. Point it at <output_dir>/checkpoints/global_step_N."
        )
    try:
        return load_plain(path, str(path))
    except CheckpointError as error:
        raise ConfigError(f"runner.resume_from={resume_from!r}: {error}") from None
