"""`tandem eval CONFIG [--split test] [--limit N] [--out PATH]`: greedy Search-R1 evaluation.

Starts what the config names through the run's services layer (`runner/services.py`: the engines of
the placement plan, unless external engines are given, and the retrieval server over the index, unless
`retrieval.launch` is false), runs one greedy trajectory per question (split over the engines), and reports exact match per data source and overall, with mean searches and turns.
Invariant: every question of the selected split (up to `--limit`, in file order) is evaluated
exactly once, and every trajectory is written in full to the jsonl.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import defaultdict
from pathlib import Path

from tandemrl.agent.loop import Trajectory, gather_or_cancel, run_trajectory
from tandemrl.agent.reward import reward_extra_means
from tandemrl.config.agent import AgentLoopConfig
from tandemrl.config.errors import ConfigError
from tandemrl.config.schema import TandemConfig

log = logging.getLogger(__name__)

OVERALL = "overall"


async def evaluate_prompts(
    prompts: list, engine, search, tokenizer, cfg: AgentLoopConfig, max_concurrency: int = 64
) -> list[Trajectory]:
    """One greedy trajectory per prompt, at most `max_concurrency` at a time; results in prompt order."""
    semaphore = asyncio.Semaphore(max_concurrency)

    async def one(prompt) -> Trajectory:
        async with semaphore:
            return await run_trajectory(prompt, engine, search, tokenizer, cfg, greedy=True)

    return await gather_or_cancel([one(prompt) for prompt in prompts])


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


def split_paths(config: TandemConfig, split: str) -> list[str]:
    """The question files of `split`: the config's data paths for train/val, else the KB's split file."""
    configured = {"train": config.data.train_data_paths, "val": config.data.val_data_paths}.get(split)
    if configured:
        return list(configured)
    from tandemrl.data.files import is_missing
    from tandemrl.host.home import default_kb_dir

    kb_dir = Path(config.retrieval.corpus_path).parent if config.retrieval.corpus_path else default_kb_dir()
    path = kb_dir / f"{split}.jsonl"
    if is_missing(path):
        raise FileNotFoundError(
            f"{path} does not exist: no {split} questions. Run `tandem prepare all` for the "
            "default knowledge base, or set retrieval.corpus_path next to your split files."
        )
    return [str(path)]


def run_eval(args) -> int:
    from transformers import AutoTokenizer

    from tandemrl.config.loader import load_config
    from tandemrl.runner.services import Services, model_path

    config = load_config(args.config, args.overrides)
    from tandemrl.agent.tools import check_plugins
    from tandemrl.data.loader import load_prompts

    check_plugins(config)  # the reward and the tools, before any service starts
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit {args.limit}: evaluate at least one question (--limit >= 1), or omit it.")
    out = Path(args.out or Path(config.runner.output_dir) / "eval" / f"{args.split}_trajectories.jsonl")
    check_out_path(out)  # before any service starts: the trajectories must have somewhere to go
    prompts = load_prompts(split_paths(config, args.split), args.limit)  # file order, no shuffling
    start_s = time.monotonic()
    with Services(config) as services:
        urls, addr = services.engine_urls, services.search_addr
        tokenizer = AutoTokenizer.from_pretrained(model_path(config))
        log.info(
            "evaluating %d %s questions (engines %s, retrieval %s)", len(prompts), args.split, urls, addr
        )
        keys = (services.engine_api_key, services.search_api_key)
        trajectories = asyncio.run(_evaluate(config, prompts, urls, addr, tokenizer, keys))
    elapsed_s = time.monotonic() - start_s
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as stream:
        for traj in trajectories:
            stream.write(json.dumps(traj.to_dict()) + "\n")
    summary = summarize(trajectories)
    summary_path = out.with_name(f"{args.split}_summary.json")
    summary_path.write_text(
        json.dumps({"summary": summary, "finish_reasons": finish_reasons(trajectories)}, indent=2) + "\n"
    )
    print(format_summary(summary))
    print(
        f"{len(trajectories)} questions in {elapsed_s:.1f} s; trajectories written to {out}, "
        f"summary to {summary_path}"
    )
    return 0


def check_out_path(out: Path) -> None:
    """Refuse an `--out` that could not be written once the evaluation has run (its work would be lost)."""
    import os
    import stat

    from tandemrl.data.files import is_missing, os_error_message

    for path in (out, *out.parents):
        if is_missing(path):
            continue
        try:
            info = os.stat(path)
        except (OSError, ValueError) as error:
            where = f"--out {str(out)!r}" + ("" if path == out else f": {str(path)!r}")
            raise ConfigError(os_error_message(where, error)) from None
        if path == out and stat.S_ISDIR(info.st_mode):
            raise ConfigError(f"--out {str(out)!r} is a directory; pass the path of a .jsonl file to write.")
        if path == out and not stat.S_ISREG(info.st_mode):
            raise ConfigError(
                f"--out {str(out)!r} is not a regular file (a pipe or device); pass a .jsonl path."
            )
        if path != out and not stat.S_ISDIR(info.st_mode):
            raise ConfigError(f"--out {str(out)!r}: {str(path)!r} is a file, so the folder cannot be made.")
        return


async def _evaluate(
    config: TandemConfig,
    prompts: list,
    urls: list[str],
    addr: str,
    tokenizer,
    keys: tuple[str | None, str | None] = (None, None),
) -> list[Trajectory]:
    """The prompts split over the engines (in order, so the results keep the file order); `keys` are the
    engines' and the retrieval server's API keys."""
    from tandemrl.agent.search_tool import SearchTool
    from tandemrl.agent.tools import build_env
    from tandemrl.rollout.backends import make_client

    search_cfg = config.tools.search
    engine_key, search_key = keys
    engines = [make_client(config.rollout.backend, url, api_key=engine_key) for url in urls]
    search = build_env(config, SearchTool.from_config(addr, search_cfg, search_key))  # tools + reward
    size = -(-len(prompts) // len(engines))
    try:
        shards = await asyncio.gather(
            *(
                evaluate_prompts(
                    prompts[i * size : (i + 1) * size],
                    engine,
                    search,
                    tokenizer,
                    config.agentloop,
                    max_concurrency=config.rollout.max_running_requests,
                )
                for i, engine in enumerate(engines)
            )
        )
        return [traj for shard in shards for traj in shard]
    finally:
        for engine in engines:
            await engine.close()
        await search.close()
