"""What writing a step's records costs (runner/records.py; on the runner's path, `time/records`, in a step
that saves; beside the next step in the others, `time/bookkeeping_overlapped`): a hand-off
of trajectories shaped like the H200 recipe's (64 groups x 4, prompts of 250 tokens, responses of 310, two
searches), turned into dicts by `Trajectory.to_dict` and by `dataclasses.asdict` (what `to_dict` was
before), then into JSON lines.

    python -m benchmarks.runner.step_records [--trajectories 256] [--repeats 5] \
        [--out benchmarks/results/runner/step_records_cpu.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import time

from benchmarks import write_json
from tandemrl.agent.loop import Trajectory


def make_trajectory(rng: random.Random, prompt_len: int, response_len: int) -> Trajectory:
    traj = Trajectory(prompt_ids=[rng.randrange(49_152) for _ in range(prompt_len)])
    traj.response_ids = [rng.randrange(49_152) for _ in range(response_len)]
    traj.loss_mask = [1] * response_len
    traj.rollout_logprobs = [-rng.random() for _ in range(response_len)]
    traj.weight_versions = [3] * response_len
    traj.searches = ["who directed the film", "where was that director born"]
    traj.question, traj.response_text = "q" * 80, "x" * 1200
    return traj


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start_s = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start_s)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=250)
    parser.add_argument("--response-tokens", type=int, default=310)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/runner/step_records_cpu.json")
    args = parser.parse_args()
    rng = random.Random(0)
    trajs = [make_trajectory(rng, args.prompt_tokens, args.response_tokens) for _ in range(args.trajectories)]
    to_dict_s = best_of(args.repeats, lambda: [t.to_dict() for t in trajs])
    asdict_s = best_of(args.repeats, lambda: [dataclasses.asdict(t) for t in trajs])
    rows = [t.to_dict() for t in trajs]
    dumps_s = best_of(args.repeats, lambda: [json.dumps(r) for r in rows])
    result = {
        "trajectories": args.trajectories,
        "prompt_tokens": args.prompt_tokens,
        "response_tokens": args.response_tokens,
        "cpu_count": os.cpu_count(),
        "to_dict_s": to_dict_s,
        "asdict_s": asdict_s,
        "json_dumps_s": dumps_s,
        "json_mb": sum(len(json.dumps(r)) for r in rows) / 1e6,
        "command": "python -m benchmarks.runner.step_records "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
    }
    print(
        f"{args.trajectories} trajectories: to_dict {to_dict_s * 1e3:.1f} ms, dataclasses.asdict "
        f"{asdict_s * 1e3:.1f} ms, json.dumps {dumps_s * 1e3:.1f} ms ({result['json_mb']:.1f} MB)"
    )
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
