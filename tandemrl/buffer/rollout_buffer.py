"""The rollout buffer: admission of query groups, drops, and hand-off of finished groups to the actor.

Invariants (docs/DESIGN.md, Rollout buffer):
- a group is issued only while in-flight < max_inflight_groups and in-flight + buffered <
  max_buffered_groups, and, with max_head_offpolicyness h, while the groups issued and not dropped
  stay within (weight versions since the start + 1 + h) x rollout_batch_size (AReaL's staleness
  control): at h = 0 exactly the sync runner's schedule, one batch per weight version;
- every issued group ends in exactly one of: handed off (trained), dropped (stale or equal rewards),
  or still in flight / buffered; `events()` records each transition so a run can account for it;
- the time admission wanted to issue but a limit said no is charged to that limit, and reported as a
  fraction of the step window (the time between two hand-offs);
- a hand-off lists its groups in issue order (the loader's), whatever order they finished in: the
  trainer cuts minibatches as contiguous slices, and finishing order would sort them by length.

Pure Python with an injected clock, so every rule is unit-tested with a simulated clock. Per-task
state (one `TaskBuffer` per `agentloop.task_name`) lives in `RolloutBuffer`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandemrl.buffer.group import Group, has_equal_rewards

if TYPE_CHECKING:
    from tandemrl.data.loader import Prompt

INFLIGHT_LIMIT = "inflight_limit"
BUFFER_FULL = "buffer_full"
STALENESS_LIMIT = "staleness"  # rollout_buffer.max_head_offpolicyness
DROP_STALENESS = "staleness"
DROP_EQUAL_REWARD = "equal_reward"


class DroppedGroupsLimitError(RuntimeError):
    """More groups were dropped between two hand-offs than rollout_buffer.max_dropped_groups_per_step."""


@dataclass(frozen=True)
class BufferLimits:
    rollout_batch_size: int
    max_inflight_groups: int
    max_buffered_groups: int
    max_dropped_groups_per_step: int
    max_staleness: int | None = None  # agentloop.max_actor_accept_staleness; None: unlimited
    reject_equal_reward: bool = False
    max_head_offpolicyness: int | None = None  # rollout_buffer.max_head_offpolicyness; None: unlimited
    handoff_order: str = "issue"  # rollout_buffer.handoff_order: issue | finish

    def __post_init__(self):
        assert self.max_buffered_groups >= self.rollout_batch_size, "validated by config.derive"


@dataclass
class HandOff:
    """`rollout_batch_size` groups for one training step, and what happened in the step window."""

    actor_weight_version: int
    groups: list[Group]
    dropped: list[tuple[Group, str]]
    metrics: dict[str, float] = field(default_factory=dict)


class TaskBuffer:
    """Admission, drops and hand-off for one task (one `agentloop.task_name`)."""

    def __init__(self, task_name: str, limits: BufferLimits, clock: Callable[[], float] = time.monotonic):
        self.task_name = task_name
        self.limits = limits
        self._clock = clock
        self._next_issue_id = 0
        self._num_dropped = 0  # since the start: dropped groups give their admission slot back
        self._weight_version: int | None = None  # the engines' version (`set_weight_version`)
        self._first_weight_version: int | None = None
        self.inflight: dict[int, Group] = {}
        self.buffered: list[Group] = []  # finished, in finishing order
        self._dropped_in_window: list[tuple[Group, str]] = []
        self._issued_sources_in_window: list[str] = []
        self._sources_seen: set[str] = set()  # every data source issued so far: each gets a mix every step
        self._events: list[dict] = []
        self._is_admission_open = True
        self._last_tick_s = clock()
        self._window_start_s = self._last_tick_s
        self._wait_s = {INFLIGHT_LIMIT: 0.0, BUFFER_FULL: 0.0, STALENESS_LIMIT: 0.0}

    # ---- admission -------------------------------------------------------------------------------
    @property
    def num_inflight(self) -> int:
        return len(self.inflight)

    @property
    def num_buffered(self) -> int:
        return len(self.buffered)

    def set_weight_version(self, weight_version: int) -> None:
        """The version the engines hold now: the driver calls this when it starts and after every weight
        sync. The staleness limit of admission counts the versions since the first call."""
        if self._first_weight_version is None:
            self._first_weight_version = weight_version
        else:
            self._tick()  # the time until now is charged under the old version's limits
        self._weight_version = weight_version

    def staleness_capacity(self) -> int | None:
        """Groups `max_head_offpolicyness` still lets issue now (None: no such limit).

        AReaL's rule: (weight versions since the start + 1 + h) x rollout_batch_size groups may be issued
        and not dropped. A group issued under it is among the first (v + 1 + h) batches, so it is trained
        by version v + h: the head of the stream is at most h versions stale (a slow group can still
        fall behind; `agentloop.max_actor_accept_staleness` drops those). Dropped groups give their slot
        back, as the sync runner replaces a dropped group within its step.
        """
        head = self.limits.max_head_offpolicyness
        if head is None:
            return None
        assert self._weight_version is not None, "set_weight_version before admission"
        num_versions = self._weight_version - self._first_weight_version
        allowed = (num_versions + 1 + head) * self.limits.rollout_batch_size
        return allowed - (self._next_issue_id - self._num_dropped)

    def blocking_limit(self) -> str | None:
        """The limit that forbids issuing now, or None. When several bind, the one that takes longest to
        clear is named: the staleness limit (only a weight sync clears it), then buffer full (only a
        hand-off clears it, finishing groups cannot), then the in-flight limit."""
        capacity = self.staleness_capacity()
        if capacity is not None and capacity <= 0:
            return STALENESS_LIMIT
        if self.num_inflight + self.num_buffered >= self.limits.max_buffered_groups:
            return BUFFER_FULL
        if self.num_inflight >= self.limits.max_inflight_groups:
            return INFLIGHT_LIMIT
        return None

    def can_admit(self) -> bool:
        return self._is_admission_open and self.blocking_limit() is None

    def set_admission_open(self, is_open: bool) -> None:
        """Open: the runner wants to issue (it has prompts and is not draining for a weight sync).
        Time blocked by a limit is only charged while admission is open."""
        self._tick()
        self._is_admission_open = is_open

    def issue(self, prompt: Prompt, weight_version: int) -> Group:
        self._tick()
        assert self.can_admit(), f"issue while admission is closed ({self.blocking_limit()})"
        group = Group(self._next_issue_id, prompt, self.task_name, weight_version, self._last_tick_s)
        self._next_issue_id += 1
        self.inflight[group.issue_id] = group
        self._issued_sources_in_window.append(group.data_source)
        self._sources_seen.add(group.data_source)
        self._record("issued", group)
        return group

    # ---- completion and drops ---------------------------------------------------------------------
    def finish(self, issue_id: int, trajectories: list[Any], weight_version: int) -> Group:
        """A group's trajectories are all done; `weight_version` is the one in the engines now."""
        self._tick()
        group = self.inflight.pop(issue_id)
        group.finish(trajectories, weight_version, self._last_tick_s)
        if self.limits.reject_equal_reward and has_equal_rewards(trajectories):
            self._drop(group, DROP_EQUAL_REWARD)
        else:
            self.buffered.append(group)
            self._record("finished", group)
        return group

    def drop_stale(self, actor_weight_version: int) -> int:
        """Drop buffered groups already staler than allowed; versions only grow, so they could never
        be trained. Called at every version change, so their slots are freed for admission early."""
        max_staleness = self.limits.max_staleness
        if max_staleness is None:
            return 0
        self._tick()
        stale = [g for g in self.buffered if g.staleness(actor_weight_version) > max_staleness]
        for group in stale:
            self.buffered.remove(group)
            self._drop(group, DROP_STALENESS)
        return len(stale)

    def _drop(self, group: Group, reason: str) -> None:
        self._num_dropped += 1
        self._dropped_in_window.append((group, reason))
        self._record("dropped", group, reason=reason)
        limit = self.limits.max_dropped_groups_per_step
        if len(self._dropped_in_window) > limit:
            counts = {
                r: sum(1 for _, why in self._dropped_in_window if why == r)
                for r in (DROP_STALENESS, DROP_EQUAL_REWARD)
            }
            raise DroppedGroupsLimitError(
                f"rollout_buffer.max_dropped_groups_per_step={limit} exceeded: "
                f"{len(self._dropped_in_window)} groups of task {self.task_name!r} were dropped since the "
                f"last hand-off ({counts[DROP_STALENESS]} for staleness > "
                f"agentloop.max_actor_accept_staleness={self.limits.max_staleness}, "
                f"{counts[DROP_EQUAL_REWARD]} with equal rewards under reject_equal_reward="
                f"{self.limits.reject_equal_reward}). Rollouts are being wasted faster than they are "
                "trained: raise agentloop.max_actor_accept_staleness, lower rollout_buffer.max_buffered_groups, "
                "disable down_sampling.down_sampling_config.reject_equal_reward, or raise the limit."
            )

    # ---- hand-off ----------------------------------------------------------------------------------
    def is_ready(self) -> bool:
        return self.num_buffered >= self.limits.rollout_batch_size

    def take(self, actor_weight_version: int) -> HandOff | None:
        """Hand off the oldest `rollout_batch_size` finished groups (after staleness drops), listed in
        issue order (`handoff_order=finish`: in finishing order, as before issue 27), or None when not
        enough are buffered. Closes the step window and returns its metrics."""
        self.drop_stale(actor_weight_version)
        if not self.is_ready():
            return None
        self._tick()
        num_buffered_before = self.num_buffered
        groups = self.buffered[: self.limits.rollout_batch_size]
        if self.limits.handoff_order == "issue":
            groups = sorted(groups, key=lambda g: g.issue_id)
        del self.buffered[: self.limits.rollout_batch_size]
        for group in groups:
            self._record("trained", group)
        dropped, self._dropped_in_window = self._dropped_in_window, []
        metrics = self._window_metrics(groups, actor_weight_version, num_buffered_before, len(dropped))
        metrics.update(source_mix(groups, self._issued_sources_in_window, self._sources_seen))
        self._issued_sources_in_window = []
        self._window_start_s = self._last_tick_s
        self._wait_s = {INFLIGHT_LIMIT: 0.0, BUFFER_FULL: 0.0, STALENESS_LIMIT: 0.0}
        return HandOff(actor_weight_version, groups, dropped, metrics)

    def _window_metrics(
        self, groups: list[Group], version: int, num_buffered: int, num_dropped: int
    ) -> dict[str, float]:
        """In-flight count after the hand-off, buffer size just before it (the batch included)."""
        window_s = self._last_tick_s - self._window_start_s
        num = len(groups)
        return {
            "rollout/buffer/inflight_groups": float(self.num_inflight),
            "rollout/buffer/size": float(num_buffered),
            "rollout/buffer/admission_wait_inflight_limit": _fraction(self._wait_s[INFLIGHT_LIMIT], window_s),
            "rollout/buffer/admission_wait_buffer_full": _fraction(self._wait_s[BUFFER_FULL], window_s),
            "rollout/buffer/admission_wait_staleness": _fraction(self._wait_s[STALENESS_LIMIT], window_s),
            "rollout/buffer/dropped_groups": float(num_dropped),
            "rollout/data_staleness/mean": sum(g.staleness(version) for g in groups) / num,
            "rollout/data_staleness/max": float(max(g.staleness(version) for g in groups)),
            "rollout/version_span/mean": sum(g.version_span() for g in groups) / num,
            "rollout/queue_steps/mean": sum(g.queue_steps(version) for g in groups) / num,
        }

    # ---- clock and ledger --------------------------------------------------------------------------
    def _tick(self) -> None:
        """Charge the time since the last state change to the limit that blocked admission then."""
        now = self._clock()
        blocked_by = self.blocking_limit() if self._is_admission_open else None
        if blocked_by is not None:
            self._wait_s[blocked_by] += now - self._last_tick_s
        self._last_tick_s = now

    def _record(self, event: str, group: Group, **extra: Any) -> None:
        self._events.append(
            {
                "event": event,
                "task_name": self.task_name,
                "issue_id": group.issue_id,
                "prompt_id": group.prompt_id,
                **extra,
            }
        )

    def events(self) -> list[dict]:
        """The transitions since the last call (issued, finished, dropped, trained), oldest first."""
        events, self._events = self._events, []
        return events

    def unfinished_groups(self) -> list[Group]:
        """Issued but not trained nor dropped: what a checkpoint taken now would skip on resume."""
        return list(self.inflight.values()) + list(self.buffered)


def _fraction(part_s: float, window_s: float) -> float:
    return min(1.0, part_s / window_s) if window_s > 0 else 0.0


def source_mix(groups: list[Group], issued_sources: list[str], known_sources: set[str]) -> dict[str, float]:
    """`rollout/handoff_mix/<data_source>` (fraction of the hand-off's groups) against
    `rollout/issued_mix/<data_source>` (fraction of the groups issued in the step window), for every
    source issued so far (0 where absent). A hand-off that favours fast (short) questions shows as a gap."""
    handed = [g.data_source for g in groups]
    metrics = {}
    for source in sorted(known_sources | set(handed)):
        metrics[f"rollout/handoff_mix/{source}"] = handed.count(source) / len(handed) if handed else 0.0
        metrics[f"rollout/issued_mix/{source}"] = (
            issued_sources.count(source) / len(issued_sources) if issued_sources else 0.0
        )
    return metrics


class RolloutBuffer:
    """Per-task state keyed by `agentloop.task_name`; each task gets its own limits and window."""

    def __init__(self, limits: BufferLimits, clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self._clock = clock
        self._tasks: dict[str, TaskBuffer] = {}

    def task(self, task_name: str) -> TaskBuffer:
        if not task_name:
            raise ValueError("a rollout buffer task needs a name: set agentloop.task_name, e.g. searchr1.")
        if task_name not in self._tasks:
            self._tasks[task_name] = TaskBuffer(task_name, self.limits, self._clock)
        return self._tasks[task_name]

    @property
    def task_names(self) -> list[str]:
        return list(self._tasks)
