"""benchmarks/learning/learning_parity.py's results: the run plan (seeds, variants, the staleness-0 check), and the
summary read from each run's metrics.jsonl (curves, mean and sd over seeds, the check against the sync
seeds' range, acceptance, plots). The runs are fabricated metric logs: this checks the reading and the
arithmetic, whose only input is those files; the runs themselves are real `tandem train` processes."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

from benchmarks.learning.learning_parity import CHECK, parse_args, run_specs, train_command
from benchmarks.learning.learning_parity_summary import summarize, write_plots, write_samples

STEPS, CHECK_STEPS = 4, 2


def fake_run(
    run_dir: Path, em: tuple[float, float], two_hop: tuple[float, float], reward: float, steps=STEPS
):
    """A run's metrics.jsonl: val EM at steps 0 and STEPS, a constant train reward and 1.5 searches."""
    run_dir.mkdir(parents=True)
    rows = [{"step": 0, "val/em/all": em[0], "val/em/kb_2hop": two_hop[0], "val/em/kb_1hop": 0.5}]
    for step in range(1, steps + 1):
        row = {
            "step": step,
            "time/step": 1.0,
            "train/actor/num_updates": 4.0 * step,
            "rollout/reward/mean": reward,
            "rollout/num_searches/mean": 1.5,
            "rollout/num_searches/kb_2hop": 2.0 - 0.1 * step,
            "rollout/data_staleness/mean": 0.0,
            "rollout/search_advantage/kb_2hop": 0.1,
        }
        if step == STEPS:
            row.update({"val/em/all": em[1], "val/em/kb_2hop": two_hop[1], "val/em/kb_1hop": 0.9})
        rows.append(row)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    trajectories = run_dir / "trajectories"
    trajectories.mkdir()
    traj = {"data_source": "kb_2hop", "searches": ["a", "b"], "reward": 1.0, "finish_reason": "answer",
            "question": "q?", "golden_answers": ["x"], "answer": "x", "response_text": "<search>a</search>",
            "sample_index": 0}  # fmt: skip
    (trajectories / "step_1.jsonl").write_text(json.dumps(traj) + "\n")


def test_plan_seeds_variants_and_the_check():
    args = parse_args(["--seeds", "1", "2", "--steps", "60", "--check-steps", "10", "x.y=1"])
    specs = run_specs(args)
    # the pair the acceptance compares first, seed by seed, then the short check, then the rest
    assert [(s.variant, s.seed, s.steps) for s in specs] == [
        ("sync", 1, 60), ("async", 1, 60), ("sync", 2, 60), ("async", 2, 60),
        (CHECK, 1, 10), ("async_tis", 1, 60), ("async_tis", 2, 60),
    ]  # fmt: skip
    command = train_command(specs[4], Path("/r/staleness0/seed1"), ["x.y=1"])
    assert "data.seed=1" in command and "runner.seed=1" in command and "runner.max_steps=10" in command
    assert "rollout_buffer.max_head_offpolicyness=0" in command and command[-1] == "x.y=1"
    assert "algorithm.off_policy_correction=tis" in train_command(specs[5], Path("/r"), [])
    assert [s.variant for s in run_specs(parse_args(["--no-check", "--variants", "sync"]))] == ["sync"] * 3


def test_summary_means_sds_check_and_acceptance(tmp_path):
    args = parse_args(["--seeds", "1", "2", "--steps", str(STEPS), "--check-steps", str(CHECK_STEPS)])
    specs = run_specs(args)
    fake_run(tmp_path / "sync/seed1", (0.40, 0.55), (0.30, 0.10), reward=0.2)
    fake_run(tmp_path / "sync/seed2", (0.44, 0.65), (0.34, 0.20), reward=0.4)
    fake_run(tmp_path / "async/seed1", (0.42, 0.70), (0.30, 0.50), reward=0.3)
    fake_run(tmp_path / "async/seed2", (0.42, 0.62), (0.30, 0.40), reward=0.3)
    fake_run(tmp_path / "async_tis/seed1", (0.42, 0.7), (0.3, 0.6), reward=0.3, steps=STEPS - 1)  # cut short
    fake_run(tmp_path / "staleness0/seed1", (0.42, 0.42), (0.3, 0.3), reward=0.3, steps=CHECK_STEPS)
    result = summarize(specs, tmp_path, {"steps": STEPS})
    sync = result["sync"]
    assert sync["num_seeds"] == 2
    assert sync["mean"]["val_em_start"] == pytest.approx(0.42) and sync["mean"][
        "val_em_end"
    ] == pytest.approx(0.6)
    assert sync["sd"]["val_em_end"] == pytest.approx(statistics.stdev([0.55, 0.65]))
    assert sync["mean"]["kb_2hop_end"] == pytest.approx(0.15)
    assert sync["seeds"]["1"]["val_em"]["kb_2hop"] == [[0, 0.30], [STEPS, 0.10]]
    assert sync["seeds"]["2"]["num_searches"]["kb_2hop"][0] == [1, 1.9]
    assert sync["seeds"]["1"]["diagnostics"]["search_advantage"]["kb_2hop"][-1] == [STEPS, 0.1]
    # the incomplete tis run is listed but counts in no mean
    assert result["async_tis"]["num_seeds"] == 0 and result["async_tis"]["mean"]["val_em_end"] is None
    assert result["async_tis"]["seeds"]["1"]["complete"] is False and result["complete"] is False
    check = result["staleness0_check"]
    assert check["first_steps_reward"] == {"check": 0.3, "sync_seeds_range": [0.2, 0.4]}
    assert check["passes"] is True
    acc = result["acceptance"]
    assert acc["sync_val_em_rise"]["value"] == pytest.approx(0.18) and acc["sync_val_em_rise"]["passes"]
    assert acc["sync_kb_2hop_end_ge_start"]["value"] == pytest.approx(-0.17)
    assert acc["sync_kb_2hop_end_ge_start"]["passes"] is False
    assert acc["async_kb_2hop_end_ge_start"]["passes"] is True
    assert (
        acc["final_val_em_gap"]["value"] == pytest.approx(0.06) and acc["final_val_em_gap"]["passes"] is False
    )
    assert acc["seeds_done"] == {"sync": [2, 2], "async": [2, 2]}
    # a seed of the pair cut short: the values are shown from the seeds done, but nothing is decided
    (tmp_path / "async/seed2/metrics.jsonl").write_text(
        "".join(
            line + "\n" for line in (tmp_path / "async/seed2/metrics.jsonl").read_text().splitlines()[:-1]
        )
    )
    acc = summarize(specs, tmp_path, {"steps": STEPS})["acceptance"]
    assert acc["seeds_done"] == {"sync": [2, 2], "async": [1, 2]}
    assert acc["final_val_em_gap"] == {"value": pytest.approx(0.1), "passes": None}
    assert acc["sync_val_em_rise"]["passes"] is None and acc["async_kb_2hop_end_ge_start"]["passes"] is None
    plots = write_plots(result, tmp_path / "plots")
    names = sorted(p.name for p in plots)
    assert names == ["num_searches_kb_2hop.png", "num_searches_mean.png", "val_em_all.png",
                     "val_em_kb_1hop.png", "val_em_kb_2hop.png"]  # fmt: skip
    samples = json.loads(write_samples(specs, tmp_path, tmp_path / "samples.json").read_text())
    assert samples["sync/seed1"]["1"]["kb_2hop"]["searches_histogram"] == {"2": 1}


def test_a_check_outside_the_sync_range_fails(tmp_path):
    specs = run_specs(parse_args(["--seeds", "1", "2", "--steps", str(STEPS), "--check-steps", str(CHECK_STEPS),
                                  "--variants", "sync"]))  # fmt: skip
    fake_run(tmp_path / "sync/seed1", (0.4, 0.5), (0.3, 0.3), reward=0.2)
    fake_run(tmp_path / "sync/seed2", (0.4, 0.5), (0.3, 0.3), reward=0.25)
    fake_run(tmp_path / "staleness0/seed1", (0.4, 0.4), (0.3, 0.3), reward=0.5, steps=CHECK_STEPS)
    check = summarize(specs, tmp_path, {})["staleness0_check"]
    assert check["passes"] is False and check["first_steps_reward"]["sync_seeds_range"] == [0.2, 0.25]


def test_more_check_seeds_describe_the_scatter_and_decide_nothing(tmp_path):
    args = parse_args(["--seeds", "1", "2", "--steps", str(STEPS), "--check-steps", str(CHECK_STEPS),
                       "--variants", "sync", "--check-seeds", "1", "2"])  # fmt: skip
    specs = run_specs(args)
    assert [(s.variant, s.seed) for s in specs] == [("sync", 1), ("sync", 2), (CHECK, 1), (CHECK, 2)]
    fake_run(tmp_path / "sync/seed1", (0.4, 0.5), (0.3, 0.3), reward=0.2)
    fake_run(tmp_path / "sync/seed2", (0.4, 0.5), (0.3, 0.3), reward=0.3)
    fake_run(tmp_path / "staleness0/seed1", (0.4, 0.4), (0.3, 0.3), reward=0.25, steps=CHECK_STEPS)
    fake_run(tmp_path / "staleness0/seed2", (0.4, 0.4), (0.3, 0.3), reward=0.5, steps=CHECK_STEPS)
    check = summarize(specs, tmp_path, {})["staleness0_check"]
    # the first check seed decides; the second lies outside the range and changes nothing
    assert check["passes"] is True and check["first_steps_reward"]["check"] == 0.25
    assert check["more_seeds"]["2"]["inside_sync_range"] is False
    assert check["more_seeds"]["2"]["first_steps_reward"]["check"] == 0.5
    reward = check["over_seeds"]["first_steps_reward"]
    assert reward["check_mean"] == pytest.approx(0.375) and reward["sync_mean"] == pytest.approx(0.25)
    assert reward["check_minus_sync_same_seed"] == {"1": pytest.approx(0.05), "2": pytest.approx(0.2)}
    with pytest.raises(SystemExit):
        parse_args(["--check-seeds", "1", "1"])
    with pytest.raises(SystemExit):
        parse_args(["--check-seeds", "2", "--no-check"])


def _realtext_summary(run_dir: Path, em: float) -> None:
    path = run_dir / "realtext_eval" / "val_summary.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"summary": {"overall": {"em": em, "searches": 1.25}}}))


def test_ratio_spread_and_real_text_em_reach_the_means_and_the_acceptance(tmp_path):
    specs = run_specs(parse_args(["--seeds", "1", "2", "--steps", str(STEPS), "--no-check",
                                  "--variants", "sync", "async"]))  # fmt: skip
    for variant, seed, em in (("sync", 1, 0.30), ("sync", 2, 0.34), ("async", 1, 0.20), ("async", 2, 0.22)):
        run_dir = tmp_path / f"{variant}/seed{seed}"
        fake_run(run_dir, (0.4, 0.6), (0.3, 0.3), reward=0.3)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        for row in rows[1:]:
            row["train/actor/ratio_abs"] = 0.01 * row["step"] * seed
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        _realtext_summary(run_dir, em)
    result = summarize(specs, tmp_path, {})
    seed2 = result["sync"]["seeds"]["2"]["figures"]
    assert (
        seed2["ratio_abs_range"] == pytest.approx(0.02 * (STEPS - 1))
        and seed2["ratio_abs_max"] == 0.02 * STEPS
    )
    assert result["sync"]["mean"]["realtext_em"] == pytest.approx(0.32)
    assert result["sync"]["sd"]["realtext_em"] == pytest.approx(statistics.stdev([0.30, 0.34]))
    gap = result["acceptance"]["final_realtext_em_gap"]
    assert gap["value"] == pytest.approx(0.11) and gap["passes"] is False
    # a run never evaluated on real text: no number is made up
    (tmp_path / "async/seed2/realtext_eval/val_summary.json").unlink()
    result = summarize(specs, tmp_path, {})
    assert result["async"]["mean"]["realtext_em"] is None
    assert result["acceptance"]["final_realtext_em_gap"] == {"value": None, "passes": None}


def test_real_text_evaluation_exports_the_final_checkpoint_and_evaluates_it_on_the_held_out_split(tmp_path):
    from benchmarks.learning.learning_parity import needs_realtext_eval, realtext_commands

    data = tmp_path / "realtext"
    data.mkdir()
    (data / "corpus.jsonl").write_text("{}\n")
    (data / "test.jsonl").write_text("{}\n")
    args = parse_args(["--steps", "60", "--realtext", str(data), "--variants", "async_tis", "--seeds", "3"])
    spec = next(s for s in run_specs(args) if s.variant == "async_tis")
    run_dir = spec.run_dir(tmp_path / "runs")
    (run_dir / "checkpoints/global_step_60").mkdir(parents=True)
    (run_dir / "checkpoints/global_step_50").mkdir()
    assert needs_realtext_eval(spec, run_dir, args)
    check_spec = next(s for s in run_specs(args) if s.variant == CHECK)
    assert not needs_realtext_eval(check_spec, run_dir, args)  # the staleness-0 check run
    inputs = (tmp_path / "q.jsonl", data / "corpus.jsonl", tmp_path / "index")
    kb_server = ["retrieval.launch=false", "tools.search.server_addr=127.0.0.1:1"]
    export, evaluate = realtext_commands(spec, run_dir, inputs, 200, ["a.b=1", *kb_server], "127.0.0.1:2")
    assert export[-4:] == [
        "export",
        str(run_dir / "checkpoints/global_step_60"),
        "--out",
        str(run_dir / "final_hf"),
    ]
    assert evaluate[evaluate.index("eval") + 1] == spec.config and "--limit" in evaluate
    for override in (f"rollout.model.model_path={run_dir / 'final_hf'}", f"data.val_data_paths=[{inputs[0]}]",
                     f"retrieval.index_dir={inputs[2]}", "retrieval.launch=false", "runner.seed=3",
                     "tools.search.server_addr=127.0.0.1:2", "algorithm.off_policy_correction=tis", "a.b=1"):  # fmt: skip
        assert override in evaluate, override
    assert kb_server[1] not in evaluate  # the runs' shared KB server is not the real text's
    _realtext_summary(run_dir, 0.5)
    assert not needs_realtext_eval(spec, run_dir, args)  # done once, not again
    (run_dir / "checkpoints/global_step_60").rmdir()
    with pytest.raises(RuntimeError, match="no checkpoint of step 60"):
        realtext_commands(spec, run_dir, inputs, 200, [], "127.0.0.1:2")


FAKE_TRAIN = """import json, pathlib, sys
run_dir, steps = pathlib.Path(sys.argv[1]), int(sys.argv[2])
run_dir.mkdir(parents=True, exist_ok=True)
rows = [{"step": s, "time/step": 1.0} for s in range(1, steps + 1)]
(run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
(run_dir / "checkpoints" / f"global_step_{steps}").mkdir(parents=True)
"""
FAKE_EXPORT = "import pathlib, sys; pathlib.Path(sys.argv[1]).mkdir()"
FAKE_EVAL = """import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
assert pathlib.Path(sys.argv[2]).is_dir(), "evaluated before the export"
out.mkdir(parents=True, exist_ok=True)
(out / "val_summary.json").write_text(json.dumps({"summary": {"overall": {"em": 0.25}}}))
"""


def test_each_runs_real_text_evaluation_follows_its_training_in_the_same_slot(tmp_path, monkeypatch):
    """The pool of runs: a run trained to its last step is exported and evaluated on real text next, while
    the other runs go on; then its checkpoints are pruned. The processes are fakes of `tandem train`,
    `tandem export` and `tandem eval` (python one-liners writing what those write), not the real ones."""
    import sys

    from benchmarks.learning import learning_parity

    data = tmp_path / "realtext"
    data.mkdir()
    (data / "corpus.jsonl").write_text("{}\n")
    (data / "test.jsonl").write_text("{}\n")
    runs = tmp_path / "runs"
    args = parse_args(["--steps", "3", "--check-steps", "2", "--seeds", "1", "2", "--concurrency", "2",
                       "--variants", "sync", "async", "--realtext", str(data), "--save-every", "0"])  # fmt: skip
    specs = run_specs(args)
    started: list[str] = []

    def fake_train(spec, runs_dir, shared, save_every):
        started.append(f"train {spec.variant}/seed{spec.seed}")
        run_dir = spec.run_dir(runs_dir)
        return learning_parity.subprocess.Popen(
            [sys.executable, "-c", FAKE_TRAIN, str(run_dir), str(spec.steps)], start_new_session=True
        )

    def fake_commands(spec, run_dir, inputs, limit, shared, server_addr):
        assert server_addr == "127.0.0.1:2" and run_dir.exists()
        started.append(f"eval {spec.variant}/seed{spec.seed}")
        out, final = run_dir / "realtext_eval", run_dir / "final_hf"
        return [[sys.executable, "-c", FAKE_EXPORT, str(final)],
                [sys.executable, "-c", FAKE_EVAL, str(out), str(final)]]  # fmt: skip

    monkeypatch.setattr(learning_parity, "start_run", fake_train)
    monkeypatch.setattr(learning_parity, "realtext_commands", fake_commands)
    monkeypatch.setattr(learning_parity.time, "sleep", lambda s: None)
    inputs = (tmp_path / "q.jsonl", data / "corpus.jsonl", tmp_path / "index")
    left = learning_parity.run_all(specs, args, runs, [], (inputs, "127.0.0.1:2"))
    assert left == []
    assert started[:2] == ["train sync/seed1", "train async/seed1"]  # the pair first
    assert f"train {CHECK}/seed1" in started and f"eval {CHECK}/seed1" not in started
    for spec in specs:
        run_dir = spec.run_dir(runs)
        assert json.loads((run_dir / "run.json").read_text())["rc"] == 0
        assert not list((run_dir / "checkpoints").glob("global_step_*"))  # pruned once evaluated
        assert not (run_dir / "final_hf").exists()
        if spec.variant != CHECK:  # the first evaluation started before the last training did
            assert (run_dir / "realtext_eval/val_summary.json").is_file()
    assert started.index("eval sync/seed1") < started.index("train async/seed2")
    # run again: nothing is left to do
    started.clear()
    assert learning_parity.run_all(specs, args, runs, [], (inputs, "127.0.0.1:2")) == [] and started == []
    # an evaluation lost (its summary gone) is done again, from the kept checkpoint, without training
    run_dir = specs[0].run_dir(runs)
    (run_dir / "checkpoints/global_step_3").mkdir()
    (run_dir / "realtext_eval/val_summary.json").unlink()
    assert learning_parity.run_all(specs, args, runs, [], (inputs, "127.0.0.1:2")) == []
    assert started == ["eval sync/seed1"]


def test_a_real_text_directory_without_its_files_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--realtext", str(tmp_path)])
    assert "no corpus.jsonl, test.jsonl there" in capsys.readouterr().err


def _set_staleness(run_dir: Path, mean: float, most: float) -> None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        if "time/step" in row:
            row.update({"rollout/data_staleness/mean": mean, "rollout/data_staleness/max": most})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_async_seeds_staleness_is_checked_against_solo_runs(tmp_path):
    """Seeds run side by side share the GPU; the JSON says whether they trained on data as stale as the
    recipe alone does (issue 41). The default solo runs are issue 35's committed runs."""
    specs = run_specs(parse_args(["--seeds", "1", "2", "--steps", str(STEPS), "--no-check",
                                  "--variants", "sync", "async"]))  # fmt: skip
    for variant in ("sync", "async"):
        for seed in (1, 2):
            fake_run(tmp_path / f"{variant}/seed{seed}", (0.4, 0.6), (0.3, 0.4), reward=0.3)
    solo = [tmp_path / "solo1", tmp_path / "solo2"]
    for run_dir, mean in zip(solo, (1.9, 2.0), strict=True):
        fake_run(run_dir, (0.4, 0.6), (0.3, 0.4), reward=0.3)
        _set_staleness(run_dir, mean, 4.0)
    _set_staleness(tmp_path / "async/seed1", 2.1, 4.0)
    _set_staleness(tmp_path / "async/seed2", 2.3, 4.0)  # 0.3 above the solo range: beyond the tolerance
    check = summarize(specs, tmp_path, {}, solo)["staleness_vs_solo"]
    assert check["solo_runs"][str(solo[0])] == {"mean_staleness": 1.9, "max_staleness": 4.0}
    assert check["async"]["1"] == {"mean_staleness": 2.1, "max_staleness": 4.0, "matches": True}
    assert check["async"]["2"]["matches"] is False and check["matches"] is False
    _set_staleness(tmp_path / "async/seed2", 2.0, 5.0)  # a higher maximum than any solo run's
    check = summarize(specs, tmp_path, {}, solo)["staleness_vs_solo"]
    assert check["async"]["2"]["matches"] is False
    _set_staleness(tmp_path / "async/seed2", 2.0, 3.0)
    assert summarize(specs, tmp_path, {}, solo)["staleness_vs_solo"]["matches"] is True
    assert summarize(specs, tmp_path, {})["staleness_vs_solo"]["matches"] is None  # no solo run: unknown
    defaults = parse_args([]).solo_runs
    assert len(defaults) == 3 and all((Path(p) / "metrics.jsonl").is_file() for p in defaults)
    with pytest.raises(SystemExit):
        parse_args(["--solo-runs", str(tmp_path / "nowhere")])


def test_runs_sharing_a_gpu_keep_the_recipes_policy_under_one_mps_daemon(fake_control, tmp_path, monkeypatch):
    """Each run's own MPS daemon is off (`cluster.mps=false`), so `auto` would time-share, not run the
    recipe's `concurrent`: the shared overrides set the policy, and one daemon (here the fake control binary
    of tests/conftest.py) serves every run through the pipe directory they inherit."""
    from benchmarks.learning.learning_parity import SHARED_GPU_OVERRIDES, shared_mps
    from tandemrl.cluster.mps import PIPE_ENV
    from tandemrl.cluster.placement import resolve_colocated_policy
    from tandemrl.config.loader import load_config

    config = load_config(parse_args([]).async_config, SHARED_GPU_OVERRIDES)
    assert resolve_colocated_policy(config, shares_gpu=True)[0] == "concurrent"
    without = [o for o in SHARED_GPU_OVERRIDES if not o.startswith("cluster.colocated_policy")]
    assert (
        resolve_colocated_policy(load_config(parse_args([]).async_config, without), True)[0] == "time_share"
    )
    load_config(parse_args([]).sync_config, SHARED_GPU_OVERRIDES)  # the sync config takes them too
    monkeypatch.delenv(PIPE_ENV, raising=False)
    monkeypatch.setattr("os.environ", dict(os.environ))  # the daemon's pipe lands in a copy, not this process
    daemon = shared_mps(tmp_path)
    assert daemon is not None and os.environ[PIPE_ENV] == daemon.env[PIPE_ENV]
    daemon.stop()
    assert [line.split()[0] for line in fake_control.read_text().splitlines()] == ["start", "quit"]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert shared_mps(tmp_path) is None  # no MPS control here: the runs time-slice the GPU


def test_runs_at_a_time_follow_the_gpus_memory(monkeypatch):
    """`--concurrency` left out: as many runs as the card holds at RUN_PEAK_GIB each (an 80 GB H100 held two
    and ran out with three), at most three; one without a GPU."""
    from types import SimpleNamespace

    import torch

    from benchmarks.learning.learning_parity import auto_concurrency

    assert parse_args([]).concurrency is None
    assert auto_concurrency(False) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert auto_concurrency(True) == 1  # a GPU config summarized where there is none
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for total_gib, runs in ((79.2, 2), (139.8, 3), (24.0, 1)):
        props = SimpleNamespace(total_memory=int(total_gib * 2**30))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index, p=props: p)
        assert auto_concurrency(True) == runs, total_gib


def test_an_earlier_batchs_complete_runs_are_imported_when_configured_alike(tmp_path, capsys):
    """A batch cut short by a session's end (its `_runs.tgz` and JSON brought back) lets the next session run
    only what is left: complete runs whose saved config is this plan's count as done and keep the GPU they
    ran on; a run cut short is not imported (it has no checkpoint to resume); another config is refused."""
    from benchmarks.learning.learning_parity import bundle, import_runs, is_complete
    from tandemrl.commands.show import render
    from tandemrl.config.loader import load_config

    args = parse_args(
        ["--seeds", "1", "2", "--steps", str(STEPS), "--no-check", "--variants", "sync", "async"]
    )
    specs = run_specs(args)
    earlier, shared = tmp_path / "earlier", ["actor.micro_batch_tokens=8192"]
    for spec in specs:
        run_dir = spec.run_dir(earlier)
        steps = STEPS if (spec.variant, spec.seed) != ("async", 2) else STEPS - 1  # async/seed2 cut short
        fake_run(run_dir, (0.4, 0.6), (0.3, 0.4), reward=0.3, steps=steps)
        command = train_command(spec, Path("/elsewhere") / spec.variant, [*shared, "runner.save_interval=10"])
        where = command.index("train")
        config = load_config(command[where + 1], command[where + 2 :])
        (run_dir / "config.yaml").write_text(render(config) + "\n")
        (run_dir / "run.json").write_text(json.dumps({"rc": 0, "wall_s": 1.0}) + "\n")
    out = tmp_path / "results"
    out.mkdir()
    made_there = json.loads(write_samples(specs, earlier, out / "there_samples.json").read_text())
    assert made_there["sync/seed1"]["1"]["kb_2hop"]["searches_histogram"] == {"2": 1}
    tgz = bundle(specs, earlier, [], out / "lp_x_runs.tgz")
    (out / "lp_x.json").write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3"}))

    here = tmp_path / "here"
    assert import_runs(tgz, specs, here, shared) == ["sync/seed1", "async/seed1", "sync/seed2"]
    assert is_complete(here / "sync/seed2", STEPS) and not (here / "async/seed2").exists()
    record = json.loads((here / "sync/seed1/run.json").read_text())
    assert record["gpu"] == "NVIDIA H100 80GB HBM3" and record["imported_from"] == str(tgz)
    # the trajectories stayed where the runs ran; their digest came with them
    assert not (here / "sync/seed1/trajectories").exists()
    samples = json.loads(write_samples(specs, here, out / "here_samples.json").read_text())
    assert samples["sync/seed1"] == made_there["sync/seed1"] and samples["async/seed2"] == {}
    summary = summarize(specs, here, {})
    assert (
        summary["sync"]["seeds"]["1"]["gpu"] == "NVIDIA H100 80GB HBM3" and summary["sync"]["num_seeds"] == 2
    )
    # once here, a run is not imported again
    assert import_runs(tgz, specs, here, shared) == []
    # another recipe (here: another micro-batch) is refused by name, and nothing is written
    elsewhere = tmp_path / "elsewhere"
    with pytest.raises(SystemExit, match="actor.micro_batch_tokens: 8192 there, 16384 here"):
        import_runs(tgz, specs, elsewhere, ["actor.micro_batch_tokens=16384"])
    assert not elsewhere.exists()


def test_an_interrupted_pool_stops_the_runs_it_started(tmp_path, monkeypatch):
    """Each run sits in a session of its own, so Ctrl-C or SIGTERM to the script would leave it running
    against stopped servers: the pool stops its runs on the way out. The run is a fake `tandem train`
    (a sleeping python process)."""
    import sys

    from benchmarks.learning import learning_parity

    args = parse_args(
        ["--steps", "3", "--seeds", "1", "--no-check", "--variants", "sync", "--concurrency", "1"]
    )
    procs = []

    def fake_train(spec, runs_dir, shared, save_every):
        spec.run_dir(runs_dir).mkdir(parents=True)
        procs.append(learning_parity.subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                                      start_new_session=True))  # fmt: skip
        return procs[-1]

    real_sleep, calls = learning_parity.time.sleep, []

    def interrupt(seconds):  # the pool's first wait is interrupted; later ones (Popen.wait's) are real
        calls.append(seconds)
        if len(calls) == 1:
            raise KeyboardInterrupt
        real_sleep(seconds)

    monkeypatch.setattr(learning_parity, "start_run", fake_train)
    monkeypatch.setattr(learning_parity.time, "sleep", interrupt)
    with pytest.raises(KeyboardInterrupt):
        learning_parity.run_all(run_specs(args), args, tmp_path, [])
    assert len(procs) == 1 and procs[0].poll() is not None  # stopped, not left sleeping


def test_the_shared_retrieval_servers_threads_are_what_the_runs_own_servers_would_have_had(monkeypatch):
    """One server for N runs at a time gets N x `retrieval.num_threads` (each run's own would have had
    that many), at most one per core; 0 keeps its meaning, one per core. The class's default of one per
    core was what the first H100 batch got."""
    from benchmarks.learning.learning_parity import shared_threads

    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert [shared_threads(4, runs) for runs in (1, 2, 3, 5)] == [4, 8, 12, 16]
    assert shared_threads(0, 3) == 0 and shared_threads(2, 0) == 2
