"""Run checkpoints (docs/DESIGN.md, Checkpoints and resume): the actor's own checkpoint plus `data/data.pt`, the loader position.

Invariant: the loader position, the step and the skip count are taken at one instant (no await in
between), so on resume exactly the prompts drawn before the save but not trained or dropped are
skipped: skipped = in-flight + buffered groups + prefetched prompts at save time, logged at every
save. The actor writes the directory atomically, `data/data.pt` included.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tandemrl.config.schema import ConfigError

log = logging.getLogger(__name__)

DATA_FILE = "data/data.pt"


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    """The actor's naming (tandemrl.trainer.checkpoint), so `latest_checkpoint` finds run checkpoints."""
    return Path(output_dir) / "checkpoints" / f"global_step_{step}"


def resume_summary(ctx: Any, step: int) -> dict:
    """The data state of a save: what resuming from it restores and skips."""
    buffer, feed = ctx.driver.buffer, ctx.driver.feed
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
        "num_skipped_on_resume": sum(counts.values()),
    }


async def save_checkpoint(ctx: Any, step: int) -> Path:
    from tandemrl.runner.context import write_ledger

    summary = resume_summary(ctx, step)
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
        "checkpoint step %d saved to %s; resuming from it skips %d prompts issued before the save "
        "(in-flight %d + buffered %d + prefetched %d)",
        step,
        directory,
        summary["num_skipped_on_resume"],
        summary["num_inflight"],
        summary["num_buffered"],
        summary["num_prefetched"],
    )
    return directory


def load_resume_state(resume_from: str) -> dict:
    """`data/data.pt` of a checkpoint directory (plain Python values only, loaded with weights_only)."""
    import torch

    path = Path(resume_from) / DATA_FILE
    if not path.is_file():
        raise ConfigError(
            f"runner.resume_from={resume_from!r}: {path} does not exist, so this is not a tandemrl "
            "checkpoint directory. Point it at <output_dir>/checkpoints/global_step_N."
        )
    return torch.load(path, weights_only=True)
