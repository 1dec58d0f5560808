"""`tandem sft CONFIG`: render the demonstrations, then the supervised cold start (trainer/sft.py).

Demonstration plans (data/demos.py) are rendered (agent/demos.py) with the *real* retriever's results, in the agent loop's
exact token format (the retrieval server only is started, runner/services.py), kept where every search
found its fact, written to `<output_dir>/sft/rendered.jsonl`, and trained on by `train_sft`.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from tandemrl.config.errors import ConfigError
from tandemrl.host.files import creatable_problem
from tandemrl.trainer.batching import TrainSample
from tandemrl.trainer.sft import (
    read_rendered,
    sample_limits,
    sample_problem,
    sft_init_model_path,
    sft_out_dir,
    train_sft,
    write_rendered,
)

log = logging.getLogger(__name__)

RENDER_CONCURRENCY = 16


def run_sft(args) -> int:
    from tandemrl.config.loader import load_config
    from tandemrl.trainer.export import check_replaceable

    config = load_config(args.config, args.overrides)
    # before any work: the model replaces that directory whole, and training must not be lost to a path
    # that cannot be written
    out_dir = check_replaceable(sft_out_dir(config))
    check_creatable(out_dir.parent, "actor.sft.out_dir", out_dir)
    check_creatable(Path(config.runner.output_dir) / "sft", "runner.output_dir", config.runner.output_dir)
    samples = load_sft_samples(config)
    out_dir, metrics = train_sft(config, samples)
    print(
        f"sft: {len(samples)} demonstrations, final loss {metrics.get('train/sft/loss', float('nan')):.4f}; "
        f"model written to {out_dir}"
    )
    return 0


def check_creatable(path: Path, key: str, value: str | Path) -> None:
    """Refuse (a `ConfigError` naming `key`) a directory `path` that cannot be created or written into."""
    problem = creatable_problem(path)
    if problem:
        raise ConfigError(
            f"{key}={str(value)!r} cannot be created: {problem}. Choose a path under a directory you can "
            "write to."
        )


def load_sft_samples(config) -> list[TrainSample]:
    """Pre-rendered samples (`actor.sft.rendered_path`) or demos rendered now against the retriever; each
    checked against the model's vocabulary and context before any training (or retrieval) starts."""
    sft = config.actor.sft
    limits = sample_limits(config)
    if sft.rendered_path is not None:
        return read_rendered(sft.rendered_path, limits)
    from tandemrl.data.demos import load_demos
    from tandemrl.host.home import default_kb_dir

    demos_path = sft.demos_path or default_kb_dir() / "demos.jsonl"
    demos = load_demos(demos_path, sft.num_demos, seed=config.data.seed, per_source=sft.num_demos_per_source)
    if not demos:  # the file holds some (load_demos refuses an empty one): the selection picked none
        raise ConfigError(
            f"actor.sft.num_demos_per_source={sft.num_demos_per_source!r} selects no demonstration of "
            f"{str(demos_path)!r}; give at least one data_source a count above 0."
        )
    rendered = render_demos(config, demos)
    kept = [TrainSample(ids, mask, [0.0] * len(ids)) for ids, mask in rendered if ids]
    log.info(
        "sft: rendered %d demonstrations, kept %d (dropped %d whose searches missed their fact); kept per "
        "data_source: %s",
        len(demos),
        len(kept),
        len(demos) - len(kept),
        kept_per_source(demos, rendered),
    )
    if not kept:
        raise ConfigError(
            f"actor.sft.skip_on_miss=true: none of the {len(demos)} demonstrations of {str(demos_path)!r} "
            "survived rendering (every one had a search that missed its fact). Check that the retrieval "
            "index was built from the same knowledge base as the demos, or set actor.sft.skip_on_miss=false."
        )
    for demo, (ids, mask) in zip(demos, rendered, strict=True):
        problem = sample_problem(ids, mask, limits) if ids else None
        if problem is not None:
            raise ConfigError(
                f"actor.sft.demos_path {str(demos_path)!r}: demonstration {demo.get('id')!r} renders to a "
                f"sample the model cannot train on: {problem}."
            )
    write_rendered(Path(config.runner.output_dir) / "sft" / "rendered.jsonl", kept)
    return kept


def kept_per_source(demos: list[dict], rendered: list[tuple[list[int], list[int]]]) -> str:
    """`source kept/rendered` per data_source: a 2-hop demo needs both searches to hit, so the mix the
    cold start trains on can differ from the mix it was asked for."""
    counts: dict[str, list[int]] = {}
    for demo, (ids, _) in zip(demos, rendered, strict=True):
        kept_total = counts.setdefault(demo.get("data_source", "?"), [0, 0])
        kept_total[0] += bool(ids)
        kept_total[1] += 1
    return ", ".join(f"{source} {kept}/{total}" for source, (kept, total) in sorted(counts.items()))


def render_demos(config, demos: list[dict]) -> list[tuple[list[int], list[int]]]:
    from transformers import AutoTokenizer

    from tandemrl.host.home import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(sft_init_model_path(config) or default_model_dir())
    from tandemrl.runner.services import Services

    # the retrieval server only (launched for the rendering when retrieval.launch, else the configured one)
    with Services(config, with_engines=False) as services:
        return asyncio.run(
            _render_all(config, services.search_addr, demos, tokenizer, services.search_api_key)
        )


async def _render_all(
    config, addr: str, demos: list[dict], tokenizer, api_key: str | None = None
) -> list[tuple[list[int], list[int]]]:
    from tandemrl.agent.demos import render_demo
    from tandemrl.agent.search_tool import SearchTool

    tool = config.tools.search
    search = SearchTool.from_config(addr, tool, api_key)
    limit = asyncio.Semaphore(RENDER_CONCURRENCY)

    async def one(demo: dict):
        async with limit:
            return await render_demo(
                demo,
                search,
                tokenizer,
                tool.topk,
                config.agentloop.max_info_tokens,
                skip_on_miss=config.actor.sft.skip_on_miss,
            )

    try:
        return list(await asyncio.gather(*(one(demo) for demo in demos)))
    finally:
        await search.close()
