"""What a run writes about its data each step, under its output directory: the prompt ledger
(`prompts.jsonl`: every issue, finish, drop and hand-off of the rollout buffer) and the trained
trajectories (`trajectories/step_<N>.jsonl`). runner/step.py writes them at the end of a step,
runner/checkpoint.py the ledger again at a save (the ledger up to a checkpoint is what it resumes from).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from tandemrl.buffer.rollout_buffer import HandOff

if TYPE_CHECKING:
    from tandemrl.runner.context import RunContext


def write_ledger(ctx: RunContext, step: int, events: list[dict] | None = None) -> None:
    """Append the buffer's transitions (issued, finished, dropped, trained) of this step to prompts.jsonl:
    `events`, taken from the buffer when the step ended, or those since the last call."""
    if events is None:
        events = ctx.driver.buffer.events()
    with ctx.ledger_path.open("a") as f:
        for event in events:
            f.write(json.dumps({"step": step, **event}) + "\n")


def write_trajectories(ctx: RunContext, step: int, handoff: HandOff) -> None:
    """The trained trajectories of a step, whole, in `trajectories/step_<N>.jsonl` (with their group's
    issue id and version figures), for inspecting what the policy actually did."""
    directory = ctx.output_dir / "trajectories"
    directory.mkdir(exist_ok=True)
    with (directory / f"step_{step}.jsonl").open("w") as f:
        for group in handoff.groups:
            figures = {
                "issue_id": group.issue_id,
                "staleness": group.staleness(handoff.actor_weight_version),
                "version_span": group.version_span(),
                "queue_steps": group.queue_steps(handoff.actor_weight_version),
            }
            for traj in group.trajectories:
                row = traj.to_dict() if hasattr(traj, "to_dict") else dict(vars(traj))
                f.write(json.dumps({"step": step, **figures, **row}) + "\n")
