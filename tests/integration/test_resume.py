"""Resume (docs/DESIGN.md, Checkpoints and resume): stop after step 2, resume from its checkpoint to step 4.
The logged count of open prompts equals
the in-flight + buffered groups + prefetched prompts at save time (checked against the loader position and
the prompt ledger); the resumed run issues exactly those prompts first, logs "N prompts re-issued" once,
and no prompt is trained twice. (The skip alternative, runner.reissue_on_resume=false, is covered in
tests/unit/test_resume_prompts.py.)"""

from __future__ import annotations

import logging
import re

from tandemrl.commands.train import train
from tandemrl.config.loader import load_config
from tandemrl.metrics.logger import read_history, read_tensorboard_scalars
from tandemrl.runner.checkpoint import ROW_KEY, checkpoint_dir, load_resume_state
from tests.integration.runner_helpers import (
    account,
    check_startup_timeline,
    read_ledger,
    small_kb_once,
    tiny_overrides,
)

SAVE_LINE = re.compile(
    r"checkpoint step (\d+) saved to .*; (\d+) prompts are open at the save "
    r"\(in-flight (\d+) \+ buffered (\d+) \+ prefetched (\d+)\)"
)


def test_resume_reissues_exactly_the_prompts_open_at_the_save(
    tmp_path, tmp_path_factory, tiny_llama_dir, minilm_dir, caplog
):
    """The actor runs as a Ray actor here (the default placement), so the default suite covers Ray."""
    kb_dir, index_dir = small_kb_once(tmp_path_factory, minilm_dir)
    base = tiny_overrides(tiny_llama_dir, kb_dir, index_dir, tmp_path / "run1") + [
        "runner.async_mode=true",
        "runner.val_interval=0",
        "data.shuffle=false",
        "cluster.use_ray=true",
    ]
    caplog.set_level(logging.INFO, logger="tandemrl")
    first = load_config(None, base + ["runner.max_steps=2", "runner.save_interval=2"])
    ctx1 = train(first, write_plots=False)
    check_startup_timeline(tmp_path / "run1", ray=True)

    saves = [m.groups() for m in map(SAVE_LINE.search, caplog.messages) if m]
    assert len(saves) == 1
    step, skipped, inflight, buffered, prefetched = map(int, saves[0])
    assert step == 2 and skipped == inflight + buffered + prefetched

    # independent count: prompts drawn from the loader at save time minus those trained or dropped by then
    ckpt = checkpoint_dir(tmp_path / "run1", 2)
    state = load_resume_state(str(ckpt))
    num_drawn = state["loader"]["epoch"] * state["loader"]["num_prompts"] + state["loader"]["index"]
    ledger1 = read_ledger(tmp_path / "run1")
    cut = next(i for i, e in enumerate(ledger1) if e["event"] == "checkpoint")
    before = ledger1[:cut]
    num_ended = sum(e["event"] in ("trained", "dropped") for e in before)
    num_open = sum(e["event"] == "issued" for e in before) - num_ended
    print(
        f"save at step 2: logged skip {skipped} = in-flight {inflight} + buffered {buffered} + prefetched "
        f"{prefetched}; loader drew {num_drawn}, trained/dropped {num_ended}, open groups {num_open}"
    )
    assert skipped == num_drawn - num_ended
    assert inflight + buffered == num_open
    ended_ids = {e["issue_id"] for e in before if e["event"] in ("trained", "dropped")}
    open_issued = [
        e["prompt_id"] for e in before if e["event"] == "issued" and e["issue_id"] not in ended_ids
    ]
    assert state["open_prompt_ids"][:num_open] == open_issued and len(state["open_prompt_ids"]) == skipped
    # the checkpoint keeps its step's row as it stood before the save (restore_row writes it after a kill)
    logged = next(r for r in read_history(tmp_path / "run1" / "metrics.jsonl") if r["step"] == 2)
    kept = state[ROW_KEY]
    assert "time/checkpoint" not in kept and "rollout/reward/mean" in kept
    for key in ("rollout/reward/mean", "rollout/total_num_sequence", "train/actor/num_updates"):
        assert kept[key] == logged[key], key
    run1 = account(ledger1, {g.issue_id for g in ctx1.driver.buffer.unfinished_groups()})

    second = load_config(
        None,
        base + ["runner.max_steps=4", f"runner.resume_from={ckpt}", f"runner.output_dir={tmp_path / 'run2'}"],
    )
    ctx2 = train(second, write_plots=False)
    assert ctx2.weight_version == 4
    resumed = [m for m in caplog.messages if "prompts re-issued" in m]
    assert len(resumed) == 1 and resumed[0].endswith(f"; {skipped} prompts re-issued"), resumed
    assert not any("already issued skipped" in m for m in caplog.messages)  # the old, confusable count
    run2 = account(
        read_ledger(tmp_path / "run2"), {g.issue_id for g in ctx2.driver.buffer.unfinished_groups()}
    )
    assert len(run1["trained_prompts"]) == 4 and len(run2["trained_prompts"]) == 4
    trained = run1["trained_prompts"] + run2["trained_prompts"]
    assert len(trained) == len(set(trained)), "a prompt was trained twice across the resume"
    # the prompts open at the save are the first ones the resumed run issues, in their order
    num_first = min(skipped, len(run2["issued_prompts"]))
    assert run2["issued_prompts"][:num_first] == state["open_prompt_ids"][:num_first] and num_first >= 1
    scalars = read_tensorboard_scalars(tmp_path / "run2" / "tensorboard")
    assert [s for s, _ in scalars["time/step"]] == [3, 4]
