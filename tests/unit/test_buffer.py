"""Rollout buffer: admission rules, wait fractions, drops, the safety limit and version arithmetic,
driven by a simulated clock and scripted completions."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tandemrl.buffer.group import Group, version_range
from tandemrl.buffer.rollout_buffer import (
    BUFFER_FULL,
    INFLIGHT_LIMIT,
    STALENESS_LIMIT,
    BufferLimits,
    DroppedGroupsLimitError,
    RolloutBuffer,
    TaskBuffer,
)
from tandemrl.config.loader import load_config
from tandemrl.runner.session import buffer_limits


class SimClock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@dataclass
class Prompt:
    prompt_id: str
    data_source: str = "kb_1hop"


@dataclass
class Traj:
    weight_versions: list[int]
    reward: float = 0.0
    extra: dict = field(default_factory=dict)


def make(clock=None, weight_version=0, **kw) -> TaskBuffer:
    args = dict(
        rollout_batch_size=2, max_inflight_groups=10, max_buffered_groups=4, max_dropped_groups_per_step=20
    )
    args.update(kw)
    buf = TaskBuffer("searchr1", BufferLimits(**args), clock or SimClock())
    buf.set_weight_version(weight_version)  # as the driver does when it starts
    return buf


def group_of(versions_per_traj, rewards=None):
    rewards = rewards or [float(i) for i in range(len(versions_per_traj))]
    return [Traj(list(v), r) for v, r in zip(versions_per_traj, rewards, strict=True)]


def test_derived_limits_from_config():
    config = load_config(
        None,
        [
            "data.rollout_batch_size=3",
            "algorithm.group_size=4",
            "rollout.max_running_requests=10",
            "rollout.instances=2",
            "runner.async_mode=true",
            "agentloop.task_name=t",
            "agentloop.max_actor_accept_staleness=2",
            "down_sampling.down_sampling_config.reject_equal_reward=true",
        ],
    )
    limits = buffer_limits(config)
    assert limits.max_inflight_groups == 6  # ceil(10 * 2 * 1.2 / 4)
    assert limits.max_buffered_groups == 6  # 2 x rollout_batch_size
    assert limits.max_dropped_groups_per_step == 30  # 10 x rollout_batch_size
    assert limits.max_staleness == 2 and limits.reject_equal_reward is True
    explicit = load_config(
        None, ["rollout_buffer.max_inflight_groups=5", "rollout_buffer.max_buffered_groups=9"]
    )
    limits = buffer_limits(explicit)
    assert (limits.max_inflight_groups, limits.max_buffered_groups) == (5, 9)
    assert limits.max_head_offpolicyness is None  # the default: admission is not bounded by versions
    head = load_config(
        None,
        [
            "runner.async_mode=true",  # the sync runner refuses the key (it never overlaps)
            "agentloop.task_name=searchr1",
            "rollout_buffer.max_head_offpolicyness=0",
            "rollout_buffer.handoff_order=finish",
        ],
    )
    assert buffer_limits(head).max_head_offpolicyness == 0
    assert buffer_limits(head).handoff_order == "finish" and limits.handoff_order == "issue"


def test_inflight_limit_blocks_until_a_group_returns():
    buf = make(max_inflight_groups=2, max_buffered_groups=10)
    a = buf.issue(Prompt("a"), 0)
    buf.issue(Prompt("b"), 0)
    assert not buf.can_admit() and buf.blocking_limit() == INFLIGHT_LIMIT
    with pytest.raises(AssertionError):
        buf.issue(Prompt("c"), 0)
    buf.finish(a.issue_id, group_of([[0], [0]]), 0)
    assert buf.can_admit() and buf.num_inflight == 1 and buf.num_buffered == 1


def test_buffer_full_limit_counts_inflight_plus_buffered_and_clears_only_on_hand_off():
    buf = make(max_inflight_groups=10, max_buffered_groups=4)
    groups = [buf.issue(Prompt(str(i)), 0) for i in range(4)]
    assert buf.blocking_limit() == BUFFER_FULL
    for g in groups[:3]:
        buf.finish(g.issue_id, group_of([[0], [0]]), 0)
    assert buf.blocking_limit() == BUFFER_FULL  # finishing moves a group from in-flight to buffered
    handoff = buf.take(actor_weight_version=0)
    assert [g.prompt_id for g in handoff.groups] == ["0", "1"]
    assert buf.can_admit() and buf.num_buffered == 1 and buf.num_inflight == 1


def test_both_limits_binding_is_charged_to_buffer_full():
    buf = make(max_inflight_groups=2, max_buffered_groups=2)
    buf.issue(Prompt("a"), 0)
    buf.issue(Prompt("b"), 0)
    assert buf.blocking_limit() == BUFFER_FULL


def test_admission_wait_fractions_of_the_step_window():
    clock = SimClock()
    buf = make(clock, max_inflight_groups=2, max_buffered_groups=4)
    a, b = buf.issue(Prompt("a"), 0), buf.issue(Prompt("b"), 0)  # t=0: in-flight limit binds
    clock.now_s = 3.0
    buf.finish(a.issue_id, group_of([[0], [0]]), 0)
    c = buf.issue(Prompt("c"), 0)  # t=3: in-flight limit binds again
    clock.now_s = 5.0
    buf.finish(b.issue_id, group_of([[0], [0]]), 0)
    buf.issue(Prompt("d"), 0)  # t=5: 2 in flight + 2 buffered = 4: buffer full
    clock.now_s = 9.0
    buf.finish(c.issue_id, group_of([[0], [0]]), 0)  # still full
    clock.now_s = 10.0
    handoff = buf.take(0)
    assert handoff.metrics["rollout/buffer/admission_wait_inflight_limit"] == pytest.approx(0.5)
    assert handoff.metrics["rollout/buffer/admission_wait_buffer_full"] == pytest.approx(0.5)
    # the next window starts at the hand-off; time with admission closed is not charged
    buf.set_admission_open(False)
    clock.now_s = 20.0
    buf.set_admission_open(True)
    clock.now_s = 30.0
    for g in list(buf.inflight.values()):
        buf.finish(g.issue_id, group_of([[0], [0]]), 0)
    handoff = buf.take(0)
    assert handoff.metrics["rollout/buffer/admission_wait_inflight_limit"] == 0.0
    assert handoff.metrics["rollout/buffer/admission_wait_buffer_full"] == pytest.approx(0.0)


def test_wait_fraction_with_closed_admission_is_zero_and_open_time_counts():
    clock = SimClock()
    buf = make(clock, max_inflight_groups=1, max_buffered_groups=4)
    g = buf.issue(Prompt("a"), 0)
    buf.set_admission_open(False)  # t=0..4 closed (e.g. draining for a weight sync)
    clock.now_s = 4.0
    buf.set_admission_open(True)  # t=4..8 open and blocked by the in-flight limit
    clock.now_s = 8.0
    buf.finish(g.issue_id, group_of([[0], [0]]), 0)
    g2 = buf.issue(Prompt("b"), 0)
    buf.finish(g2.issue_id, group_of([[0], [0]]), 0)
    handoff = buf.take(0)
    assert handoff.metrics["rollout/buffer/admission_wait_inflight_limit"] == pytest.approx(0.5)


def test_staleness_drops_at_hand_off_and_on_version_change():
    clock = SimClock()
    buf = make(clock, max_staleness=1, max_buffered_groups=6)
    old = buf.issue(Prompt("old"), 0)
    fresh = [buf.issue(Prompt(f"f{i}"), 2) for i in range(2)]
    buf.finish(old.issue_id, group_of([[0, 1], [1]]), 1)  # earliest token version 0
    for g in fresh:
        buf.finish(g.issue_id, group_of([[2], [2, 3]]), 3)
    handoff = buf.take(actor_weight_version=3)  # old: staleness 3 > 1
    assert [g.prompt_id for g in handoff.groups] == ["f0", "f1"]
    assert [(g.prompt_id, why) for g, why in handoff.dropped] == [("old", "staleness")]
    assert handoff.metrics["rollout/buffer/dropped_groups"] == 1.0
    # drop_stale frees buffer slots as soon as the version moves on
    g = buf.issue(Prompt("x"), 3)
    buf.finish(g.issue_id, group_of([[3], [3]]), 3)
    assert buf.drop_stale(4) == 0 and buf.drop_stale(5) == 1 and buf.num_buffered == 0
    dropped = [e for e in buf.events() if e["event"] == "dropped"]
    assert [(e["prompt_id"], e["reason"]) for e in dropped] == [("old", "staleness"), ("x", "staleness")]


def test_staleness_exactly_at_the_limit_is_kept():
    buf = make(max_staleness=2)
    groups = [buf.issue(Prompt(str(i)), 0) for i in range(2)]
    for g in groups:
        buf.finish(g.issue_id, group_of([[1], [2]]), 2)
    handoff = buf.take(3)
    assert len(handoff.groups) == 2 and handoff.dropped == []


def test_unlimited_staleness_never_drops():
    buf = make(max_staleness=None)
    for i in range(2):
        g = buf.issue(Prompt(str(i)), 0)
        buf.finish(g.issue_id, group_of([[0], [0]]), 0)
    assert buf.drop_stale(1000) == 0
    assert buf.take(1000).metrics["rollout/data_staleness/mean"] == 1000.0


def test_equal_reward_drops_only_when_enabled():
    buf = make(reject_equal_reward=True)
    same = buf.issue(Prompt("same"), 0)
    mixed = buf.issue(Prompt("mixed"), 0)
    buf.finish(same.issue_id, group_of([[0], [0]], rewards=[1.0, 1.0]), 0)
    buf.finish(mixed.issue_id, group_of([[0], [0]], rewards=[0.0, 1.0]), 0)
    assert buf.num_buffered == 1 and buf.can_admit()  # the dropped group frees its slot at once
    keep = make(reject_equal_reward=False)
    g = keep.issue(Prompt("same"), 0)
    keep.finish(g.issue_id, group_of([[0], [0]], rewards=[0.0, 0.0]), 0)
    assert keep.num_buffered == 1
    g2 = buf.issue(Prompt("m2"), 0)
    buf.finish(g2.issue_id, group_of([[0], [0]], rewards=[1.0, 0.0]), 0)
    handoff = buf.take(0)
    assert [(g.prompt_id, why) for g, why in handoff.dropped] == [("same", "equal_reward")]


def test_safety_limit_names_the_limit_and_counts_and_resets_each_hand_off():
    buf = make(reject_equal_reward=True, max_dropped_groups_per_step=2, max_buffered_groups=8)
    for i in range(2):
        g = buf.issue(Prompt(f"eq{i}"), 0)
        buf.finish(g.issue_id, group_of([[0], [0]], rewards=[0.0, 0.0]), 0)
    for i in range(2):
        g = buf.issue(Prompt(f"ok{i}"), 0)
        buf.finish(g.issue_id, group_of([[0], [0]], rewards=[0.0, 1.0]), 0)
    assert len(buf.take(0).dropped) == 2  # at the limit: fine, and the count resets
    for i in range(2):
        g = buf.issue(Prompt(f"again{i}"), 0)
        buf.finish(g.issue_id, group_of([[0], [0]], rewards=[1.0, 1.0]), 0)
    g = buf.issue(Prompt("one-too-many"), 0)
    with pytest.raises(DroppedGroupsLimitError) as error:
        buf.finish(g.issue_id, group_of([[0], [0]], rewards=[1.0, 1.0]), 0)
    message = str(error.value)
    assert "rollout_buffer.max_dropped_groups_per_step=2" in message
    assert "3 groups" in message and "0 for staleness" in message and "3 with equal rewards" in message


def test_version_arithmetic_on_constructed_histories():
    # trajectory 1: tool tokens (-1) between tokens sampled under versions 2 and 3; trajectory 2 under 4
    trajs = [Traj([-1, 2, 2, -1, 3]), Traj([4, -1, 4])]
    assert version_range(trajs, fallback=0) == (2, 4)
    group = Group(0, Prompt("p"), "t", issued_weight_version=2, issued_at_s=0.0)
    group.finish(trajs, weight_version=4, now_s=1.0)
    assert group.staleness(6) == 4 and group.version_span() == 2 and group.queue_steps(6) == 2
    # no sampled token at all: the issue version stands in, never fresher than it is
    empty = Group(1, Prompt("q"), "t", issued_weight_version=1, issued_at_s=0.0)
    empty.finish([Traj([-1, -1])], weight_version=3, now_s=1.0)
    assert empty.staleness(3) == 2 and empty.version_span() == 0


def test_hand_off_metric_means_over_groups():
    buf = make(max_buffered_groups=4)
    a, b = buf.issue(Prompt("a"), 0), buf.issue(Prompt("b"), 1)
    buf.finish(a.issue_id, group_of([[0, 1], [1]]), 1)  # min 0 max 1, finished at 1
    buf.finish(b.issue_id, group_of([[1, 1], [2, 3]]), 3)  # min 1 max 3, finished at 3
    c = buf.issue(Prompt("c"), 3)  # still in flight at hand-off
    m = buf.take(actor_weight_version=4).metrics
    assert m["rollout/data_staleness/mean"] == pytest.approx((4 + 3) / 2)
    assert m["rollout/data_staleness/max"] == 4.0
    assert m["rollout/version_span/mean"] == pytest.approx((1 + 2) / 2)
    assert m["rollout/queue_steps/mean"] == pytest.approx((3 + 1) / 2)
    assert m["rollout/buffer/inflight_groups"] == 1.0 and m["rollout/buffer/size"] == 2.0
    assert [g.prompt_id for g in buf.unfinished_groups()] == ["c"] and c.issue_id in buf.inflight


def test_take_returns_none_until_a_batch_is_buffered():
    buf = make()
    g = buf.issue(Prompt("a"), 0)
    assert buf.take(0) is None
    buf.finish(g.issue_id, group_of([[0], [0]]), 0)
    assert not buf.is_ready() and buf.take(0) is None


def test_every_issued_group_is_accounted_for_exactly_once():
    buf = make(
        reject_equal_reward=True, max_staleness=1, max_buffered_groups=6, max_dropped_groups_per_step=50
    )
    version = 0
    for step in range(6):
        while buf.can_admit():
            buf.issue(Prompt(f"p{step}-{buf.num_inflight}"), version)
        for g in list(buf.inflight.values())[:3]:
            rewards = [1.0, 1.0] if g.issue_id % 5 == 0 else [0.0, 1.0]
            buf.finish(
                g.issue_id, group_of([[max(0, version - g.issue_id % 3)], [version]], rewards), version
            )
        buf.take(version)
        version += 1
    events = buf.events()
    issued = {e["issue_id"] for e in events if e["event"] == "issued"}
    ends = [e["issue_id"] for e in events if e["event"] in ("dropped", "trained")]
    assert len(ends) == len(set(ends))  # nothing trained or dropped twice
    open_ids = {g.issue_id for g in buf.unfinished_groups()}
    assert issued == set(ends) | open_ids and not (set(ends) & open_ids)


def test_per_task_state_is_keyed_by_task_name():
    buffer = RolloutBuffer(BufferLimits(2, 10, 4, 20), SimClock())
    a, b = buffer.task("searchr1"), buffer.task("math")
    assert buffer.task("searchr1") is a and a is not b
    a.issue(Prompt("x"), 0)
    assert a.num_inflight == 1 and b.num_inflight == 0 and buffer.task_names == ["searchr1", "math"]
    assert a.events()[0]["task_name"] == "searchr1"
    with pytest.raises(ValueError, match="agentloop.task_name"):
        buffer.task("")


def finish_all(buf: TaskBuffer, version: int, rewards=(0.0, 1.0)) -> None:
    for g in list(buf.inflight.values()):
        buf.finish(g.issue_id, group_of([[version], [version]], list(rewards)), version)


def test_head_offpolicyness_zero_is_the_sync_schedule():
    """h = 0: one batch per weight version, however roomy the other limits, and a hand-off alone
    (training) does not reopen admission; the weight sync does."""
    buf = make(max_head_offpolicyness=0, max_buffered_groups=8, weight_version=3)
    issued = [buf.issue(Prompt(str(i)), 3) for i in range(2)]
    assert buf.blocking_limit() == STALENESS_LIMIT and buf.staleness_capacity() == 0
    finish_all(buf, 3)
    handoff = buf.take(3)
    assert [g.issue_id for g in handoff.groups] == [g.issue_id for g in issued]
    assert not buf.can_admit() and buf.blocking_limit() == STALENESS_LIMIT  # training: nothing issued
    buf.set_weight_version(4)  # the sync: the next batch, at the new version
    assert buf.staleness_capacity() == 2
    buf.issue(Prompt("2"), 4)
    buf.issue(Prompt("3"), 4)
    assert buf.blocking_limit() == STALENESS_LIMIT


def test_head_offpolicyness_counts_versions_from_the_start_and_lets_dropped_groups_be_replaced():
    buf = make(max_head_offpolicyness=1, max_buffered_groups=8, reject_equal_reward=True, weight_version=5)
    for i in range(4):  # (0 versions + 1 + 1) x 2: two batches ahead of training
        buf.issue(Prompt(str(i)), 5)
    assert buf.blocking_limit() == STALENESS_LIMIT
    first = next(iter(buf.inflight.values()))
    buf.finish(first.issue_id, group_of([[5], [5]], [1.0, 1.0]), 5)  # equal rewards: dropped
    assert buf.staleness_capacity() == 1 and buf.can_admit()  # its slot is given back
    buf.issue(Prompt("replacement"), 5)
    assert buf.blocking_limit() == STALENESS_LIMIT
    buf.set_weight_version(6)
    assert buf.staleness_capacity() == 2


def test_unlimited_head_offpolicyness_never_blocks():
    buf = make(max_buffered_groups=100, max_inflight_groups=100)
    for i in range(50):
        buf.issue(Prompt(str(i)), 0)
    assert buf.staleness_capacity() is None and buf.can_admit()


def test_time_blocked_by_the_staleness_limit_is_its_own_wait_fraction():
    clock = SimClock()
    buf = make(clock, max_head_offpolicyness=0, max_buffered_groups=8)
    buf.issue(Prompt("a"), 0)
    buf.issue(Prompt("b"), 0)  # t=0: the staleness limit binds
    clock.now_s = 4.0
    finish_all(buf, 0)
    handoff = buf.take(0)
    assert handoff.metrics["rollout/buffer/admission_wait_staleness"] == pytest.approx(1.0)
    assert handoff.metrics["rollout/buffer/admission_wait_buffer_full"] == 0.0
    clock.now_s = 6.0  # training, 2 s blocked
    buf.set_weight_version(1)
    buf.issue(Prompt("c"), 1)
    buf.issue(Prompt("d"), 1)
    clock.now_s = 8.0  # generation, 2 s blocked
    finish_all(buf, 1)
    assert buf.take(1).metrics["rollout/buffer/admission_wait_staleness"] == pytest.approx(1.0)


def test_hand_off_lists_groups_in_issue_order_not_finishing_order():
    """Groups of one sync step finish shortest first; handed off in that order, the trainer's contiguous
    minibatches would each hold one length class."""
    buf = make(rollout_batch_size=3, max_buffered_groups=6)
    groups = [buf.issue(Prompt(f"p{i}"), 0) for i in range(4)]
    for g in reversed(groups):  # p3 finishes first, p0 last
        buf.finish(g.issue_id, group_of([[0], [0]]), 0)
    handoff = buf.take(0)
    # the oldest finished three are handed off (p3, p2, p1), listed in issue order
    assert [g.prompt_id for g in handoff.groups] == ["p1", "p2", "p3"]
    trained = [e["prompt_id"] for e in buf.events() if e["event"] == "trained"]
    assert trained == ["p1", "p2", "p3"]
    assert [g.prompt_id for g in buf.buffered] == ["p0"]
    # handoff_order=finish (the ablation of the behaviour before): finishing order
    old = make(rollout_batch_size=3, max_buffered_groups=6, handoff_order="finish")
    groups = [old.issue(Prompt(f"p{i}"), 0) for i in range(4)]
    for g in reversed(groups):
        old.finish(g.issue_id, group_of([[0], [0]]), 0)
    assert [g.prompt_id for g in old.take(0).groups] == ["p3", "p2", "p1"]


def test_hand_off_mix_against_the_mix_issued_in_the_step_window():
    buf = make(rollout_batch_size=2, max_buffered_groups=8)
    one = [buf.issue(Prompt(f"a{i}", "kb_1hop"), 0) for i in range(2)]
    two = [buf.issue(Prompt(f"b{i}", "kb_2hop"), 0) for i in range(2)]
    for g in one:  # the 1-hop groups come back first and fill the hand-off
        buf.finish(g.issue_id, group_of([[0], [0]]), 0)
    m = buf.take(0).metrics
    assert m["rollout/handoff_mix/kb_1hop"] == 1.0 and m["rollout/handoff_mix/kb_2hop"] == 0.0
    assert m["rollout/issued_mix/kb_1hop"] == 0.5 and m["rollout/issued_mix/kb_2hop"] == 0.5
    buf.issue(Prompt("c0", "nq"), 0)  # the next window: one issued, two 2-hop handed off
    for g in two:
        buf.finish(g.issue_id, group_of([[0], [0]]), 0)
    m = buf.take(0).metrics
    assert m["rollout/handoff_mix/kb_2hop"] == 1.0 and m["rollout/handoff_mix/nq"] == 0.0
    assert m["rollout/issued_mix/nq"] == 1.0 and m["rollout/issued_mix/kb_2hop"] == 0.0
    # a source issued earlier but neither issued nor handed off in this window: 0, not missing
    assert m["rollout/handoff_mix/kb_1hop"] == 0.0 and m["rollout/issued_mix/kb_1hop"] == 0.0
