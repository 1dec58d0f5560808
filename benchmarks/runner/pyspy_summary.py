"""Where a process's threads spend their time, from a raw py-spy record (`py-spy record -f raw --threads`).

    python -m benchmarks.runner.pyspy_summary PROFILE.txt [--out JSON]

Each thread's share of the samples, then, for the embedded engine's loop thread (`engine-loop`), the share
of its samples in each phase of a step: the eager forward of prefill steps, the decode CUDA-graph replay,
scheduling, the post-processing of sampled tokens, waiting for work, and the rest by innermost frame. The
phases are read from the frames of tandemrl/engine (`FastModelRunner._forward_eager`, `*.replay`,
`Scheduler.schedule`, `Engine._postprocess`); a sample in none of them counts under its innermost frame.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

from benchmarks import write_json

PHASES = (  # (name, a frame substring that puts a sample in it), first match wins
    ("prefill forward, eager", "_forward_eager"),
    ("decode, CUDA graph replay", "replay"),
    ("schedule", "Scheduler.schedule"),
    ("postprocess (sampled tokens, stops, finishes)", "_postprocess"),
    ("waiting for work", "queue.py"),
)


def phase_of(frames: list[str]) -> str:
    stack = ";".join(frames)
    for name, marker in PHASES:
        if marker in stack:
            return name
    return "other: " + frames[-1][:100]


def summarize(path: Path, loop_thread: str = "engine-loop") -> dict:
    threads: collections.Counter = collections.Counter()
    phases: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")  # the first is "thread (TID): NAME" (--threads)
        name = frames[0].partition(": ")[2] or frames[0]
        threads[name] += int(count)
        if name == loop_thread and len(frames) > 1:
            phases[phase_of(frames[1:])] += int(count)
    total, loop_total = sum(threads.values()), sum(phases.values())
    if not total:
        raise SystemExit(f"{path}: no py-spy samples (expected lines 'frame;frame;... COUNT')")
    return {
        "profile": str(path),
        "samples": total,
        "thread_share": {name: n / total for name, n in threads.most_common()},
        "loop_thread": loop_thread,
        "loop_samples": loop_total,
        "loop_phase_share": {name: n / loop_total for name, n in phases.most_common(20)}
        if loop_total
        else {},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--loop-thread", default="engine-loop")
    args = parser.parse_args()
    summary = summarize(args.profile, args.loop_thread)
    print(f"{summary['samples']} samples")
    for name, share in summary["thread_share"].items():
        print(f"  thread {name}: {share:.1%}")
    print(f"{args.loop_thread} ({summary['loop_samples']} samples):")
    for name, share in summary["loop_phase_share"].items():
        print(f"  {share:6.1%}  {name}")
    if args.out:
        write_json(args.out, summary)


if __name__ == "__main__":
    main()
