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
