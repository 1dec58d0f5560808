"""The runner's validation (runner/step.py `validate`) against the scripted fakes of the engine and the
retriever of test_agent_loop.py: how many trajectories it runs at once, and what it reports."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tandemrl.config.agent import AgentLoopConfig
from tandemrl.data.loader import Prompt
from tandemrl.runner.step import validate
from tests.unit.test_agent_loop import FakeEngine, FakeSearch

ANSWER = "<answer>Paris</answer>"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def fake_ctx(tokenizer, engines, num_prompts: int, max_running_requests: int):
    prompts = [
        Prompt(
            prompt_id=f"v{i}",
            question="What is the capital of France?",
            golden_answers=["Paris"] if i % 2 == 0 else ["Lyon"],
            data_source="kb_1hop" if i % 2 == 0 else "kb_2hop",
        )
        for i in range(num_prompts)
    ]
    driver = SimpleNamespace(search=FakeSearch(), tokenizer=tokenizer, agent_cfg=AgentLoopConfig(max_turns=2))
    config = SimpleNamespace(rollout=SimpleNamespace(max_running_requests=max_running_requests))
    return SimpleNamespace(config=config, driver=driver, engines=engines, val_prompts=prompts)


@pytest.mark.parametrize("max_running_requests", [100, 10])
def test_validation_runs_as_many_trajectories_at_once_as_an_engine_runs_requests(
    tokenizer, max_running_requests
):
    engine = FakeEngine(tokenizer, [ANSWER], weight_version=5)
    metrics = asyncio.run(validate(fake_ctx(tokenizer, [engine], 100, max_running_requests)))
    assert engine.peak_inflight == max_running_requests  # all 100 at once, or 10 at a time
    assert len(engine.requests) == 100
    assert metrics["val/em/kb_1hop"] == 1.0 and metrics["val/em/kb_2hop"] == 0.0
    assert metrics["val/em/all"] == 0.5
    assert metrics["val/weight_version/min"] == metrics["val/weight_version/max"] == 5.0


def test_validation_shards_the_prompts_over_the_engines(tokenizer):
    engines = [FakeEngine(tokenizer, [ANSWER], weight_version=2) for _ in range(2)]
    metrics = asyncio.run(validate(fake_ctx(tokenizer, engines, 7, 8)))
    assert [len(e.requests) for e in engines] == [4, 3]
    assert [e.peak_inflight for e in engines] == [4, 3]
    assert metrics["val/weight_version/min"] == 2.0


class RecordingLogger:
    """Stands in for MetricsLogger: keeps the rows it is given."""

    def __init__(self):
        self.rows: list[tuple[int, dict]] = []

    def log(self, step, metrics, advance=True):
        self.rows.append((step, metrics))


def pending_ctx():
    from tandemrl.runner.step import SETTLE_TIMEOUT_S

    assert SETTLE_TIMEOUT_S > 0
    return SimpleNamespace(
        bookkeeping=None,
        pending_validation=None,
        train_reads=None,
        logger=RecordingLogger(),
        config=SimpleNamespace(tools=SimpleNamespace(search=SimpleNamespace(warn_error_fraction=0.1))),
    )


def test_a_failed_bookkeeping_is_raised_at_the_next_wait_and_only_logged_when_the_run_stops(caplog):
    from tandemrl.runner.step import finish_bookkeeping, settle_pending

    async def failing():
        raise OSError("disk full writing trajectories/step_3.jsonl")

    async def main():
        ctx = pending_ctx()
        ctx.bookkeeping = asyncio.ensure_future(failing())
        with pytest.raises(OSError, match="disk full"):
            await finish_bookkeeping(ctx)
        assert ctx.bookkeeping is None and await finish_bookkeeping(ctx) is None
        ctx.bookkeeping = asyncio.ensure_future(failing())
        await settle_pending(ctx)  # a run already stopping: its own error is the one to report
        assert ctx.bookkeeping is None

    asyncio.run(main())
    assert "bookkeeping failed" in caplog.text and "disk full" in caplog.text


def test_a_validation_still_running_when_the_run_stops_is_cancelled_and_its_step_row_kept():
    from tandemrl.runner.step import PendingValidation, settle_pending

    async def main():
        ctx = pending_ctx()
        never = asyncio.ensure_future(asyncio.sleep(3600))
        ctx.pending_validation = PendingValidation(7, never, dict(ROW))
        await settle_pending(ctx)
        assert never.cancelled() and ctx.pending_validation is None
        return ctx.logger.rows

    assert asyncio.run(main()) == [(7, ROW)]  # without val metrics


ROW = {  # what a step's row holds that logging reads
    "time/step": 1.5,
    "rollout/num_searches/mean": 1.0,
    "rollout/total_num_sequence": 4.0,
    "rollout/search_errors": 0.0,
}
