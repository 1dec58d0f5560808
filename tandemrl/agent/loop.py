"""The Search-R1 agent loop: one trajectory = generate, parse, search, insert the results, repeat.

    prompt ids ─► engine.generate (stop at </search>, </answer>, </tool tags>, EOS) ─► parse the turn's action
        answer  ─► done ─► reward (env.reward: built-in EM, or reward.function)
        search  ─► search tool ─► information block (masked) ─► next turn
        <tag>   ─► the plug-in tool of that tag ─► result block (masked) ─► next turn
        invalid ─► Search-R1's correction message (masked)    ─► next turn

The tools and the reward come in an `AgentEnv` (agent/tools.py); a bare search tool stands for the
built-in environment (search only, exact match).

Invariants:
- token in, token out: the ids the engine sampled are appended exactly as returned, with their
  logprobs and weight versions and loss mask 1; only tool text (information blocks, correction
  messages) is tokenized here, and it gets mask 0, logprob 0.0 and weight version -1.
- budgets: the response (model + tool tokens after the prompt) never exceeds
  `max_response_tokens`; one information block never exceeds `max_info_tokens`.
- turns: at most `max_turns + 1` generation turns, so at most `max_turns` tool calls (searches or
  plug-in tools), and the last turn must answer (as in Search-R1). A tool call in that last turn is not run: the model gets
  the masked "answer now" message and one grace turn; anything but an answer then ends the
  trajectory with finish_reason "max_turns". An invalid last turn ends it at once.
- a retrieval failure (SearchError after the tool's retries) becomes an error text inside the
  information block, is counted in `num_search_errors`, and the loop goes on; a plug-in tool's
  failure likewise, counted in `num_tool_errors`.
- a turn that ends at EOS (or at the per-turn token limit) without a closing tag is an invalid
  action like any other: the correction message follows, as in Search-R1 and slime, and the EOS
  stays in the response exactly as sampled.
- the answer is the last `<answer>` the model wrote, read turn by turn: tool text never counts.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from tandemrl.agent.parser import ANSWER, INVALID, SEARCH, Action, extract_answer, parse_action
from tandemrl.agent.prompt import (
    ANSWER_NOW_TEXT,
    INVALID_ACTION_TEXT,
    STOP_STRINGS,
    build_prompt_ids,
    encode_text,
)
from tandemrl.agent.reward import em_check
from tandemrl.agent.tools import AgentEnv, ToolOutput

if TYPE_CHECKING:
    from tandemrl.agent.search_tool import SearchTool
    from tandemrl.config.agent import AgentLoopConfig
    from tandemrl.data.loader import Prompt
    from tandemrl.rollout.client import EngineClient, GenerateResult

# finish reasons of a trajectory
FINISH_ANSWER = "answer"  # the model answered
FINISH_LENGTH = "length"  # max_response_tokens reached
FINISH_MAX_TURNS = "max_turns"  # the last (or grace) turn did not answer
FINISH_ABORT = "abort"  # the engine aborted the request (e.g. pause_generation(mode="abort"))


@dataclass
class Trajectory:
    """One rollout; every per-token list is aligned with `response_ids`."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 on model-sampled tokens, 0 on tool text
    rollout_logprobs: list[float] = field(default_factory=list)  # 0.0 where mask is 0
    weight_versions: list[int] = field(default_factory=list)  # -1 where mask is 0 (or unknown)
    searches: list[str] = field(default_factory=list)  # the queries sent to the retriever
    tool_calls: list[dict] = field(default_factory=list)  # plug-in tool calls: {"tool": tag, "input": text}
    num_turns: int = 0  # generation requests made
    finish_reason: str = ""
    reward: float = 0.0
    em: float = 0.0  # exact match of the answer alone (the reward without any format score)
    prompt_id: str = ""
    data_source: str = ""
    task_name: str | None = None
    sample_index: int = 0  # position in its group
    question: str = ""
    golden_answers: list[str] = field(default_factory=list)
    answer: str | None = None  # the last <answer> the model wrote (tool text never counts)
    response_text: str = ""  # the transcript after the prompt: decoded model turns + tool text
    num_search_errors: int = 0
    num_tool_errors: int = 0  # plug-in tool calls that failed (their error text went to the model)
    num_invalid_actions: int = 0
    reward_extra: dict[str, float] = field(default_factory=dict)  # a reward function's other metrics
    # where the trajectory's wall time went (seconds): waiting on the engine (of which inside its server, where
    # the server reports it), on searches, and in all (the rest is the agent's own host work, other tools
    # and queuing)
    wall_s: float = 0.0
    generate_s: float = 0.0
    server_s: float = 0.0
    search_s: float = 0.0

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def num_searches(self) -> int:
        return len(self.searches)

    @property
    def min_weight_version(self) -> int | None:
        """The earliest policy version among the model's tokens (None without any)."""
        versions = [v for v, m in zip(self.weight_versions, self.loss_mask, strict=True) if m and v >= 0]
        return min(versions) if versions else None

    @property
    def max_weight_version(self) -> int | None:
        versions = [v for v, m in zip(self.weight_versions, self.loss_mask, strict=True) if m and v >= 0]
        return max(versions) if versions else None

    def to_dict(self) -> dict:
        """The fields by name, shallow (the lists are the trajectory's own): for writing JSON at once.
        dataclasses.asdict copies every list element by element: 0.26 s for a step's 256 trajectories on a
        2-core CPU, on the runner's path (runner/records.py; benchmarks/runner/step_records.py)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


async def run_group(
    prompt: Prompt,
    group_size: int,
    engine: EngineClient,
    env: AgentEnv | SearchTool,
    tokenizer,
    cfg: AgentLoopConfig,
    greedy: bool = False,
) -> list[Trajectory]:
    """The `group_size` trajectories of one prompt, run concurrently; returns when all are done.

    If one trajectory fails, the others are cancelled and its error propagates as it was raised.
    """
    prompt_ids = build_prompt_ids(tokenizer, prompt.question)
    coroutines = [
        run_trajectory(prompt, engine, env, tokenizer, cfg, greedy, sample_index=i, prompt_ids=prompt_ids)
        for i in range(group_size)
    ]
    return await gather_or_cancel(coroutines)


async def gather_or_cancel(coroutines: list) -> list:
    """`asyncio.gather` that cancels (and awaits) the siblings of the first failure before re-raising it."""
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def run_trajectory(
    prompt: Prompt,
    engine: EngineClient,
    env: AgentEnv | SearchTool,
    tokenizer,
    cfg: AgentLoopConfig,
    greedy: bool = False,
    sample_index: int = 0,
    prompt_ids: list[int] | None = None,
) -> Trajectory:
    """Run one Search-R1 trajectory to its end and score it; `env` is the run's AgentEnv, or a bare
    search tool for the built-in one."""
    if not isinstance(env, AgentEnv):
        env = AgentEnv.builtin(env, cfg.max_info_tokens, cfg.format_reward)
    if prompt_ids is None:
        prompt_ids = build_prompt_ids(tokenizer, prompt.question)
    traj = Trajectory(
        prompt_ids=list(prompt_ids),
        prompt_id=prompt.prompt_id,
        data_source=prompt.data_source,
        task_name=cfg.task_name,
        sample_index=sample_index,
        question=prompt.question,
        golden_answers=list(prompt.golden_answers),
    )
    rid_prefix = f"{cfg.task_name or 'agent'}-{prompt.prompt_id}-{sample_index}-{uuid.uuid4().hex[:8]}"
    is_grace_turn = False
    start_s = time.monotonic()
    while not traj.finish_reason:
        max_new_tokens = min(cfg.max_new_tokens_per_turn, _remaining(traj, cfg))
        if max_new_tokens <= 0:
            traj.finish_reason = FINISH_LENGTH
            break
        generate_start_s = time.monotonic()
        result = await engine.generate(
            traj.prompt_ids + traj.response_ids,
            sampling_params(cfg, tokenizer, max_new_tokens, greedy, env.stop_strings),
            rid=f"{rid_prefix}-t{traj.num_turns}",
            extra={"task_name": cfg.task_name},
        )
        traj.generate_s += time.monotonic() - generate_start_s
        traj.server_s += getattr(result, "server_s", None) or 0.0
        turn_text = _append_model_turn(traj, result, tokenizer)
        if result.finish_reason == "abort":
            traj.finish_reason = FINISH_ABORT
            break
        message = await _respond(traj, parse_action(turn_text, env.tags), is_grace_turn, env, tokenizer, cfg)
        is_grace_turn = message is not None and message.text == ANSWER_NOW_TEXT
        if message is not None and not _append_tool_text(traj, message, tokenizer, cfg):
            traj.finish_reason = FINISH_LENGTH
    traj.wall_s = time.monotonic() - start_s
    _score(traj, tokenizer, env)
    return traj


async def _respond(
    traj: Trajectory, action: Action, is_grace_turn: bool, env: AgentEnv, tokenizer, cfg: AgentLoopConfig
) -> ToolOutput | None:
    """The tool text that answers the turn's action, or None with `finish_reason` set when it ends."""
    if action.kind == ANSWER:
        traj.finish_reason = FINISH_ANSWER
        return None
    is_tool = action.kind != INVALID
    is_last_turn = is_grace_turn or traj.num_turns > cfg.max_turns
    if is_last_turn and (is_grace_turn or not is_tool):
        traj.finish_reason = FINISH_MAX_TURNS
        return None
    if is_tool and is_last_turn:
        return ToolOutput(ANSWER_NOW_TEXT)  # the grace turn follows
    if is_tool:
        message = await _call_tool(traj, action, env, tokenizer, cfg)
        if message is None:
            traj.finish_reason = FINISH_LENGTH
        return message
    traj.num_invalid_actions += 1
    return ToolOutput(INVALID_ACTION_TEXT)


def sampling_params(
    cfg: AgentLoopConfig, tokenizer, max_new_tokens: int, greedy: bool, stop: list[str] | None = None
) -> dict:
    """SGLang sampling params of one turn: stop at the closing tags (`stop`: the env's, by default
    </search> and </answer>) or at end of sequence."""
    params = {"max_new_tokens": max_new_tokens, "stop": list(stop or STOP_STRINGS)}
    if tokenizer.eos_token_id is not None:
        params["stop_token_ids"] = [tokenizer.eos_token_id]
    if greedy:
        params.update(temperature=0.0, top_p=1.0, top_k=-1)
    else:
        params.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    return params


def _remaining(traj: Trajectory, cfg: AgentLoopConfig) -> int:
    return cfg.max_response_tokens - len(traj.response_ids)


def _append_model_turn(traj: Trajectory, result: GenerateResult, tokenizer) -> str:
    """Append the engine's ids untouched; returns the turn's text (for parsing and the transcript)."""
    traj.num_turns += 1
    num_tokens = len(result.output_ids)
    if len(result.output_logprobs) != num_tokens:
        raise ValueError(
            f"engine returned {num_tokens} output ids but {len(result.output_logprobs)} logprobs; "
            "the agent loop needs the logprob of every sampled token (check the engine's "
            "return_logprob support)."
        )
    versions = result.weight_versions
    if versions is None:  # a real SGLang reports one version per request, not per token
        versions = [_parse_version(result.weight_version)] * num_tokens
    assert len(versions) == num_tokens, "engine returned a weight version per token of another length"
    traj.response_ids.extend(result.output_ids)
    traj.loss_mask.extend([1] * num_tokens)
    traj.rollout_logprobs.extend(float(lp) for lp in result.output_logprobs)
    traj.weight_versions.extend(int(v) for v in versions)
    turn_text = tokenizer.decode(result.output_ids)
    traj.response_text += turn_text
    # per turn, so an <answer> never spans a tool message; the last one the model wrote wins
    answer = extract_answer(turn_text)
    traj.answer = answer if answer is not None else traj.answer
    return turn_text


def _append_tool_text(traj: Trajectory, message: ToolOutput, tokenizer, cfg: AgentLoopConfig) -> bool:
    """Append masked tool text (its ids as the tool encoded them, or encoded here); False (nothing
    appended) when it would leave no token for the model."""
    text = message.text
    ids = message.ids if message.ids is not None else encode_text(tokenizer, text)
    if len(ids) >= _remaining(traj, cfg):
        return False
    traj.response_ids.extend(ids)
    traj.loss_mask.extend([0] * len(ids))
    traj.rollout_logprobs.extend([0.0] * len(ids))
    traj.weight_versions.extend([-1] * len(ids))
    traj.response_text += text
    return True


async def _call_tool(
    traj: Trajectory, action: Action, env: AgentEnv, tokenizer, cfg: AgentLoopConfig
) -> ToolOutput | None:
    """The tool's block for the action's input (or an error text in one); None when no block fits."""
    tool = env.tools[action.kind]
    budget = min(tool.max_tokens, _remaining(traj, cfg) - 1)
    if budget < tool.min_tokens(tokenizer):
        return None
    if action.kind == SEARCH:
        traj.searches.append(action.content)
    else:
        traj.tool_calls.append({"tool": action.kind, "input": action.content})
    start_s = time.monotonic()
    output = await tool.call(action.content, tokenizer, budget)
    if action.kind == SEARCH:
        traj.search_s += time.monotonic() - start_s
    if output.is_error and action.kind == SEARCH:
        traj.num_search_errors += 1
    elif output.is_error:
        traj.num_tool_errors += 1
    return output


def _score(traj: Trajectory, tokenizer, env: AgentEnv) -> None:
    """EM of the model's last answer, and the env's reward; the reward reads the whole response without
    special tokens (EOS), as Search-R1 decodes it."""
    traj.em = 1.0 if em_check(traj.answer, traj.golden_answers) else 0.0
    text = tokenizer.decode(traj.response_ids, skip_special_tokens=True)
    traj.reward, traj.reward_extra = env.reward(
        traj.answer, traj.golden_answers, text, traj.searches, traj.data_source
    )


def _parse_version(weight_version: str | None) -> int:
    try:
        return int(weight_version)
    except (TypeError, ValueError):
        return -1
