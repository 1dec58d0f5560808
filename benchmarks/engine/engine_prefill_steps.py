"""Prefill step time of the embedded engine, eager against CUDA-graph prefill (engine/prefill_graphs.py).

    python -m benchmarks.engine.engine_prefill_steps --model-dir DIR \
        [--out benchmarks/results/engine/engine_prefill_steps_h200.json]
    python -m benchmarks.engine.engine_prefill_steps --tiny     # CPU smoke check of the same code (no figures)

For each step shape (sequences x new tokens each, random prompts, no prefix reuse) and each setting of
`rollout.engine.prefill_cuda_graphs`: `--repeats` prefill steps through `Engine.step()`, each of fresh
requests that stop after their first token, so the step is the prefill alone. Reported per shape, medians:
- `step_ms`: from the step's launch to its sampled tokens on the host;
- `launch_ms`: the host's part of it (building the inputs and enqueueing the kernels or the graph);
- `graph_over_eager`: step_ms with graphs over step_ms without, side by side in one process.
Both engines load the same weights; the graph engine is built after the eager one is freed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from benchmarks import write_json  # noqa: E402
from benchmarks.engine.engine_decode_steps import print_row, run_header, tiny_model_dir  # noqa: E402
from tandemrl.engine.engine import Engine, EngineConfig  # noqa: E402
from tandemrl.engine.sequence import SamplingParams  # noqa: E402

# (sequences, new tokens each): the H200 recipe's prefill steps carry about 1,800-2,200 tokens of a few
# dozen turns (docs/DESIGN.md, Sharing a GPU); the others bracket it
SHAPES = ((4, 128), (16, 128), (8, 256), (32, 64), (64, 32), (16, 512))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_shape(engine: Engine, num_seqs: int, num_tokens: int, repeats: int, rng: random.Random) -> dict:
    vocab = len(engine.tokenizer)
    params = SamplingParams(max_new_tokens=1, temperature=1.0, ignore_eos=True)
    runner, launch_s = engine.runner, []
    original = runner.launch

    def timed_launch(seqs):
        start_s = time.perf_counter()
        out = original(seqs)
        launch_s.append(time.perf_counter() - start_s)
        return out

    runner.launch = timed_launch
    steps_s = []
    try:
        for repeat in range(repeats + 1):  # the first one warms this shape's buffers up: not counted
            for i in range(num_seqs):
                ids = [rng.randrange(100, vocab - 1) for _ in range(num_tokens)]
                engine.add_request(f"{num_seqs}x{num_tokens}-{repeat}-{i}", ids, params)
            sync(engine.device)
            start_s = time.perf_counter()
            finished = engine.step()
            engine.drain()
            sync(engine.device)
            if repeat:
                steps_s.append(time.perf_counter() - start_s)
            finished += engine.take_finished()
            assert len(finished) == num_seqs and not engine.has_work(), "not one prefill step"
    finally:
        runner.launch = original
    return {
        "num_seqs": num_seqs,
        "tokens": num_seqs * num_tokens,
        "step_ms": 1000 * statistics.median(steps_s),
        "launch_ms": 1000 * statistics.median(launch_s[1:]),
    }


def run(model_dir: str, device: str, graphs: bool, shapes, repeats: int) -> tuple[list[dict], int]:
    engine = Engine(
        EngineConfig(
            model_dir,
            device=device,
            dtype="auto",
            max_running_requests=256,
            max_context_len=2048,
            kv_cache_gb=None if device == "cuda" else 0.25,
            enable_prefix_caching=False,
            prefill_cuda_graphs=graphs,
            freeze_gc=True,
        )
    )
    rng = random.Random(0)
    rows = [{"prefill_cuda_graphs": graphs, **time_shape(engine, s, t, repeats, rng)} for s, t in shapes]
    replays = engine.stats()["num_prefill_graph_steps"]
    del engine
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows, replays


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke check with a random tiny model")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    shapes = SHAPES
    if args.tiny:
        model_dir = tiny_model_dir(Path("/tmp/tandem_prefill_steps_tiny"))
        shapes, args.repeats, device = shapes[:2], 2, "cpu"
    else:
        model_dir, device = args.model_dir, "cuda"
    eager, _ = run(str(model_dir), device, False, shapes, args.repeats)
    graphed, replays = run(str(model_dir), device, True, shapes, args.repeats)
    rows = []
    for e, g in zip(eager, graphed, strict=True):
        row = {
            "num_seqs": e["num_seqs"],
            "tokens": e["tokens"],
            "eager_step_ms": e["step_ms"],
            "eager_launch_ms": e["launch_ms"],
            "graph_step_ms": g["step_ms"],
            "graph_launch_ms": g["launch_ms"],
            "graph_over_eager": g["step_ms"] / e["step_ms"],
        }
        rows.append(row)
        print_row(row)
    result = {
        **run_header(model_dir, device),
        "repeats": args.repeats,
        "prefill_graph_steps": replays,  # of the graph engine's prefill steps, warm-ups included
        "rows": rows,
    }
    print(json.dumps({"prefill_graph_steps": replays}))
    if args.out:
        write_json(args.out, result, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
