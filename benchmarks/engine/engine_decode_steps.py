"""Decode step time of the embedded engine against the batch, and where a step goes.

    python -m benchmarks.engine.engine_decode_steps --model-dir DIR [--batches 64,256,512,1024] \
        [--out benchmarks/results/engine/engine_decode_steps_h200.json]
    python -m benchmarks.engine.engine_decode_steps --tiny      # CPU smoke check of the same code (no figures)

For each batch B: B requests of `--prompt-tokens` random prompt tokens with the agent's stop strings
(`</search>`, `</answer>`; ignore_eos, so every row decodes to the end), all prefilled, then
`--steps` decode steps through `Engine.step()` as the engine's loop runs them. Reported per B:
- `step_ms`: wall time per step (the engine's decode rate is B / step_ms);
- `gpu_ms`: the same step's graph replayed alone (no host work), so step_ms - gpu_ms is what the host adds
  when it does not hide behind the GPU;
- the host phases per step: `schedule_ms`, `launch_ms` (building the inputs, replaying the graph),
  `wait_ms` (waiting for the GPU's tokens), `postprocess_ms` (appending tokens, stop checks, bookkeeping);
- `tail_decodes_per_row`: the stop check's full tail decodes per row (engine/stops.py prefilter);
- the same step with the prefilter off (`step_ms_full_stop_check`), the code as it was before it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from benchmarks import write_json  # noqa: E402
from tandemrl.engine.engine import Engine, EngineConfig  # noqa: E402
from tandemrl.engine.sequence import SamplingParams  # noqa: E402

STOPS = ["</search>", "</answer>"]


class PhaseTimer:
    """Wraps the engine's step phases with perf_counter sums (host time: a phase that waits for the GPU
    counts its wait)."""

    def __init__(self, engine: Engine):
        self.sums = {"schedule": 0.0, "launch": 0.0, "wait": 0.0, "postprocess": 0.0}
        scheduler, runner = engine.scheduler, engine.runner
        self._wrap(scheduler, "schedule", "schedule")
        self._wrap(runner, "launch", "launch")
        original_postprocess = engine._postprocess
        timer = self

        def postprocess(launched):
            start_s = time.perf_counter()
            original_get = launched.result.get

            def get():
                wait_start_s = time.perf_counter()
                out = original_get()
                timer.sums["wait"] += time.perf_counter() - wait_start_s
                return out

            launched.result.get = get
            out = original_postprocess(launched)
            timer.sums["postprocess"] += time.perf_counter() - start_s
            return out

        engine._postprocess = postprocess

    def _wrap(self, owner, name: str, phase: str) -> None:
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            start_s = time.perf_counter()
            out = original(*args, **kwargs)
            self.sums[phase] += time.perf_counter() - start_s
            return out

        setattr(owner, name, wrapped)

    def reset(self) -> None:
        for key in self.sums:
            self.sums[key] = 0.0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fill(engine: Engine, batch: int, prompt_tokens: int, vocab: int, rng: random.Random) -> None:
    params = SamplingParams(max_new_tokens=100_000, temperature=1.0, stop=list(STOPS), ignore_eos=True)
    for i in range(batch):
        ids = [rng.randrange(100, vocab - 1) for _ in range(prompt_tokens)]
        engine.add_request(f"b{batch}-{i}", ids, params)
    while engine.scheduler.waiting or any(not s.output_ids for s in engine.scheduler.running):
        engine.step()


def time_steps(engine: Engine, timer: PhaseTimer, num_steps: int) -> dict:
    engine.step()  # one decode step of this batch first: its graph and buffers are warm
    sync(engine.device)
    timer.reset()
    decodes_before = engine.stops.num_tail_decodes
    rows_before = engine.num_decode_rows
    start_s = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    engine.drain()
    sync(engine.device)
    elapsed_s = time.perf_counter() - start_s
    rows = engine.num_decode_rows - rows_before
    return {
        "step_ms": 1000 * elapsed_s / num_steps,
        **{f"{phase}_ms": 1000 * total / num_steps for phase, total in timer.sums.items()},
        "tail_decodes_per_row": (engine.stops.num_tail_decodes - decodes_before) / max(rows, 1),
        "tokens_per_s": rows / elapsed_s,
    }


def gpu_step_ms(engine: Engine, batch: int, repeats: int = 20) -> float | None:
    """The decode graph of this batch replayed alone, nothing on the host between replays."""
    graphs = getattr(engine.runner, "graphs", None)
    if engine.device.type != "cuda" or graphs is None:
        return None
    from tandemrl.engine.cuda_graphs import graph_size

    graph = graphs.graphs[graph_size(graphs.sizes, batch)]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def measure(engine: Engine, batch: int, args, rng: random.Random) -> dict:
    timer = PhaseTimer(engine)
    fill(engine, batch, args.prompt_tokens, len(engine.tokenizer), rng)
    row = {"batch": batch, **time_steps(engine, timer, args.steps)}
    full_check = engine.stops._may_complete_stop
    engine.stops._may_complete_stop = lambda token_id, stops: True  # every row decodes its tail
    before = time_steps(engine, timer, args.steps)
    engine.stops._may_complete_stop = full_check
    row["step_ms_full_stop_check"] = before["step_ms"]
    row["postprocess_ms_full_stop_check"] = before["postprocess_ms"]
    row["gpu_ms"] = gpu_step_ms(engine, batch)
    engine.abort_all("benchmark: next batch")
    engine.take_finished()
    return row


def tiny_model_dir(path: Path) -> Path:
    """A random tiny model with SmolLM2's tokenizer at `path` (the --tiny smoke checks of this group)."""
    from benchmarks.engine.model_shapes import make_tiny_model_dir
    from tandemrl.host.home import tandem_home

    return make_tiny_model_dir(path, tandem_home() / "models" / "SmolLM2-135M-Instruct")


def print_row(row: dict) -> None:
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


def run_header(model_dir, device: str) -> dict:
    """What a result file says about its run: the command, the device, torch and the model."""
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "model_dir": str(model_dir),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--batches", default="64,256,512,1024")
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke check with a random tiny model")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.tiny:
        model_dir = tiny_model_dir(Path("/tmp/tandem_decode_steps_tiny"))
        batches, args.steps, args.prompt_tokens = [min(b, 16) for b in batches[:2]], 3, 32
        device = "cpu"
    else:
        model_dir, device = args.model_dir, "cuda"
    engine = Engine(
        EngineConfig(
            str(model_dir),
            device=device,
            dtype="auto",
            max_running_requests=max(batches),
            max_context_len=args.prompt_tokens + 2 * args.steps + 64,
            kv_cache_gb=None if device == "cuda" else 0.25,
            freeze_gc=True,
        )
    )
    rng = random.Random(0)
    rows = []
    for batch in batches:
        row = measure(engine, batch, args, rng)
        rows.append(row)
        print_row(row)
    result = {
        **run_header(model_dir, device),
        "prompt_tokens": args.prompt_tokens,
        "steps": args.steps,
        "rows": rows,
    }
    if args.out and not args.tiny:
        write_json(args.out, result, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
