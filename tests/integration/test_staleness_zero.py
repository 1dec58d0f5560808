"""The async machinery checked against the sync runner: the async runner with
`rollout_buffer.max_head_offpolicyness=0` (no overlap) trains on what the sync runner trains on, step by
step: the same prompts, the same tokens from the same weight version, the same rewards.

Both runs are real (`train` on CPU: embedded engine process, retrieval server, actor, gloo weight sync)
with a tiny random model and greedy sampling, so the trajectories are a function of the weights alone.
Greedy groups have equal rewards, hence zero advantages; weight decay moves the weights anyway, so
every step's trajectories also check that the right weights reached the engine. Every prompt is the same
question (with its own id), so the steps' logprobs show the weights moving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandemrl.commands.train import train
from tandemrl.config.loader import load_config
from tandemrl.metrics.logger import read_history
from tests.integration.runner_helpers import read_ledger, small_kb_once, tiny_overrides

STEPS = 3


@pytest.fixture(scope="module")
def small_kb(tmp_path_factory, minilm_dir):
    return small_kb_once(tmp_path_factory, minilm_dir)


def one_question_train_file(kb_dir: Path, path: Path) -> Path:
    """The KB's train split with every question replaced by the first one (ids kept)."""
    rows = [json.loads(line) for line in (kb_dir / "train.jsonl").read_text().splitlines()]
    first = rows[0]
    same = [{**row, **{k: first[k] for k in ("question", "golden_answers", "data_source")}} for row in rows]
    path.write_text("".join(json.dumps(row) + "\n" for row in same))
    return path


def run(tmp_path: Path, model_dir: Path, small_kb, name: str, *overrides: str) -> Path:
    kb_dir, index_dir = small_kb
    output_dir = tmp_path / name
    (tmp_path / f"data_{name}").mkdir()
    train_file = one_question_train_file(kb_dir, tmp_path / f"data_{name}" / "train.jsonl")
    config = load_config(
        None,
        tiny_overrides(model_dir, kb_dir, index_dir, output_dir)
        + [
            f"data.train_data_paths=[{train_file}]",
            f"runner.max_steps={STEPS}",
            "runner.val_interval=0",
            "agentloop.temperature=0",
            "actor.optim.lr=0.05",
            "actor.optim.weight_decay=1.0",
            *overrides,
        ],
    )
    train(config, write_plots=False)
    return output_dir


def trained(output_dir: Path, step: int) -> list[dict]:
    path = output_dir / "trajectories" / f"step_{step}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def ledger(output_dir: Path, kind: str) -> list[tuple[int, str]]:
    """(issue id, prompt id) of the ledger's `kind` events, in order. Both runners issue the next batch
    right after the weight sync, before the step's ledger is written, so steps are not compared."""
    return [(e["issue_id"], e["prompt_id"]) for e in read_ledger(output_dir) if e["event"] == kind]


def test_async_at_staleness_zero_trains_on_the_sync_runners_trajectories(tmp_path, tiny_llama_dir, small_kb):
    sync = run(tmp_path, tiny_llama_dir, small_kb, "sync", "runner.async_mode=false")
    asyn = run(
        tmp_path,
        tiny_llama_dir,
        small_kb,
        "async",
        "runner.async_mode=true",
        "rollout_buffer.max_head_offpolicyness=0",
    )
    # the same prompts in the same order; after its last sync each runner has issued the next batch
    # (runner/sync_runner.py reopens admission right after the weight sync, as the async runner does)
    assert ledger(sync, "issued") == ledger(asyn, "issued")
    assert len(ledger(sync, "issued")) == 2 * (STEPS + 1)
    assert ledger(asyn, "trained") == ledger(sync, "trained") == ledger(sync, "issued")[: 2 * STEPS]
    first_logprobs = []
    for step in range(1, STEPS + 1):
        rows_sync, rows_async = trained(sync, step), trained(asyn, step)
        assert len(rows_sync) == len(rows_async) == 4  # 2 groups x 2 trajectories
        for a, b in zip(rows_sync, rows_async, strict=True):
            assert (a["prompt_id"], a["sample_index"]) == (b["prompt_id"], b["sample_index"])
            assert a["prompt_ids"] == b["prompt_ids"]
            assert a["response_ids"] == b["response_ids"], f"step {step}: {a['prompt_id']} differs"
            assert a["weight_versions"] == b["weight_versions"]
            assert {v for v, m in zip(a["weight_versions"], a["loss_mask"], strict=True) if m} == {step - 1}
            assert (a["reward"], a["staleness"], a["searches"]) == (
                b["reward"],
                b["staleness"],
                b["searches"],
            )
            assert a["rollout_logprobs"] == pytest.approx(b["rollout_logprobs"], abs=1e-4)
        first_logprobs.append(rows_sync[0]["rollout_logprobs"][0])
    # the same question every step: its first token's logprob moves with the weights
    assert len(set(first_logprobs)) == STEPS, first_logprobs
    history_sync, history_async = read_history(sync / "metrics.jsonl"), read_history(asyn / "metrics.jsonl")
    for row_sync, row_async in zip(history_sync, history_async, strict=True):
        assert row_async["rollout/data_staleness/mean"] == 0.0
        assert row_async["rollout/reward/mean"] == row_sync["rollout/reward/mean"]
        assert row_async["train/actor/loss"] == pytest.approx(row_sync["train/actor/loss"], abs=1e-6)
