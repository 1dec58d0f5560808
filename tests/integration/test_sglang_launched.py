"""`tandem train` launches SGLang itself, through Ray, and trains with it (issue 38's path on CPU).

The server is FAKE: a `sglang.launch_server` module, written below onto `rollout.sglang.pythonpath`, that
runs tests/fake_sglang.py with the command line tandem built. The fake stands in for SGLang at the process
boundary and keeps its rules: the launch flags, the `--config` YAML that carries the run's API key, the
key on every endpoint but /health, the pause modes, the weight-update bodies, and the flush that fails
while a request is queued or running. No model runs behind it: its tokens are a fixed function of the
prompt, so rewards and losses mean nothing here; what is checked is the path: the CLI, the Ray launch,
the start-up wait, the key, each pause mode, the weight sync to every step's version, and a clean stop
that leaves no key file behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.integration.runner_helpers import small_kb_once, tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
LAUNCH_SERVER = f'''"""FAKE sglang.launch_server (tests/integration/test_sglang_launched.py): tests/fake_sglang.py's server."""
import sys

sys.path.insert(0, {str(ROOT)!r})
from tests.fake_sglang import main

if __name__ == "__main__":  # the fake's TP ranks are spawned processes, which import this module again
    main()
'''


@pytest.fixture(scope="module")
def small_kb(tmp_path_factory, minilm_dir):
    return small_kb_once(tmp_path_factory, minilm_dir)


def fake_sglang_site(root: Path) -> Path:
    package = root / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        '"""FAKE sglang package (tests/integration/test_sglang_launched.py)."""\n'
    )
    (package / "launch_server.py").write_text(LAUNCH_SERVER)
    return root


def train(
    tmp_path: Path, temp: Path, model_dir: Path, small_kb, pause_mode: str
) -> tuple[subprocess.CompletedProcess, Path]:
    kb_dir, index_dir = small_kb
    output_dir = tmp_path / "run"
    overrides = [
        o
        for o in tiny_overrides(model_dir, kb_dir, index_dir, output_dir)
        if not o.startswith(("cluster.use_ray=", "runner.max_steps=", "runner.val_interval="))
    ]
    overrides += [
        "rollout.backend=sglang",
        f"rollout.sglang.pythonpath=[{fake_sglang_site(tmp_path / 'site')}]",
        "cluster.use_ray=true",
        "runner.async_mode=true",
        f"rollout.pause_mode={pause_mode}",
        f"runner.max_steps={STEPS}",
        "runner.val_interval=0",
        "runner.val_before_train=false",
    ]
    env = {**os.environ, "TANDEM_HOME": str(tmp_path / "home"), "TMPDIR": str(temp)}
    for key in ("PYTHONPATH", "TANDEM_RUN_ID", "TANDEM_RUN_PID"):
        env.pop(key, None)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandemrl.cli",
            "train",
            "examples/searchr1/config/embedded_cpu_async.yaml",
            *overrides,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return result, output_dir


# retract in the default suite (the mode with the client's own resubmission); in_place and drain, whose
# bodies test_sglang_conformance.py checks against the same fake, run with `make test-slow` (the default
# suite stays under CI's 25 minutes)
@pytest.mark.parametrize(
    "pause_mode",
    [
        "retract",
        pytest.param("in_place", marks=pytest.mark.slow),
        pytest.param("drain", marks=pytest.mark.slow),
    ],
)
def test_tandem_train_launches_sglang_through_ray_and_syncs_every_step(
    tmp_path, tiny_llama_dir, small_kb, pause_mode
):
    # the run's temp dir (the key file's home) is short: Ray's socket paths under it must fit 107 bytes
    temp = Path(tempfile.mkdtemp(prefix="tsgl-", dir="/tmp"))
    try:
        result, output_dir = train(tmp_path, temp, tiny_llama_dir, small_kb, pause_mode)
        key_dirs = list(temp.glob("tandem-sglang-key-*"))
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    said = result.stdout + result.stderr
    assert result.returncode == 0, said[-6000:]
    steps = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "time/step" in s]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), steps
    log = (output_dir / "logs" / "rollout_engine_0.log").read_text()
    assert "fake SGLang: serving on" in log, log[-3000:]
    # the run's key reached the server through --config, and every call sent it: one refused call fails the run
    assert "Unauthorized" not in said
    updates = [line for line in log.splitlines() if "fake SGLang: weight update to version" in line]
    assert [line.split("version ")[1].split(",")[0] for line in updates][-STEPS:] == [
        str(v) for v in range(1, STEPS + 1)
    ], updates
    pauses = [line for line in log.splitlines() if "pause_generation mode=" in line]
    # retract: SGLang's abort, and the client resubmits what came back (rollout/client.py pause_generation)
    wire_mode = {"retract": "abort", "in_place": "in_place", "drain": None}[pause_mode]
    if wire_mode is None:  # drain waits for the engine's requests to finish: SGLang is never paused
        assert not pauses, pauses
    else:
        assert pauses and all(f"mode={wire_mode}," in line for line in pauses), pauses
    assert not key_dirs, "the key file outlived the run"
