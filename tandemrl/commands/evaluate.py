"""`tandem eval CONFIG [--split test] [--limit N] [--out PATH]`: greedy Search-R1 evaluation.

Starts what the config names through the run's services layer (`runner/services.py`: the engines of
the placement plan, unless external engines are given, and the retrieval server over the index, unless
`retrieval.launch` is false), runs one greedy trajectory per question (split over the engines,
agent/evaluate.py), and reports exact match per data source and overall, with mean searches and turns.

Writes two files: the trajectories to `--out` (default `<runner.output_dir>/eval/<split>_trajectories.jsonl`)
and the summary to `<split>_summary.json` in the same folder as `--out`, both replaced when present.
Neither may be a file the evaluation reads (question files, corpus): that is refused before any service
starts, as is an `--out` that could not be written.

Invariant: every question of the selected split (up to `--limit`, in file order) is evaluated exactly
once, and every trajectory is written in full to the jsonl — except a question whose prompt does not fit
the engine's context with the response budget after it (`agent/evaluate.py:prompt_room`): it is set aside
before any service starts, as verl's `filter_overlong_prompts` does, named in a warning and listed in
the summary (`skipped_overlong`), since the engine would refuse it and end the whole evaluation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path

from tandemrl.agent.evaluate import (
    Overlong,
    evaluate_prompts,
    finish_reasons,
    format_summary,
    prompt_room,
    split_overlong,
    split_paths,
    summarize,
    warn_overlong,
)
from tandemrl.agent.loop import Trajectory
from tandemrl.config.schema import ConfigError, TandemConfig

log = logging.getLogger(__name__)


def run_eval(args) -> int:
    from transformers import AutoTokenizer

    from tandemrl.agent.tools import check_plugins
    from tandemrl.config.loader import load_config
    from tandemrl.data.loader import load_prompts
    from tandemrl.runner.services import Services, model_path

    config = load_config(args.config, args.overrides)
    check_plugins(config.agentloop, config.tools, config.reward)  # before any service starts
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit {args.limit}: evaluate at least one question (--limit >= 1), or omit it.")
    out = Path(args.out or default_out(config, args.split))
    summary_path = summary_path_of(out, args.split)
    paths = split_paths(config.data, config.retrieval, args.split)
    # before any service starts: the results must have somewhere to go, and not over what the run reads
    check_out_path(out)
    check_out_path(summary_path, what=f"the summary path {str(summary_path)!r} (beside --out)")
    check_inputs_kept(out, summary_path, args.split, read_files(config, args.split, paths))
    prompts = load_prompts(paths, args.limit)  # file order
    tokenizer = AutoTokenizer.from_pretrained(model_path(config))
    room = prompt_room(config.rollout.max_context_len, config.agentloop)
    prompts, prompt_ids, overlong = split_overlong(prompts, paths, tokenizer, room)
    warn_overlong(overlong, len(prompts), room, config.rollout.max_context_len, config.agentloop)
    start_s = time.monotonic()
    with Services(config) as services:
        urls, addr = services.engine_urls, services.search_addr
        log.info(
            "evaluating %d %s questions (engines %s, retrieval %s)", len(prompts), args.split, urls, addr
        )
        keys = (services.engine_api_key, services.search_api_key)
        trajectories = asyncio.run(_evaluate(config, prompts, prompt_ids, urls, addr, tokenizer, keys))
    elapsed_s = time.monotonic() - start_s
    write_results(out, summary_path, trajectories, overlong, room)
    print(format_summary(summarize(trajectories)))
    skipped = (
        f"; {len(overlong)} skipped (prompt over {room} tokens, listed in the summary)" if overlong else ""
    )
    print(
        f"{len(trajectories)} questions in {elapsed_s:.1f} s{skipped}; trajectories written to {out}, "
        f"summary to {summary_path}"
    )
    return 0


def default_out(config: TandemConfig, split: str) -> Path:
    return Path(config.runner.output_dir) / "eval" / f"{split}_trajectories.jsonl"


def summary_path_of(out: Path, split: str) -> Path:
    """Where the summary goes: `<split>_summary.json` in `--out`'s folder (scripts read it there)."""
    return out.with_name(f"{split}_summary.json")


def write_results(
    out: Path, summary_path: Path, trajectories: list[Trajectory], overlong: list[Overlong], room: int
) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as stream:
        for traj in trajectories:
            stream.write(json.dumps(traj.to_dict()) + "\n")
    record = {"summary": summarize(trajectories), "finish_reasons": finish_reasons(trajectories)}
    if overlong:
        questions = [{"id": o.prompt_id, "file": o.path, "prompt_tokens": o.num_tokens} for o in overlong]
        record["skipped_overlong"] = {"max_prompt_tokens": room, "questions": questions}
    summary_path.write_text(json.dumps(record, indent=2) + "\n")


def read_files(config: TandemConfig, split: str, paths: list[str]) -> list[tuple[str, str]]:
    """Each file the evaluation reads questions or passages from (or that the config names as such), with
    the key that names it."""
    data = config.data
    if split in ("train", "val") and {"train": data.train_data_paths, "val": data.val_data_paths}[split]:
        split_key = f"in data.{split}_data_paths"
    elif config.retrieval.corpus_path:
        split_key = f"the {split} split beside retrieval.corpus_path"
    else:
        split_key = f"the default knowledge base's {split} split"
    files = [(split_key, str(path)) for path in paths]
    files += [("in data.train_data_paths", str(path)) for path in data.train_data_paths or []]
    files += [("in data.val_data_paths", str(path)) for path in data.val_data_paths or []]
    if config.retrieval.corpus_path:
        files.append(("retrieval.corpus_path", str(config.retrieval.corpus_path)))
    return files


def check_inputs_kept(out: Path, summary_path: Path, split: str, inputs: list[tuple[str, str]]) -> None:
    """Refuse results that would be written over a file the run reads, or over each other."""
    if _is_same_file(out, summary_path):
        raise ConfigError(
            f"--out {str(out)!r} is where the {split} summary goes ({split}_summary.json beside --out), so "
            f"the summary would replace the trajectories. Name the file otherwise, e.g. {split}_trajectories.jsonl."
        )
    for key, path in inputs:
        if _is_same_file(out, Path(path)):
            raise ConfigError(
                f"--out {str(out)!r} is the input file {path!r} ({key}): the trajectories would replace it. "
                "Pass an --out outside the config's inputs, or omit --out for the run's eval folder."
            )
        if _is_same_file(summary_path, Path(path)):
            raise ConfigError(
                f"--out {str(out)!r} puts the summary at {str(summary_path)!r} ({split}_summary.json beside "
                f"--out), which is the input file {path!r} ({key}). Pass an --out in another folder."
            )


def _is_same_file(a: Path, b: Path) -> bool:
    """One file under two names: the same path once links are resolved, or a hard link."""
    try:
        if os.path.realpath(a) == os.path.realpath(b):
            return True
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except (OSError, ValueError):  # a name the system refuses: load_prompts or the write reports it
        return False


def check_out_path(out: Path, what: str | None = None) -> None:
    """Refuse an `--out` (or the summary beside it, `what`) that could not be written once the evaluation
    has run (its work would be lost)."""
    import stat

    from tandemrl.host.files import is_missing, os_error_message

    name = what or f"--out {str(out)!r}"
    fix = "pass an --out in another folder" if what else "pass --out as the path of a .jsonl file to write"
    for path in (out, *out.parents):
        if is_missing(path):
            continue
        try:
            info = os.stat(path)
        except (OSError, ValueError) as error:
            where = name + ("" if path == out else f": {str(path)!r}")
            raise ConfigError(os_error_message(where, error)) from None
        if path == out and stat.S_ISDIR(info.st_mode):
            raise ConfigError(f"{name} is a directory; {fix}.")
        if path == out and not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{name} is not a regular file (a pipe or device); {fix}.")
        if path != out and not stat.S_ISDIR(info.st_mode):
            raise ConfigError(f"{name}: {str(path)!r} is a file, so the folder cannot be made.")
        return


async def _evaluate(
    config: TandemConfig,
    prompts: list,
    prompt_ids: list[list[int]],
    urls: list[str],
    addr: str,
    tokenizer,
    keys: tuple[str | None, str | None] = (None, None),
) -> list[Trajectory]:
    """The prompts (with their token ids) split over the engines (in order, so the results keep the file
    order); `keys` are the engines' and the retrieval server's API keys."""
    from tandemrl.agent.search_tool import SearchTool
    from tandemrl.agent.tools import build_env
    from tandemrl.rollout.backends import make_client

    search_cfg = config.tools.search
    engine_key, search_key = keys
    engines = [
        make_client(
            config.rollout.backend, url, api_key=engine_key, max_context_len=config.rollout.max_context_len
        )
        for url in urls
    ]
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
                    prompt_ids=prompt_ids[i * size : (i + 1) * size],
                )
                for i, engine in enumerate(engines)
            )
        )
        return [traj for shard in shards for traj in shard]
    finally:
        for engine in engines:
            await engine.close()
        await search.close()
