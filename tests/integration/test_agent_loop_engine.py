"""The agent loop for real: the embedded engine process (tiny random Llama), the retrieval server over a
small generated knowledge base, 8 concurrent groups.

A random model rarely writes tags, so the searches through the real retriever are exercised by one
group driven by a scripted engine (the only fake here, standing in for the engine process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import replace

import pytest
import torch

from tandemrl.agent.loop import Trajectory, run_group
from tandemrl.agent.prompt import ANSWER_NOW_TEXT, INFO_CLOSE, INFO_OPEN, INVALID_ACTION_TEXT, encode_text
from tandemrl.agent.reward import normalize_answer
from tandemrl.agent.search_tool import SearchTool
from tandemrl.config.agent import AgentLoopConfig
from tandemrl.data.loader import Prompt, load_prompts
from tandemrl.rollout.client import EngineClient, GenerateResult

NUM_GROUPS, GROUP_SIZE = 8, 2
CFG = AgentLoopConfig(
    task_name="it-agent", max_turns=2, max_response_tokens=160, max_new_tokens_per_turn=24, max_info_tokens=64
)


@pytest.fixture(scope="module")
def kb_dir(tmp_path_factory):
    from tandemrl.data.kb import generate_kb

    return generate_kb(
        tmp_path_factory.mktemp("agent_kb"), seed=0, num_entities=40, num_train=40, num_val=8, num_test=8
    )


@pytest.fixture(scope="module")
def servers(kb_dir, tiny_llama_dir, minilm_dir, tmp_path_factory):
    """The engine and the retrieval server, started side by side (launched first, then waited for)."""
    from tandemrl.retrieval.build import build_index
    from tandemrl.retrieval.server_process import RetrievalServerProcess
    from tandemrl.rollout.engine_process import EngineProcess

    engine = EngineProcess(
        tiny_llama_dir, device="cpu", dtype="float32", max_running_requests=32, max_context_len=1024, seed=0
    )
    engine.launch()  # from this thread: a child dies with the thread that launched it
    index_dir = tmp_path_factory.mktemp("agent_index")
    retrieval = RetrievalServerProcess(index_dir, mode="dense")
    try:
        build_index(kb_dir / "corpus.jsonl", index_dir, encoder=str(minilm_dir), show_progress=False)
        retrieval.start()
        engine.wait_healthy()
        assert engine.is_alive(), f"engine failed to start:\n{engine.log_tail()}"
        yield engine.url, retrieval.addr
    finally:
        engine.stop()
        retrieval.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


async def run_groups(url: str, addr: str, prompts, tokenizer, cfg: AgentLoopConfig) -> list[list[Trajectory]]:
    engine, search = EngineClient(url), SearchTool(addr, topk=3)
    try:
        return await asyncio.gather(
            *[run_group(p, GROUP_SIZE, engine, search, tokenizer, cfg) for p in prompts]
        )
    finally:
        await engine.close()
        await search.close()


def tool_texts_ok(traj: Trajectory, tokenizer) -> None:
    """Every mask-0 run is one of our tool texts, tokenized exactly as we tokenize it."""
    runs, start = [], 0
    for i in range(1, len(traj.loss_mask) + 1):
        if i == len(traj.loss_mask) or traj.loss_mask[i] != traj.loss_mask[start]:
            runs.append((traj.loss_mask[start], traj.response_ids[start:i]))
            start = i
    for mask, ids in runs:
        if mask == 0:
            text = tokenizer.decode(ids)
            is_info = text.startswith(INFO_OPEN) and text.endswith(INFO_CLOSE)
            assert is_info or text in (INVALID_ACTION_TEXT, ANSWER_NOW_TEXT), text
            assert ids == encode_text(tokenizer, text)
    assert traj.loss_mask[0] == 1  # a response always opens with the model's tokens


def test_agent_loop_with_engine_and_retriever(servers, kb_dir, tokenizer, tiny_llama_dir):
    url, addr = servers
    prompts = load_prompts([kb_dir / "train.jsonl"], limit=NUM_GROUPS)
    groups = asyncio.run(run_groups(url, addr, prompts, tokenizer, CFG))
    assert [len(group) for group in groups] == [GROUP_SIZE] * NUM_GROUPS
    trajectories = [traj for group in groups for traj in group]
    for prompt, group in zip(prompts, groups, strict=True):
        assert all(t.prompt_id == prompt.prompt_id and t.task_name == "it-agent" for t in group)
    for traj in trajectories:
        n = len(traj.response_ids)
        assert 0 < n <= CFG.max_response_tokens and traj.finish_reason in ("answer", "length", "max_turns")
        assert len(traj.loss_mask) == len(traj.rollout_logprobs) == len(traj.weight_versions) == n
        # the transcript is exactly what decoding the ids gives
        assert (
            tokenizer.decode(traj.prompt_ids + traj.response_ids)
            == tokenizer.decode(traj.prompt_ids) + traj.response_text
        )
        # versions and logprobs exist exactly on the model's tokens (the engine starts at version 0)
        for mask, logprob, version in zip(
            traj.loss_mask, traj.rollout_logprobs, traj.weight_versions, strict=True
        ):
            assert (version == 0 and logprob < 0) if mask else (version == -1 and logprob == 0.0)
        tool_texts_ok(traj, tokenizer)
    assert sum(t.num_turns for t in trajectories) > len(trajectories)  # invalid turns were corrected
    check_logprobs_against_hf(trajectories, tiny_llama_dir)


def check_logprobs_against_hf(trajectories: list[Trajectory], model_dir) -> None:
    """The rollout logprobs are the model's log-softmax at exactly the mask-1 positions: a
    teacher-forced HF forward over prompt + response gives the same numbers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for traj in trajectories:
        ids = torch.tensor([traj.prompt_ids + traj.response_ids])
        with torch.no_grad():
            logp_TV = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        start = len(traj.prompt_ids)
        targets = ids[0, start:]
        ref = logp_TV[start - 1 : -1].gather(-1, targets[:, None]).squeeze(-1)
        mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
        got = torch.tensor(traj.rollout_logprobs)
        torch.testing.assert_close(got[mask], ref[mask], atol=2e-3, rtol=0)
        # sampled at temperature 1, not argmaxed: some tokens are below the row's best
        assert (got[mask] < logp_TV[start - 1 : -1][mask].max(-1).values - 1e-3).any()


class FakeScriptedEngine:
    """Stands in for the engine process: for each question (recognised in the prompt) it first
    searches the question's gold query, then, once an information block is in its context, answers
    the gold answer; so the real retrieval server's documents flow through the loop."""

    def __init__(self, tokenizer, records: list[dict]):
        self.tokenizer, self.records = tokenizer, records
        self.extras: list[dict | None] = []

    async def generate(self, input_ids, sampling_params, rid=None, extra=None) -> GenerateResult:
        self.extras.append(extra)
        context = self.tokenizer.decode(input_ids)
        record = next(r for r in self.records if r["question"] in context)
        if INFO_OPEN not in context:  # the instruction names <information> too, without the newlines
            text = f"<think>look it up</think>\n<search> {record['gold_queries'][0]} </search>"
        else:
            text = f"<think>found</think>\n<answer> {record['golden_answers'][0]} </answer>"
        ids = encode_text(self.tokenizer, text)[: sampling_params["max_new_tokens"]]
        return GenerateResult(
            output_ids=ids,
            output_logprobs=[-1.0] * len(ids),
            finish_reason="stop",
            matched_stop=None,
            weight_versions=[5] * len(ids),
            weight_version="5",
            prompt_tokens=len(input_ids),
        )


def test_searches_through_the_real_retriever(servers, kb_dir, tokenizer):
    _, addr = servers
    records = [json.loads(line) for line in (kb_dir / "train.jsonl").read_text().splitlines()]
    records = [r for r in records if r["data_source"] == "kb_1hop"][:4]
    prompts = [Prompt(r["id"], r["question"], r["golden_answers"], r["data_source"]) for r in records]
    engine, cfg = (
        FakeScriptedEngine(tokenizer, records),
        replace(CFG, max_info_tokens=96, max_new_tokens_per_turn=64),
    )

    async def main():
        search = SearchTool(addr, topk=3)
        try:
            return await asyncio.gather(*[run_group(p, 2, engine, search, tokenizer, cfg) for p in prompts])
        finally:
            await search.close()

    trajectories = [traj for group in asyncio.run(main()) for traj in group]
    assert all(extra == {"task_name": "it-agent"} for extra in engine.extras)
    num_hits = 0
    for traj, record in zip(trajectories, [r for r in records for _ in range(2)], strict=True):
        assert traj.searches == [record["gold_queries"][0]] and traj.num_search_errors == 0
        assert traj.finish_reason == "answer" and traj.reward == 1.0 and traj.num_turns == 2
        tool_texts_ok(traj, tokenizer)
        info = tokenizer.decode([t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m == 0])
        assert info.startswith(INFO_OPEN + "Doc 1(Title: ") and "Doc 3(Title: " in info
        assert len(encode_text(tokenizer, info)) <= cfg.max_info_tokens
        num_hits += normalize_answer(record["golden_answers"][0]) in normalize_answer(info)
    assert num_hits >= len(trajectories) // 2  # the gold query finds the gold passage most of the time


def test_tandem_eval(servers, kb_dir, tiny_llama_dir, tmp_path, capsys):
    """`tandem eval` end to end against the running engine (as an external SGLang-protocol server)
    and retrieval server: one greedy trajectory per test question, in file order, and the table."""
    from tandemrl.commands.evaluate import run_eval

    url, addr = servers
    overrides = [
        f"rollout.model.model_path={tiny_llama_dir}",
        "rollout.backend=sglang",
        f"rollout.server_addrs=[{url}]",
        "retrieval.launch=false",
        f"tools.search.server_addr={addr}",
        f"retrieval.corpus_path={kb_dir / 'corpus.jsonl'}",
        f"runner.output_dir={tmp_path}",
        "agentloop.max_new_tokens_per_turn=16",
        "agentloop.max_response_tokens=80",
    ]
    args = argparse.Namespace(
        config="examples/searchr1/config/embedded_cpu_sync.yaml",
        overrides=overrides,
        split="test",
        limit=5,
        out=None,
    )
    assert run_eval(args) == 0
    records = [
        json.loads(line) for line in (tmp_path / "eval" / "test_trajectories.jsonl").read_text().splitlines()
    ]
    test_ids = [json.loads(line)["id"] for line in (kb_dir / "test.jsonl").read_text().splitlines()][:5]
    assert [r["prompt_id"].split(":")[-1] for r in records] == test_ids
    assert all(r["task_name"] == "searchr1" and len(r["response_ids"]) <= 80 for r in records)
    table = capsys.readouterr().out
    assert "overall" in table and "em" in table and "5 questions in" in table


def test_tandem_eval_scores_with_the_custom_reward(servers, kb_dir, tiny_llama_dir, tmp_path, capsys):
    """`reward.function` by path changes the reward `tandem eval` reports, per trajectory and per source,
    with the function's extra metric; exact match stays as it was."""
    from tandemrl.commands.evaluate import run_eval

    reward_file = tmp_path / "gold_length_reward.py"
    reward_file.write_text(
        "def reward(golden_answers):\n"
        "    return {'score': 0.5 + len(golden_answers[0]) / 100, 'gold_chars': float(len(golden_answers[0]))}\n"
    )
    url, addr = servers
    overrides = [
        f"rollout.model.model_path={tiny_llama_dir}",
        "rollout.backend=sglang",
        f"rollout.server_addrs=[{url}]",
        "retrieval.launch=false",
        f"tools.search.server_addr={addr}",
        f"retrieval.corpus_path={kb_dir / 'corpus.jsonl'}",
        f"runner.output_dir={tmp_path}",
        "agentloop.max_new_tokens_per_turn=16",
        "agentloop.max_response_tokens=80",
        f"reward.function={reward_file}:reward",
    ]
    args = argparse.Namespace(
        config="examples/searchr1/config/embedded_cpu_sync.yaml",
        overrides=overrides,
        split="test",
        limit=4,
        out=None,
    )
    assert run_eval(args) == 0
    records = [
        json.loads(line) for line in (tmp_path / "eval" / "test_trajectories.jsonl").read_text().splitlines()
    ]
    assert len(records) == 4
    for record in records:
        assert record["reward"] == pytest.approx(0.5 + len(record["golden_answers"][0]) / 100)
        assert record["reward_extra"] == {"gold_chars": float(len(record["golden_answers"][0]))}
    summary = json.loads((tmp_path / "eval" / "test_summary.json").read_text())["summary"]
    expected = sum(r["reward"] for r in records) / len(records)
    assert summary["overall"]["reward"] == pytest.approx(expected) and expected not in (0.0, 1.0)
    assert summary["overall"]["reward_extra/gold_chars"] == pytest.approx(
        sum(len(r["golden_answers"][0]) for r in records) / len(records)
    )
    assert " reward" in capsys.readouterr().out.splitlines()[0]  # the table's reward column
