"""`tandem eval CONFIG [--split test] [--limit N] [--out PATH]`: greedy Search-R1 evaluation.

Starts what the config names through the run's services layer (`runner/services.py`: the engines of
the placement plan, unless external engines are given, and the retrieval server over the index, unless
`retrieval.launch` is false), runs one greedy trajectory per question (split over the engines,
agent/evaluate.py), and reports exact match per data source and overall, with mean searches and turns.
Invariant: every question of the selected split (up to `--limit`, in file order) is evaluated
exactly once, and every trajectory is written in full to the jsonl.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from tandemrl.agent.evaluate import evaluate_prompts, finish_reasons, format_summary, split_paths, summarize
from tandemrl.agent.loop import Trajectory
from tandemrl.config.schema import ConfigError, TandemConfig

log = logging.getLogger(__name__)


def run_eval(args) -> int:
    from transformers import AutoTokenizer

    from tandemrl.config.loader import load_config
    from tandemrl.runner.services import Services, model_path

    config = load_config(args.config, args.overrides)
    from tandemrl.agent.tools import check_plugins
    from tandemrl.data.loader import load_prompts

    check_plugins(config.agentloop, config.tools, config.reward)  # before any service starts
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit {args.limit}: evaluate at least one question (--limit >= 1), or omit it.")
    out = Path(args.out or Path(config.runner.output_dir) / "eval" / f"{args.split}_trajectories.jsonl")
    check_out_path(out)  # before any service starts: the trajectories must have somewhere to go
    prompts = load_prompts(split_paths(config.data, config.retrieval, args.split), args.limit)  # file order
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

    from tandemrl.host.files import is_missing, os_error_message

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
    search = build_env(  # tools + reward
        config.agentloop, config.tools, config.reward, SearchTool.from_config(addr, search_cfg, search_key)
    )
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
