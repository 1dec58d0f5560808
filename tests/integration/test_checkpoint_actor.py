"""Actor checkpoints: save at step 3 + load + step 4 equals an uninterrupted run; a process killed in
the middle of a save leaves the previous checkpoint loadable; `tandem export` writes an HF directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tandemrl.trainer.actor import Actor
from tandemrl.trainer.checkpoint import checkpoint_dir, latest_checkpoint, load_extra
from tests.integration.trainer_helpers import cpu_actor_setup, make_samples

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = (
    "actor.optim.lr=0.001",
    "algorithm.n_minibatches=2",
    "actor.micro_batch_tokens=96",
    "actor.optim.lr_schedule=cosine",
    "actor.optim.warmup_steps=3",
    "runner.max_steps=5",
)


def _weights(actor: Actor) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in actor.iter_full_weights()}


def test_resume_at_step_3_equals_uninterrupted_step_4(tiny_llama_dir, tmp_path):
    torch.set_num_threads(1)
    data = [make_samples(seed=s, num_samples=4) for s in range(4)]
    straight = Actor(cpu_actor_setup(tiny_llama_dir, *OVERRIDES))
    for step in range(3):
        straight.train_step(data[step])
    ckpt = straight.save_checkpoint(
        checkpoint_dir(tmp_path, 3), extra={"data/data.pt": {"epoch": 0, "index": 12}}
    )
    rng_after_save = torch.rand(4)
    last = straight.train_step(data[3])

    resumed = Actor(cpu_actor_setup(tiny_llama_dir, *OVERRIDES))
    resumed.load_checkpoint(ckpt)
    assert torch.equal(torch.rand(4), rng_after_save)
    assert resumed.weight_version == 3 and resumed.num_updates == 6
    again = resumed.train_step(data[3])
    assert again["train/actor/lr"] == last["train/actor/lr"] and again["train/actor/lr"] < 0.001
    assert again["train/actor/loss"] == last["train/actor/loss"]
    a, b = _weights(straight), _weights(resumed)
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
    assert load_extra(ckpt, "data/data.pt") == {"epoch": 0, "index": 12}
    assert latest_checkpoint(tmp_path) == ckpt


def test_kill_during_save_leaves_previous_checkpoint_loadable(tiny_llama_dir, tmp_path):
    marker = tmp_path / "hanging"
    code = (
        "from tests.integration.trainer_helpers import train_save_then_hang_mid_save as f; "
        f"f({str(tiny_llama_dir)!r}, {str(tmp_path)!r}, {str(marker)!r})"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert child.poll() is None, "the child died before reaching the save"
            assert time.monotonic() < deadline, "the child never reached the second save"
            time.sleep(0.2)
        assert (tmp_path / "checkpoints" / ".tmp-global_step_2").is_dir()  # a save is really in progress
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    latest = latest_checkpoint(tmp_path)
    assert latest == checkpoint_dir(tmp_path, 1)
    actor = Actor(cpu_actor_setup(tiny_llama_dir, "actor.optim.lr=0.001", "algorithm.n_minibatches=1"))
    actor.load_checkpoint(latest)
    saved = torch.load(tmp_path / "weights_step1.pt", weights_only=True)
    loaded = _weights(actor)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert load_extra(latest, "data/data.pt") == {"position": 1}
    # the next save of step 2 replaces the half-written temporary directory
    actor.save_checkpoint(checkpoint_dir(tmp_path, 2))
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 2)
    assert not (tmp_path / "checkpoints" / ".tmp-global_step_2").exists()


def _export(checkpoint, out) -> subprocess.CompletedProcess:
    """`tandem export CHECKPOINT --out OUT`, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "tandemrl.cli", "export", str(checkpoint), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_export_writes_a_loadable_hf_directory(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    actor = Actor(cpu_actor_setup(tiny_llama_dir, "actor.optim.lr=0.001", "algorithm.n_minibatches=1"))
    actor.train_step(make_samples(seed=0, num_samples=4))
    ckpt = actor.save_checkpoint(checkpoint_dir(tmp_path, 1))
    out = tmp_path / "hf"
    result = _export(ckpt, out)
    assert result.returncode == 0, result.stderr
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    trained = _weights(actor)
    assert all(torch.equal(exported[k], trained[k].float()) for k in trained)
    assert (out / "tokenizer.json").is_file()
    bad = _export(tmp_path, out)
    assert bad.returncode == 2 and "not an actor checkpoint" in bad.stderr
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not a model")
    refused = _export(ckpt, mine)
    assert refused.returncode == 2 and "holds files an export does not write" in refused.stderr, (
        refused.stderr
    )
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
