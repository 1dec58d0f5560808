"""`benchmarks/engine/engines_h200.sh recipe`: the GPU recipe as one segment per pause mode of the engine,
each resumed from the last one's closing checkpoint into the same output_dir, so that one run's history
shows every mode (the SGLang recipe takes retract, in_place and drain). Here the script itself runs on CPU
with the embedded engine, which takes all three, a tiny model and 3 steps: one `tandem train` process per
mode, as on the GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.runner_helpers import small_kb_once, tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "engine" / "engines_h200.sh"
MODES = ["retract", "in_place", "drain"]


@pytest.fixture(scope="module")
def small_kb(tmp_path_factory, minilm_dir):
    return small_kb_once(tmp_path_factory, minilm_dir)


def recipe(tmp_path: Path, model_dir: Path, small_kb, steps: int) -> subprocess.CompletedProcess:
    kb_dir, index_dir = small_kb
    script_sets = ("runner.max_steps=", "runner.output_dir=", "runner.val_interval=")
    overrides = [
        o for o in tiny_overrides(model_dir, kb_dir, index_dir, tmp_path) if not o.startswith(script_sets)
    ]
    config = tmp_path / "recipe.yaml"
    config.write_text("runner:\n  async_mode: true\n")
    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "RECIPE_CONFIG": str(config),
        "RECIPE_DIR": str(tmp_path / "run"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # the script's python3
    }
    return subprocess.run(
        ["bash", str(SCRIPT), "recipe", "embedded", str(steps), *overrides, "actor.optim.lr=1.0e-2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_the_recipe_runs_a_segment_per_pause_mode_into_one_history(tmp_path, tiny_llama_dir, small_kb):
    result = recipe(tmp_path, tiny_llama_dir, small_kb, steps=3)
    said = result.stdout + result.stderr
    assert result.returncode == 0, said[-4000:]
    for end, mode in enumerate(MODES, start=1):
        assert f"recipe embedded: steps to {end} with rollout.pause_mode={mode}" in said
        # each segment's plan names the mode it ran with (cluster/placement.py describe_plan)
        assert f"rollout.pause_mode = {mode} (how the engines stand for each weight sync)" in said
        check = json.loads((tmp_path / "out" / f"embedded_{mode}_weights_check.json").read_text())
        assert check["weights_check"] is True and check["weight_version"] == end, check
    assert said.count("prompts re-issued") == 2  # the second and third segments resumed
    rows = [
        json.loads(line) for line in (tmp_path / "out" / "embedded_metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [int(r["rollout/weight_version"]) for r in rows] == [1, 2, 3]
    assert "weight versions [1, 2, 3]" in result.stdout


def test_the_recipe_refuses_fewer_steps_than_modes_and_an_existing_run(tmp_path, tiny_llama_dir, small_kb):
    too_few = recipe(tmp_path, tiny_llama_dir, small_kb, steps=2)
    assert too_few.returncode == 2 and "recipe embedded: STEPS 2 < 3 pause modes" in too_few.stderr
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    existing = recipe(tmp_path, tiny_llama_dir, small_kb, steps=3)
    assert existing.returncode == 2 and "exists; move it away first" in existing.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 1}\n'  # nothing written is lost
