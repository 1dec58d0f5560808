"""Greedy Search-R1 evaluation of prompts against engines: one trajectory per question, summarized per
data source and overall (exact match, mean searches and turns). The run's validation (runner/step.py)
and `tandem eval` (commands/evaluate.py, which starts the services) both use it.

A prompt fits when the engine's context holds it and the whole response budget after it
(`prompt_room`): `tandem eval` sets aside the questions that do not (`split_overlong`), as verl's
`filter_overlong_prompts` does, since the engine would refuse them, at once or in a later turn.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tandemrl.agent.loop import Trajectory, gather_or_cancel, run_trajectory
from tandemrl.agent.reward import reward_extra_means
from tandemrl.config.agent import AgentLoopConfig
from tandemrl.config.errors import ConfigError

if TYPE_CHECKING:
    from tandemrl.config.schema import DataConfig, RetrievalConfig

log = logging.getLogger(__name__)

OVERALL = "overall"


async def evaluate_prompts(
    prompts: list,
    engine,
    search,
    tokenizer,
    cfg: AgentLoopConfig,
    max_concurrency: int = 64,
    prompt_ids: list[list[int]] | None = None,
) -> list[Trajectory]:
    """One greedy trajectory per prompt, at most `max_concurrency` at a time; results in prompt order.
    `prompt_ids`, when given, are the prompts' token ids already built (`split_overlong`)."""
    semaphore = asyncio.Semaphore(max_concurrency)
    ids = prompt_ids if prompt_ids is not None else [None] * len(prompts)

    async def one(prompt, ids) -> Trajectory:
        async with semaphore:
            return await run_trajectory(prompt, engine, search, tokenizer, cfg, greedy=True, prompt_ids=ids)

    return await gather_or_cancel([one(prompt, i) for prompt, i in zip(prompts, ids, strict=True)])


@dataclass(frozen=True)
class Overlong:
    """A question whose prompt does not fit the engine's context with the response budget after it."""

    prompt_id: str
    path: str  # the question file it came from
    num_tokens: int


def prompt_room(max_context_len: int, cfg: AgentLoopConfig) -> int:
    """The longest prompt (tokens) that never makes the engine refuse a turn: every turn sends the prompt
    and the response so far (below `max_response_tokens`), and the engine takes fewer tokens than its
    context."""
    return max_context_len - cfg.max_response_tokens


def split_overlong(
    prompts: list, paths: list[str], tokenizer, room: int
) -> tuple[list, list[list[int]], list[Overlong]]:
    """The prompts that fit in `room` tokens with their token ids, and the ones that do not, in file order.
    `paths` are the question files the prompts were loaded from (`load_prompts`'s argument)."""
    from tandemrl.agent.prompt import build_prompt_ids
    from tandemrl.data.loader import file_keys  # the loader's "<file key>:<record id>" prefixes

    keys = file_keys([Path(path) for path in paths])
    fitting, fitting_ids, overlong = [], [], []
    for prompt in prompts:
        ids = build_prompt_ids(tokenizer, prompt.question)
        if len(ids) <= room:
            fitting.append(prompt)
            fitting_ids.append(ids)
            continue
        path = next(
            (p for p, k in zip(paths, keys, strict=True) if prompt.prompt_id.startswith(f"{k}:")), "?"
        )
        overlong.append(Overlong(prompt.prompt_id, str(path), len(ids)))
    return fitting, fitting_ids, overlong


def summarize(trajectories: list[Trajectory]) -> dict[str, dict[str, float]]:
    """Per data source and overall: count, EM, mean searches, turns, response length, search errors."""
    by_source: dict[str, list[Trajectory]] = defaultdict(list)
    for traj in trajectories:
        by_source[traj.data_source].append(traj)
        by_source[OVERALL].append(traj)
    summary = {}
    for source in sorted(by_source, key=lambda s: (s == OVERALL, s)):
        trajs = by_source[source]
        num = len(trajs)
        summary[source] = {
            "num": num,
            "em": sum(t.em for t in trajs) / num,
            "reward": sum(t.reward for t in trajs) / num,
            "searches": sum(t.num_searches for t in trajs) / num,
            "turns": sum(t.num_turns for t in trajs) / num,
            "response_length": sum(t.response_length for t in trajs) / num,
            "answered": sum(t.answer is not None for t in trajs) / num,
            "search_errors": sum(t.num_search_errors for t in trajs),
        }
        extra = reward_extra_means(trajs)  # a reward function's other metrics
        summary[source].update({f"reward_extra/{name}": value for name, value in extra.items()})
    return summary


def finish_reasons(trajectories: list[Trajectory]) -> dict[str, dict[str, int]]:
    """Per data source, how many trajectories ended how (answer, length, max_turns, abort): where a
    kind of question fails (out of response budget, out of turns) shows here first."""
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for traj in trajectories:
        counts[traj.data_source][traj.finish_reason] += 1
    return {source: dict(reasons) for source, reasons in sorted(counts.items())}


def format_summary(summary: dict[str, dict[str, float]]) -> str:
    columns = ["num", "em", "reward", "searches", "turns", "response_length", "answered", "search_errors"]
    width = max(len(OVERALL), *(len(source) for source in summary)) + 2
    lines = ["source".ljust(width) + "".join(c.rjust(16) for c in columns)]
    for source, row in summary.items():
        cells = [f"{row[c]:.0f}" if c in ("num", "search_errors") else f"{row[c]:.3f}" for c in columns]
        lines.append(source.ljust(width) + "".join(cell.rjust(16) for cell in cells))
    return "\n".join(lines)


def split_paths(data: DataConfig, retrieval: RetrievalConfig, split: str) -> list[str]:
    """The question files of `split`: `data`'s paths for train/val, else the split file beside the
    KB's corpus (`retrieval.corpus_path`, else the default KB)."""
    configured = {"train": data.train_data_paths, "val": data.val_data_paths}.get(split)
    if configured:
        return list(configured)
    from tandemrl.host.files import is_missing
    from tandemrl.host.home import default_kb_dir

    kb_dir = Path(retrieval.corpus_path).parent if retrieval.corpus_path else default_kb_dir()
    path = kb_dir / f"{split}.jsonl"
    if not retrieval.corpus_path:
        _refuse_mixed_questions(data, split, path)
    if is_missing(path):
        raise FileNotFoundError(
            f"{path} does not exist: no {split} questions. Run `tandem prepare all` for the "
            "default knowledge base, or set retrieval.corpus_path next to your split files."
        )
    return [str(path)]


def _refuse_mixed_questions(data: DataConfig, split: str, kb_path: Path) -> None:
    """A split that falls back to the generated knowledge base while `data` names the user's own questions
    (files outside the KB's folder) is refused: the run would train on NQ and validate, or be evaluated, on
    made-up KB questions without a word."""
    own = [
        (f"data.{name}_data_paths", str(path))
        for name, paths in (("train", data.train_data_paths), ("val", data.val_data_paths))
        for path in paths or []
        if Path(path).resolve().parent != kb_path.parent.resolve()
    ]
    if not own:
        return
    key, first = own[0]
    mixed = (
        f"the {split} questions would come from the generated knowledge base ({kb_path}) while {key} "
        f"names your own ({first})"
    )
    if split == "test":
        raise ConfigError(
            f"--split test: {mixed}. Evaluate your own file with `--split val data.val_data_paths=[FILE]`, "
            "or set retrieval.corpus_path to a corpus with test.jsonl beside it."
        )
    off = (
        ", or turn validation off (runner.val_interval=0 runner.val_before_train=false)"
        if split == "val"
        else ""
    )
    raise ConfigError(f"data.{split}_data_paths is not set, so {mixed}. Set data.{split}_data_paths{off}.")


MAX_OVERLONG_WARNINGS = 10  # one warning line each; the rest are counted


def warn_overlong(
    overlong: list[Overlong],
    num_fitting: int,
    room: int,
    max_context_len: int,
    cfg: AgentLoopConfig,
    what: str = "question",
) -> None:
    """One warning per `what` set aside by `split_overlong` (the first few, then a count); ConfigError when
    none is left (`tandem eval`'s questions, a run's validation set)."""
    if not overlong:
        return
    bound = f"rollout.max_context_len={max_context_len} minus agentloop.max_response_tokens={cfg.max_response_tokens}"
    if num_fitting == 0:
        first = overlong[0]
        raise ConfigError(
            f"no {what} fits the engine's context: {first.prompt_id} in {first.path} has a prompt of "
            f"{first.num_tokens} tokens (and {len(overlong) - 1} more are too long), over the {room} that "
            f"{bound} leaves for a prompt. Raise rollout.max_context_len, or shorten the questions."
        )
    for item in overlong[:MAX_OVERLONG_WARNINGS]:
        log.warning(
            "skipping %s %s of %s: its prompt has %d tokens, over the %d that %s leaves for a prompt; "
            "raise rollout.max_context_len to evaluate it",
            what,
            item.prompt_id,
            item.path,
            item.num_tokens,
            room,
            bound,
        )
    if len(overlong) > MAX_OVERLONG_WARNINGS:
        log.warning("... and %d more %ss skipped as too long", len(overlong) - MAX_OVERLONG_WARNINGS, what)
