"""`tandem sft CONFIG`: the supervised cold start on the actor's own machinery.

Demonstration plans (`tandemrl.data.demos`) are rendered with the *real* retriever's results, in the
agent loop's exact token format, then trained on with token-mean cross-entropy over the model turns
(loss_mask 1; prompt and information blocks 0). The result is an HF directory that RL starts from
(`actor.model.model_path` / `rollout.model.model_path`).
Invariant: SFT uses `Actor.sft_step`, so packing, FSDP, precision and export are those of RL.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
import random
from pathlib import Path

from tandemrl.trainer.batching import TrainSample

log = logging.getLogger(__name__)

RENDER_CONCURRENCY = 16


def run_sft(args) -> int:
    from tandemrl.config.loader import load_config
    from tandemrl.trainer.export import check_replaceable

    config = load_config(args.config, args.overrides)
    check_replaceable(sft_out_dir(config))  # before any work: the model replaces that directory whole
    samples = load_sft_samples(config)
    out_dir, metrics = train_sft(config, samples)
    print(
        f"sft: {len(samples)} demonstrations, final loss {metrics.get('train/sft/loss', float('nan')):.4f}; "
        f"model written to {out_dir}"
    )
    return 0


def load_sft_samples(config) -> list[TrainSample]:
    """Pre-rendered samples (`actor.sft.rendered_path`) or demos rendered now against the retriever."""
    sft = config.actor.sft
    if sft.rendered_path is not None:
        return read_rendered(sft.rendered_path)
    from tandemrl.data.demos import load_demos
    from tandemrl.host.home import default_kb_dir

    demos = load_demos(
        sft.demos_path or default_kb_dir() / "demos.jsonl",
        sft.num_demos,
        seed=config.data.seed,
        per_source=sft.num_demos_per_source,
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
        raise ValueError(
            "sft: no demonstration survived rendering (every search missed its fact). Check that "
            "the retrieval index was built from the same knowledge base as the demos, or set "
            "actor.sft.skip_on_miss=false."
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


def read_rendered(path: str | Path) -> list[TrainSample]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"actor.sft.rendered_path={str(path)!r} does not exist; write a jsonl of "
            '{"input_ids": [...], "loss_mask": [...]} or unset it to render the demos.'
        )
    from tandemrl.data.files import InputFileError, iter_json_lines

    samples = []
    for line_number, row in iter_json_lines(path, "actor.sft.rendered_path"):
        ids, mask = row.get("input_ids"), row.get("loss_mask")
        if not _is_int_list(ids) or not _is_int_list(mask) or len(ids) != len(mask) or not ids:
            raise InputFileError(
                f"actor.sft.rendered_path {str(path)!r} line {line_number}: needs `input_ids` and `loss_mask`, "
                "non-empty lists of integers of the same length."
            )
        samples.append(TrainSample(ids, mask, [0.0] * len(ids)))
    return samples


def _is_int_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def write_rendered(path: Path, samples: list[TrainSample]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for s in samples:
            f.write(json.dumps({"input_ids": s.input_ids, "loss_mask": s.loss_mask}) + "\n")


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
    from tandemrl.agent.search_tool import SearchTool
    from tandemrl.data.demos import render_demo

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


def train_sft(config, samples: list[TrainSample]) -> tuple[Path, dict[str, float]]:
    """`actor.sft.num_epochs` passes of shuffled batches of `actor.sft.batch_size`; exports the policy."""
    from tandemrl.metrics.logger import MetricsLogger
    from tandemrl.trainer.actor import Actor

    sft = config.actor.sft
    config = copy.deepcopy(config)
    config.actor.optim.lr = sft.lr
    config.actor.model.model_path = sft_init_model_path(config)  # None: the embedded SmolLM2
    num_batches = math.ceil(len(samples) / sft.batch_size)
    actor = Actor(config, total_updates=sft.num_epochs * num_batches)
    output_dir = Path(config.runner.output_dir)
    logger = (
        MetricsLogger(output_dir / "sft", max_steps=sft.num_epochs * num_batches) if actor.rank == 0 else None
    )
    rng, metrics = random.Random(config.data.seed), {}
    try:
        for epoch in range(sft.num_epochs):
            order = list(range(len(samples)))
            rng.shuffle(order)
            for b in range(num_batches):
                batch = [samples[i] for i in order[b * sft.batch_size : (b + 1) * sft.batch_size]]
                metrics = actor.sft_step(batch)
                if logger is not None:
                    logger.log(actor.num_updates, {**metrics, "train/sft/epoch": float(epoch)})
                    log.info(
                        "sft update %d/%d: loss %.4f",
                        actor.num_updates,
                        sft.num_epochs * num_batches,
                        metrics["train/sft/loss"],
                    )
    finally:
        if logger is not None:
            logger.close()
    out_dir = sft_out_dir(config)
    actor.export_hf(out_dir)
    return out_dir, metrics


def sft_out_dir(config) -> Path:
    """Where the cold-started model goes: `actor.sft.out_dir`, else the embedded recipe's `coldstart`
    directory when fine-tuning the embedded SmolLM2, else `<runner.output_dir>/sft_model`."""
    from tandemrl.host.home import default_coldstart_dir

    sft = config.actor.sft
    if sft.out_dir:
        return Path(sft.out_dir)
    if sft_init_model_path(config) is None:
        return default_coldstart_dir()
    return Path(config.runner.output_dir) / "sft_model"


def sft_init_model_path(config) -> str | None:
    """The model the cold start fine-tunes: `actor.sft.init_model_path`, else the actor's model unless
    that is the cold start's own output (`model_path: coldstart`), else None (the embedded SmolLM2)."""
    from tandemrl.host.home import default_coldstart_dir

    if config.actor.sft.init_model_path:
        return config.actor.sft.init_model_path
    actor_path = config.actor.model.model_path
    if actor_path is None or Path(actor_path) == default_coldstart_dir():
        return None
    return actor_path
