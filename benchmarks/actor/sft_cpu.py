"""CPU cost of the cold start: CPU-seconds per 1,000 tokens of one SFT update of SmolLM2 on the CPU.

    python -m benchmarks.actor.sft_cpu --rendered runs/<run>/sft/rendered.jsonl [--updates 3]

`--rendered` is what `tandem sft` / `tandem demo` write under `<output_dir>/sft/`: real demonstrations
in the agent loop's token format. Each update is `Actor.sft_step` on `actor.sft.batch_size` of them,
with the demo config's settings (examples/searchr1/config/embedded_cpu_async.yaml). torch runs on one
thread, so the process CPU time of an update is its work even on a busy machine (several threads
that wait for each other at barriers burn CPU without progress there); on an idle 2-core box the
update takes about half of it. The first update also allocates the optimizer state. Writes
benchmarks/results/actor/sft_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from benchmarks import write_json  # noqa: E402
from tandemrl.commands.demo import demo_config_path  # noqa: E402
from tandemrl.config.derive import actor_setup  # noqa: E402
from tandemrl.config.loader import load_config  # noqa: E402
from tandemrl.trainer.actor import Actor  # noqa: E402
from tandemrl.trainer.sft import read_rendered  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results" / "actor"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rendered", required=True, help="jsonl of rendered demonstrations (sft/rendered.jsonl)"
    )
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "sft_cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = load_config(demo_config_path(), ["runner.output_dir=/tmp/tandem-sft-cpu"])
    config.actor.optim.lr = config.actor.sft.lr
    batch_size = config.actor.sft.batch_size
    samples = read_rendered(args.rendered)
    if len(samples) < batch_size * args.updates:
        raise SystemExit(f"{args.rendered} holds {len(samples)} samples; need {batch_size * args.updates}.")
    actor = Actor(actor_setup(config, total_updates=args.updates))
    rows = []
    for i in range(args.updates):
        batch = samples[i * batch_size : (i + 1) * batch_size]
        cpu0, wall0 = time.process_time(), time.monotonic()
        metrics = actor.sft_step(batch)
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        tokens = sum(len(s.input_ids) for s in batch)
        rows.append(
            {
                "update": i,
                "tokens": tokens,
                "cpu_s": round(cpu, 2),
                "wall_s_this_machine": round(wall, 1),
                "cpu_s_per_1k_tokens": round(1000 * cpu / tokens, 2),
                "loss": round(metrics["train/sft/loss"], 4),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    steady = rows[1:] or rows
    per_1k = sum(r["cpu_s"] for r in steady) * 1000 / sum(r["tokens"] for r in steady)
    mean_len = sum(len(s.input_ids) for s in samples) / len(samples)
    result = {
        "updates": rows,
        "cpu_s_per_1k_tokens": round(per_1k, 2),
        "mean_tokens_per_demo": round(mean_len, 1),
        "batch_size": batch_size,
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
    }
    write_json(args.out, result, indent=1)
    print(
        f"{per_1k:.1f} CPU-s per 1k tokens after the first update; {mean_len:.0f} tokens per demo; {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
