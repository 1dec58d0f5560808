"""A query group (the `group_size` trajectories of one prompt) and its weight-version arithmetic.

Invariant (docs/DESIGN.md, Rollout buffer): versions come only from tokens the model sampled (`weight_versions` is -1 on
tool/prompt tokens), and every figure is measured against the actor's `weight_version` at the start
of the step that receives the group:
  staleness   = actor weight_version at step start - earliest token version in the group
  version span = latest - earliest token version in the group
  queue steps  = actor weight_version at step start - weight_version when the group finished
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tandemrl.data.loader import Prompt

UNKNOWN_SOURCE = "unknown"  # the metric name of a prompt or trajectory without a data_source


class HasVersions(Protocol):
    """What the buffer needs from a trajectory (the agent's `Trajectory` satisfies it)."""

    weight_versions: list[int]
    reward: float


def version_range(trajectories: Sequence[HasVersions], fallback: int) -> tuple[int, int]:
    """(earliest, latest) weight_version over the sampled tokens of all trajectories of a group.

    A group with no sampled token at all (every trajectory cut before its first token) takes
    `fallback`, the version at which it was issued, so it is never reported fresher than it is.
    """
    versions = [v for traj in trajectories for v in traj.weight_versions if v >= 0]
    if not versions:
        return fallback, fallback
    return min(versions), max(versions)


def has_equal_rewards(trajectories: Sequence[HasVersions]) -> bool:
    """True when every trajectory of the group got the same reward (GRPO advantages would all be 0)."""
    rewards = [float(traj.reward) for traj in trajectories]
    return len(rewards) > 0 and max(rewards) == min(rewards)


@dataclass
class Group:
    """One prompt's group from issue to hand-off. `issue_id` is unique per issue (a prompt comes
    again each epoch, so `prompt_id` alone is not)."""

    issue_id: int
    prompt: Prompt  # the buffer reads only its .prompt_id and .data_source
    task_name: str
    issued_weight_version: int
    issued_at_s: float
    trajectories: list[Any] = field(default_factory=list)
    finished_weight_version: int | None = None
    finished_at_s: float | None = None
    min_weight_version: int | None = None
    max_weight_version: int | None = None

    @property
    def prompt_id(self) -> str:
        return self.prompt.prompt_id

    @property
    def data_source(self) -> str:
        return self.prompt.data_source or UNKNOWN_SOURCE

    def finish(self, trajectories: list[Any], weight_version: int, now_s: float) -> None:
        assert self.finished_at_s is None, f"group {self.issue_id} finished twice"
        self.trajectories = trajectories
        self.finished_weight_version = weight_version
        self.finished_at_s = now_s
        self.min_weight_version, self.max_weight_version = version_range(
            trajectories, fallback=self.issued_weight_version
        )

    def staleness(self, actor_weight_version: int) -> int:
        assert self.min_weight_version is not None, "staleness of an unfinished group"
        return actor_weight_version - self.min_weight_version

    def version_span(self) -> int:
        assert self.min_weight_version is not None and self.max_weight_version is not None
        return self.max_weight_version - self.min_weight_version

    def queue_steps(self, actor_weight_version: int) -> int:
        assert self.finished_weight_version is not None, "queue steps of an unfinished group"
        return actor_weight_version - self.finished_weight_version

    def rewards(self) -> list[float]:
        return [float(traj.reward) for traj in self.trajectories]
