"""The agent loop's logic against scripted fakes of the engine and the retriever.

The fakes stand in for the two processes the loop talks to; the tokenizer is SmolLM2's real one,
so token accounting (masks, budgets, transcripts) is the production one.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from tandemrl.agent.loop import Trajectory, run_group, run_trajectory, sampling_params
from tandemrl.agent.prompt import (
    ANSWER_NOW_TEXT,
    INFO_CLOSE,
    INFO_OPEN,
    INVALID_ACTION_TEXT,
    build_prompt_ids,
    encode_text,
)
from tandemrl.agent.search_tool import SearchError
from tandemrl.config.agent import AgentLoopConfig
from tandemrl.config.schema import ConfigError
from tandemrl.data.loader import Prompt
from tandemrl.rollout.client import GenerateResult

STOPS = ("</search>", "</answer>")


class FakeEngine:
    """Stands in for an engine process behind `EngineClient`: each trajectory (recognised by its
    request id prefix) gets the scripted turns in order, tokenized with the real tokenizer, cut at
    a stop string and at `max_new_tokens` like a real engine; it records every request."""

    def __init__(
        self,
        tokenizer,
        turns: list[str],
        weight_version: int = 3,
        per_token_versions: bool = True,
        finish_reason: str | None = None,
        honour_stops: bool = True,
    ):
        self.tokenizer, self.turns, self.weight_version = tokenizer, turns, weight_version
        self.per_token_versions, self.finish_reason, self.honour_stops = (
            per_token_versions,
            finish_reason,
            honour_stops,
        )
        self.requests: list[dict] = []
        self.num_inflight = self.peak_inflight = 0
        self._turn_of: dict[str, int] = {}

    async def generate(self, input_ids, sampling_params, rid=None, extra=None) -> GenerateResult:
        self.requests.append(
            dict(input_ids=list(input_ids), sampling_params=sampling_params, rid=rid, extra=extra)
        )
        self.num_inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.num_inflight)
        await asyncio.sleep(0.01)  # let the other trajectories of a group run meanwhile
        self.num_inflight -= 1
        prefix = rid.rsplit("-t", 1)[0]
        turn = self._turn_of.get(prefix, 0)
        self._turn_of[prefix] = turn + 1
        text = self.turns[min(turn, len(self.turns) - 1)]
        finish = "stop"
        if self.honour_stops:
            ends = [text.index(stop) + len(stop) for stop in STOPS if stop in text]
            text = text[: min(ends)] if ends else text
        ids = encode_text(self.tokenizer, text)
        if len(ids) > sampling_params["max_new_tokens"]:
            ids, finish = ids[: sampling_params["max_new_tokens"]], "length"
        versions = [self.weight_version] * len(ids) if self.per_token_versions else None
        return GenerateResult(
            output_ids=ids,
            output_logprobs=[-0.5 - 0.01 * i for i in range(len(ids))],
            finish_reason=self.finish_reason or finish,
            matched_stop=None,
            weight_versions=versions,
            weight_version=str(self.weight_version),
            prompt_tokens=len(input_ids),
        )


class FakeSearch:
    """Stands in for `SearchTool` and the retrieval server behind it: fixed documents per query;
    a query containing FAIL raises SearchError as the real tool does after its retries."""

    def __init__(self, text: str = "Paris is the capital of France."):
        self.text = text
        self.queries: list[str] = []

    async def search(self, queries: list[str]) -> list[list[dict]]:
        self.queries.extend(queries)
        if any("FAIL" in q for q in queries):
            raise SearchError(
                "search failed: retrieval server http://127.0.0.1:1/retrieve did not answer after "
                "4 attempts (ClientConnectorError)."
            )
        return [
            [
                {
                    "document": {"id": str(i), "contents": f'"Doc{i}"\n{self.text} ({q})'},
                    "score": 1.0 - i / 10,
                }
                for i in range(3)
            ]
            for q in queries
        ]


PROMPT = Prompt(
    prompt_id="p1", question="What is the capital of France?", golden_answers=["Paris"], data_source="kb_1hop"
)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def run(
    tokenizer, turns, cfg=None, search=None, **engine_kwargs
) -> tuple[Trajectory, FakeEngine, FakeSearch]:
    engine = FakeEngine(tokenizer, turns, **engine_kwargs)
    search = search or FakeSearch()
    cfg = cfg or AgentLoopConfig(task_name="searchr1", max_turns=2)
    traj = asyncio.run(run_trajectory(PROMPT, engine, search, tokenizer, cfg))
    check_alignment(traj, tokenizer)
    return traj, engine, search


def check_alignment(traj: Trajectory, tokenizer) -> None:
    n = len(traj.response_ids)
    assert len(traj.loss_mask) == len(traj.rollout_logprobs) == len(traj.weight_versions) == n
    for mask, logprob, version in zip(
        traj.loss_mask, traj.rollout_logprobs, traj.weight_versions, strict=True
    ):
        assert (logprob < 0 and version >= 0) if mask else (logprob == 0.0 and version == -1)
    assert (
        tokenizer.decode(traj.prompt_ids + traj.response_ids)
        == tokenizer.decode(traj.prompt_ids) + traj.response_text
    )


def masked_segments(traj: Trajectory, tokenizer) -> list[tuple[int, str]]:
    """The response as (mask, text) runs, for asserting which text is trained on."""
    runs: list[tuple[int, list[int]]] = []
    for token, mask in zip(traj.response_ids, traj.loss_mask, strict=True):
        if runs and runs[-1][0] == mask:
            runs[-1][1].append(token)
        else:
            runs.append((mask, [token]))
    return [(mask, tokenizer.decode(ids)) for mask, ids in runs]


def test_search_then_answer(tokenizer):
    turns = [
        "<think>I need facts.</think>\n<search> capital of France </search>",
        "<think>Found it.</think>\n<answer> Paris </answer>",
    ]
    traj, engine, search = run(tokenizer, turns)
    assert traj.finish_reason == "answer" and traj.num_turns == 2
    assert traj.searches == ["capital of France"] == search.queries
    assert traj.reward == 1.0 and traj.em == 1.0 and traj.answer == "Paris"
    segments = masked_segments(traj, tokenizer)
    assert [mask for mask, _ in segments] == [1, 0, 1]
    assert segments[0][1] == turns[0] and segments[2][1] == turns[1]
    info = segments[1][1]
    assert info.startswith(INFO_OPEN + "Doc 1(Title:") and info.endswith(INFO_CLOSE)
    assert "Doc 3(Title:" in info
    # each request continues the transcript exactly and carries the task name
    assert engine.requests[0]["input_ids"] == traj.prompt_ids
    first_turn_and_info = len(encode_text(tokenizer, turns[0])) + len(encode_text(tokenizer, info))
    assert engine.requests[1]["input_ids"] == traj.prompt_ids + traj.response_ids[:first_turn_and_info]
    assert all(r["extra"] == {"task_name": "searchr1"} for r in engine.requests)
    assert traj.weight_versions[0] == 3 and traj.min_weight_version == traj.max_weight_version == 3
    assert traj.rollout_logprobs[:2] == [-0.5, -0.51]


def test_invalid_action_gets_the_masked_correction(tokenizer):
    turns = ["I think it is Paris.", "<think>retry</think><answer> Paris </answer>"]
    traj, _, _ = run(tokenizer, turns)
    assert traj.num_invalid_actions == 1 and traj.finish_reason == "answer" and traj.reward == 1.0
    assert masked_segments(traj, tokenizer)[1] == (0, INVALID_ACTION_TEXT)


def test_empty_query_is_invalid_and_never_searched(tokenizer):
    traj, _, search = run(tokenizer, ["<search>   </search>", "<answer> Paris </answer>"])
    assert search.queries == [] and traj.searches == [] and traj.num_invalid_actions == 1
    assert traj.reward == 1.0


def test_answer_without_tags_scores_zero(tokenizer):
    traj, _, _ = run(tokenizer, ["Paris"], cfg=AgentLoopConfig(max_turns=1))
    assert traj.answer is None and traj.reward == 0.0
    # turn 1 invalid -> correction; turn 2 is the last turn and invalid -> the trajectory ends
    assert traj.num_turns == 2 and traj.finish_reason == "max_turns" and traj.num_invalid_actions == 1


def test_tool_text_never_counts_as_the_answer(tokenizer):
    """The correction message itself says "<answer> and </answer>"; only the model's turns are read,
    and an answer never spans a tool message."""
    prompt = replace(PROMPT, golden_answers=["and"])
    engine = FakeEngine(tokenizer, ["<answer> and", "</answer>"])
    traj = asyncio.run(run_trajectory(prompt, engine, FakeSearch(), tokenizer, AgentLoopConfig(max_turns=2)))
    assert INVALID_ACTION_TEXT in traj.response_text
    assert traj.answer is None and traj.reward == 0.0 and traj.em == 0.0


def test_unbalanced_tags(tokenizer):
    traj, _, search = run(
        tokenizer, ["<search> a <search> b </search>", "<answer> x <answer> Paris </answer>"]
    )
    assert search.queries == ["b"] and traj.answer == "Paris" and traj.reward == 1.0


def test_text_after_answer_is_ignored(tokenizer):
    traj, _, _ = run(tokenizer, ["<answer> Paris </answer> and some more text"], honour_stops=False)
    assert traj.finish_reason == "answer" and traj.num_turns == 1
    assert traj.answer == "Paris" and traj.reward == 1.0
    assert traj.response_text.endswith("more text")  # the sampled tokens are kept as they came


def test_search_after_the_last_turn_gets_answer_now_then_answers(tokenizer):
    turns = ["<search> q1 </search>", "<search> q2 </search>", "<answer> Paris </answer>"]
    traj, _, search = run(tokenizer, turns, cfg=AgentLoopConfig(max_turns=1))
    assert search.queries == ["q1"]  # the second search was never run
    assert traj.num_turns == 3 and traj.finish_reason == "answer" and traj.reward == 1.0
    assert (0, ANSWER_NOW_TEXT) in masked_segments(traj, tokenizer)


def test_search_in_the_grace_turn_ends_the_trajectory(tokenizer):
    traj, _, search = run(tokenizer, ["<search> q </search>"], cfg=AgentLoopConfig(max_turns=2))
    assert search.queries == ["q", "q"] and traj.num_searches == 2
    assert traj.num_turns == 4 and traj.finish_reason == "max_turns" and traj.reward == 0.0


def test_zero_max_turns_is_refused():
    """A trajectory of the Search-R1 task needs a search turn: max_turns=0 was accepted silently."""
    with pytest.raises(ConfigError, match="agentloop.max_turns=0: must be >= 1 and at most"):
        AgentLoopConfig(max_turns=0)


def test_retrieval_error_becomes_masked_error_text(tokenizer):
    turns = ["<search> FAIL please </search>", "<answer> Paris </answer>"]
    traj, _, _ = run(tokenizer, turns)
    assert traj.num_search_errors == 1 and traj.searches == ["FAIL please"]
    assert traj.finish_reason == "answer" and traj.reward == 1.0
    mask, info = masked_segments(traj, tokenizer)[1]
    assert mask == 0 and info.startswith(INFO_OPEN + "search failed:") and "did not answer" in info
    assert info.endswith(INFO_CLOSE)


def test_information_block_is_truncated_to_its_budget(tokenizer):
    cfg = AgentLoopConfig(max_turns=2, max_info_tokens=40)
    search = FakeSearch(text="word " * 200)
    traj, _, _ = run(tokenizer, ["<search> q </search>", "<answer> Paris </answer>"], cfg=cfg, search=search)
    mask, info = masked_segments(traj, tokenizer)[1]
    assert mask == 0 and len(encode_text(tokenizer, info)) <= 40
    assert info.startswith(INFO_OPEN + "Doc 1(Title:") and info.endswith(INFO_CLOSE)
    assert traj.reward == 1.0  # the loop went on after the truncated block


def test_response_budget_is_never_exceeded(tokenizer):
    cfg = AgentLoopConfig(max_turns=4, max_response_tokens=60, max_new_tokens_per_turn=25)
    traj, engine, _ = run(tokenizer, ["<think>" + "long thought " * 20], cfg=cfg)
    assert traj.finish_reason == "length" and len(traj.response_ids) <= 60
    assert all(r["sampling_params"]["max_new_tokens"] <= 25 for r in engine.requests)
    # the last turn was only given what was left of the budget
    before_last = len(engine.requests[-1]["input_ids"]) - len(traj.prompt_ids)
    assert engine.requests[-1]["sampling_params"]["max_new_tokens"] == min(25, 60 - before_last)


def test_engine_abort_ends_the_trajectory(tokenizer):
    traj, _, _ = run(tokenizer, ["<think>partial"], finish_reason="abort")
    assert traj.finish_reason == "abort" and traj.num_turns == 1 and sum(traj.loss_mask) > 0


def test_request_level_weight_version_when_engine_has_no_per_token_versions(tokenizer):
    traj, _, _ = run(tokenizer, ["<answer> Paris </answer>"], per_token_versions=False, weight_version=7)
    assert set(traj.weight_versions) == {7}


def test_sampling_params_greedy_and_sampled(tokenizer):
    cfg = AgentLoopConfig(temperature=0.7, top_p=0.9, top_k=20)
    sampled = sampling_params(cfg, tokenizer, 32, greedy=False)
    assert (sampled["temperature"], sampled["top_p"], sampled["top_k"]) == (0.7, 0.9, 20)
    assert sampled["stop"] == ["</search>", "</answer>"] and sampled["stop_token_ids"] == [
        tokenizer.eos_token_id
    ]
    assert sampling_params(cfg, tokenizer, 32, greedy=True)["temperature"] == 0.0


def test_group_runs_concurrently(tokenizer):
    engine = FakeEngine(tokenizer, ["<search> q </search>", "<answer> Paris </answer>"])
    search = FakeSearch()
    cfg = AgentLoopConfig(task_name="searchr1", max_turns=2)
    group = asyncio.run(run_group(PROMPT, 4, engine, search, tokenizer, cfg))
    assert [t.sample_index for t in group] == [0, 1, 2, 3]
    assert engine.peak_inflight == 4  # all four were generating at once
    assert all(t.reward == 1.0 and t.task_name == "searchr1" and t.prompt_id == "p1" for t in group)
    assert all(t.prompt_ids == build_prompt_ids(tokenizer, PROMPT.question) for t in group)
    assert len({r["rid"] for r in engine.requests}) == len(engine.requests) == 8


def test_trajectory_record_is_json_ready(tokenizer):
    import dataclasses
    import json

    traj, _, _ = run(
        tokenizer, ["<answer> paris </answer>"], cfg=replace(AgentLoopConfig(), format_reward=True)
    )
    record = json.loads(json.dumps(traj.to_dict()))
    assert record == json.loads(json.dumps(dataclasses.asdict(traj)))  # the shallow dict holds everything
    assert record["reward"] == pytest.approx(0.8) and record["em"] == 1.0  # correct, but no <think> first
    assert record["golden_answers"] == ["Paris"] and record["data_source"] == "kb_1hop"


class FailingEngine(FakeEngine):
    """Stands in for an engine process that errors on one trajectory's request (e.g. an HTTP 500)."""

    async def generate(self, input_ids, sampling_params, rid=None, extra=None) -> GenerateResult:
        if rid.startswith("agent-p1-1-"):  # sample 1 of prompt p1 (no task name: "agent")
            raise RuntimeError("engine answered 500")
        return await super().generate(input_ids, sampling_params, rid, extra)


def test_group_failure_cancels_the_siblings(tokenizer):
    engine = FailingEngine(tokenizer, ["<search> q </search>", "<answer> Paris </answer>"])

    async def main():
        with pytest.raises(RuntimeError, match="engine answered 500"):
            await run_group(PROMPT, 4, engine, FakeSearch(), tokenizer, AgentLoopConfig(max_turns=2))
        await asyncio.sleep(0.05)
        return [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]

    assert asyncio.run(main()) == []  # no sibling left running
    assert len(engine.requests) < 8  # the siblings never reached their second turn


class CountingTokenizer:
    """The real tokenizer, counting the texts it encodes (the agent loop tokenizes on the driver's event loop)."""

    def __init__(self, tokenizer):
        self._tokenizer, self.encoded = tokenizer, []

    def encode(self, text, **kwargs):
        self.encoded.append(text)
        return self._tokenizer.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.mark.parametrize("max_info_tokens", [512, 40])  # the block as retrieved, and cut to its budget
def test_information_block_is_encoded_once(tokenizer, max_info_tokens):
    counting = CountingTokenizer(tokenizer)
    cfg = AgentLoopConfig(max_turns=2, max_info_tokens=max_info_tokens)
    search = FakeSearch(text="word " * 30)
    traj, _, _ = run(counting, ["<search> q </search>", "<answer> Paris </answer>"], cfg=cfg, search=search)
    info = masked_segments(traj, tokenizer)[1][1]
    assert info.startswith(INFO_OPEN) and (len(encode_text(tokenizer, info)) <= 40) == (max_info_tokens == 40)
    assert counting.encoded.count(info) == 1
    # the ids the tool handed on are the block's own
    start, info_ids = len(encode_text(tokenizer, "<search> q </search>")), encode_text(tokenizer, info)
    assert traj.response_ids[start : start + len(info_ids)] == info_ids
