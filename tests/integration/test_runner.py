"""The runners end to end on CPU: real embedded engine process, real retrieval server, real actor with a
tiny 2-layer model, weight sync over gloo. Checks every metric of docs/DESIGN.md (Metrics) in the TensorBoard files, that
async staleness >= 1 occurs, that every prompt is accounted for, and each pause mode."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tandemrl.buffer.rollout_buffer import DroppedGroupsLimitError
from tandemrl.commands.train import train
from tandemrl.config.loader import load_config
from tandemrl.metrics.logger import read_history, read_tensorboard_scalars
from tandemrl.metrics.plots import load_run, overlay_runs
from tandemrl.runner.services import EngineDiedError
from tests.integration.runner_helpers import (
    DESIGN_METRICS,
    STEP_TIME_METRICS,
    account,
    check_startup_timeline,
    check_wall_clock,
    read_ledger,
    small_kb_once,
    tiny_overrides,
)


@pytest.fixture(scope="module")
def small_kb(tmp_path_factory, minilm_dir):
    return small_kb_once(tmp_path_factory, minilm_dir)


def run(tmp_path, tiny_llama_dir, small_kb, *overrides):
    kb_dir, index_dir = small_kb
    config = load_config(
        None, tiny_overrides(tiny_llama_dir, kb_dir, index_dir, tmp_path / "run") + list(overrides)
    )
    return config, train(config)


def check_run(config, ctx, expect_stale: bool, overlapped_steps: tuple[int, ...] = ()):
    """`overlapped_steps`: validations that ran beside the next step (runner.val_interval=2 validates at
    steps 2 and 4; the last step's runs in its own step)."""
    output_dir = config.runner.output_dir
    scalars = read_tensorboard_scalars(f"{output_dir}/tensorboard")
    missing = [m for m in DESIGN_METRICS if m not in scalars]
    assert not missing, f"metrics missing from TensorBoard: {missing}"
    assert [step for step, _ in scalars["time/step"]] == [1, 2, 3, 4]
    check_step_times(scalars)
    # the last step validates and saves in its own time
    check_wall_clock(scalars, validated_steps=[4], saved_steps=[4], overlapped_steps=overlapped_steps)
    # every validation scored its own step's weights, also one that ran on beside the next step
    val_steps = sorted({*overlapped_steps, 4} | ({0} if config.runner.val_before_train else set()))
    for name in ("val/weight_version/min", "val/weight_version/max"):
        assert scalars[name] == [(step, float(step)) for step in val_steps], (name, scalars[name])
    # one row per step, in step order, each step's val metrics in it
    rows = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "time/step" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in rows] == sorted(r["step"] for r in rows)
    assert [r["step"] for r in rows if "val/em/all" in r] == val_steps
    # the retrieval server's load per step window, read from its /health counters (runner/step_metrics.py)
    # (the tiny random policy may never search, so the counts may be 0; the unit test of /health counts them)
    assert [step for step, _ in scalars["retrieval/queries"]] == [1, 2, 3, 4]
    searches = sum(v for _, v in scalars["rollout/num_searches/mean"]) > 0
    assert (sum(v for _, v in scalars["retrieval/queries"]) > 0) >= searches  # a search was a query there
    assert all(0 <= v <= 1 for _, v in scalars["retrieval/busy_fraction"])
    for (_, wall), (_, generate), (_, server) in zip(
        scalars["rollout/traj/wall_s"],
        scalars["rollout/traj/generate_s"],
        scalars["rollout/traj/server_s"],
        strict=True,
    ):
        assert 0 < server <= generate <= wall  # the embedded server reports its own time (e2e_latency)
    plotted = overlay_runs([load_run(output_dir)], Path(output_dir) / "overlay")  # as `tandem plot` does
    updates = next(iter(plotted["reward_vs_updates"].values()))[0]
    assert len(updates) == 4 and updates == sorted(updates) and updates[0] > 0
    assert any(k.startswith("val/em/kb_") for k in scalars)  # per data source
    assert all(v == 4.0 for _, v in scalars["rollout/total_num_sequence"])  # 2 groups x 2 trajectories
    staleness = [v for _, v in scalars["rollout/data_staleness/mean"]]
    if expect_stale:
        assert max(staleness) >= 1.0, staleness
    else:
        assert staleness == [0.0] * 4, staleness
    ledger = read_ledger(output_dir)
    unfinished = {g.issue_id for g in ctx.driver.buffer.unfinished_groups()}
    sets = account(ledger, unfinished)
    assert len(sets["trained"]) == 8
    assert len(sets["trained_prompts"]) == len(set(sets["trained_prompts"]))  # no prompt trained twice
    assert ctx.weight_version == 4
    rows = [
        json.loads(line)
        for line in (Path(output_dir) / "trajectories" / "step_4.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 4 and all(len(r["response_ids"]) == len(r["weight_versions"]) for r in rows)
    return scalars, sets


def check_step_times(scalars: dict) -> None:
    """The step-time breakdown is logged every step, its sync parts add up, the busy fraction is one."""
    for name in STEP_TIME_METRICS:
        assert [step for step, _ in scalars[name]] == [1, 2, 3, 4], name
    parts = [scalars[f"time/sync_weights/{p}"] for p in ("pause", "push", "continue")]
    for k, (_, total) in enumerate(scalars["time/sync_weights"]):
        assert sum(part[k][1] for part in parts) == pytest.approx(total, abs=1e-4)
    for (_, step_s), (_, wait_s), (_, train_s) in zip(
        scalars["time/step"], scalars["time/wait_data"], scalars["time/train"], strict=True
    ):
        assert 0 <= wait_s and 0 < train_s and wait_s + train_s <= step_s
    busy = [v for _, v in scalars["rollout/engine_busy_fraction"]]
    assert all(0.0 < v <= 1.0 for v in busy), busy  # the engine generated in every step
    for (_, late_s), (_, stalled_s), (_, step_s) in zip(
        scalars["driver/loop_late_s"], scalars["driver/loop_stalled_s"], scalars["time/step"], strict=True
    ):
        assert (
            0 <= stalled_s <= step_s + 0.05 and 0 <= late_s
        )  # the step's window (one watcher tick over at most)


def test_async_runner_retract_end_to_end(tmp_path, tiny_llama_dir, small_kb):
    config, ctx = run(
        tmp_path,
        tiny_llama_dir,
        small_kb,
        "runner.async_mode=true",
        "rollout.pause_mode=retract",
        "runner.val_before_train=true",
        "runner.val_interval=2",  # step 2's validation runs beside step 3 (runner.overlap_validation)
    )
    scalars, sets = check_run(config, ctx, expect_stale=True, overlapped_steps=(2,))
    # val_before_train: the starting val EM is a row of its own at step 0, before any rollout
    rows = read_history(tmp_path / "run" / "metrics.jsonl")
    assert rows[0]["step"] == 0 and "val/em/all" in rows[0] and "time/step" not in rows[0]
    assert [r["step"] for r in rows[1:]] == [1, 2, 3, 4]
    print(
        "staleness per step:",
        [v for _, v in scalars["rollout/data_staleness/mean"]],
        "trained groups:",
        len(sets["trained"]),
        "issued:",
        len(sets["issued"]),
        "unfinished at stop:",
        len(sets["issued"]) - len(sets["trained"]) - len(sets["dropped"]),
    )
    assert (tmp_path / "run" / "checkpoints" / "global_step_4" / "data" / "data.pt").is_file()
    check_startup_timeline(tmp_path / "run", ray=False)


@pytest.mark.slow
@pytest.mark.parametrize("pause_mode", ["in_place", "drain"])
def test_async_runner_other_pause_modes(tmp_path, tiny_llama_dir, small_kb, pause_mode):
    config, ctx = run(
        tmp_path,
        tiny_llama_dir,
        small_kb,
        "runner.async_mode=true",
        f"rollout.pause_mode={pause_mode}",
        "agentloop.max_actor_accept_staleness=1",
    )
    scalars, sets = check_run(config, ctx, expect_stale=True)
    assert max(v for _, v in scalars["rollout/data_staleness/max"]) <= 1.0  # staler groups were dropped
    print(f"{pause_mode}: dropped {len(sets['dropped'])} stale groups, trained {len(sets['trained'])}")


def test_equal_reward_drops_hit_the_safety_limit_and_fail_the_run(
    tmp_path, tiny_llama_dir, small_kb, refused_addr
):
    """A random tiny model never answers right: every group has equal (zero) rewards and is dropped.
    No retrieval server: a search is refused and reaches the agent as an error."""
    kb_dir, index_dir = small_kb
    overrides = tiny_overrides(tiny_llama_dir, kb_dir, index_dir, tmp_path / "run") + [
        "runner.async_mode=true",
        "runner.val_interval=0",
        "retrieval.launch=false",
        f"tools.search.server_addr={refused_addr}",
        "down_sampling.down_sampling_config.reject_equal_reward=true",
        "rollout_buffer.max_dropped_groups_per_step=3",
    ]
    with pytest.raises(DroppedGroupsLimitError) as error:
        train(load_config(None, overrides), write_plots=False)
    message = str(error.value)
    assert "rollout_buffer.max_dropped_groups_per_step=3 exceeded: 4 groups" in message
    assert "4 with equal rewards" in message
    dropped = [e for e in read_ledger(tmp_path / "run") if e["event"] == "dropped"]
    assert len(dropped) == 4 and all(e["reason"] == "equal_reward" for e in dropped)


def test_sync_runner_has_zero_staleness(tmp_path, tiny_llama_dir, small_kb):
    """Also the sync half of the honest clock's test (check_run): it validates and saves at step 4, and
    its batches generate while it does."""
    config, ctx = run(tmp_path, tiny_llama_dir, small_kb, "runner.async_mode=false", "runner.val_interval=2")
    check_run(config, ctx, expect_stale=False, overlapped_steps=(2,))


def _engine_pids() -> list[int]:
    """Child processes of this test running the embedded engine (`tandem serve-engine`)."""
    me, pids = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            cmdline = open(f"/proc/{entry}/cmdline").read()
        except OSError:
            continue
        if int(stat[1]) == me and "serve-engine" in cmdline:
            pids.append(int(entry))
    return pids


def test_a_dead_engine_stops_the_run_within_seconds_naming_it(
    tmp_path, tiny_llama_dir, small_kb, refused_addr
):
    kb_dir, index_dir = small_kb
    overrides = tiny_overrides(tiny_llama_dir, kb_dir, index_dir, tmp_path / "run") + [
        "runner.async_mode=true",
        "runner.max_steps=50",
        "runner.val_interval=0",
        "retrieval.launch=false",
        f"tools.search.server_addr={refused_addr}",
    ]
    config = load_config(None, overrides)
    killed_at = {}

    def kill_after_first_step():
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.2)
        for pid in _engine_pids():
            os.kill(pid, signal.SIGKILL)
            killed_at["t"] = time.monotonic()

    killer = threading.Thread(target=kill_after_first_step, daemon=True)
    killer.start()
    with pytest.raises(EngineDiedError, match=r"rollout engine 0 at http://127\.0\.0\.1:\d+ died") as error:
        train(config, write_plots=False)
    stopped_s = time.monotonic() - killed_at["t"]
    print(f"engine killed -> run stopped in {stopped_s:.1f}s: {error.value}")
    # "died" comes from the watchdog's process check (every runner.engine_health_interval_s = 1 s), not
    # from a request timing out (600 s); the bound only tells the two apart, so a busy machine passes it
    assert stopped_s < 60.0


@pytest.mark.parametrize(
    "attention",
    # auto's check also ends every run of test_recipe_segments.py; varlen met the H100's error (docs/RELIABILITY.md 27)
    [pytest.param("auto", marks=pytest.mark.slow), "varlen"],
)
def test_weights_check_after_the_last_sync(tmp_path, tiny_llama_dir, small_kb, attention):
    """runner.weights_check_tokens: with the rollout stopped after the last push, the engine's greedy
    output on the probe prompts is the actor's under the weights it pushed (the embedded engine and the
    actor run the same fp32 model on CPU: token for token). varlen: the H100 recipe's actor ran
    `tandem_varlen` attention, and the scoring forward raised for want of the packed row's boundaries
    (docs/RELIABILITY.md row 27); on CPU `actor.attn_implementation=varlen` takes the same interface (its
    reference path), so the check runs here end to end."""
    config, ctx = run(
        tmp_path,
        tiny_llama_dir,
        small_kb,
        "runner.async_mode=true",
        "runner.max_steps=2",
        "runner.val_interval=0",
        "runner.weights_check_tokens=6",
        f"actor.attn_implementation={attention}",
        "actor.optim.lr=1.0e-2",
    )
    report = json.loads((Path(config.runner.output_dir) / "weights_check.json").read_text())
    assert report["weights_check"] is True and report["weight_version"] == ctx.weight_version == 2
    assert [len(ids) for ids in report["engines"][0]] == [6] * 4 and report["tie_nats"] == 1.0
    if attention == "auto":  # sdpa on CPU, as the engine
        assert report["exact"] is True and report["divergences"] == [] and report["max_gap_nats"] == 0.0
    else:
        assert report["max_gap_nats"] <= 1e-3, report["divergences"]
