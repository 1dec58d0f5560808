"""Time to the first step of `tandem train`, phase by phase (the start-up timeline, docs/DESIGN.md, Start-up).

    python -m benchmarks.runner.time_to_first_step [--config C] [--runs N] [--tag TAG] [key=value ...]

Runs `tandem train CONFIG runner.max_steps=3 runner.val_interval=0 runner.val_before_train=false
[key=value ...]` (defaults: the H200 async config) N times, each in its own process, one after the other:
the first start of a fresh machine pays the kernel tuning, later ones read it from
`$TANDEM_HOME/cache/kernel_tuning`. For each run it prints the timeline `tandem train` wrote to
`<runner.output_dir>/startup.json` (seconds since the `tandem train` process started) and the gaps
that make up the time to step 1, and writes all of it to benchmarks/results/runner/time_to_first_step_<TAG>.json.

On CPU (try it without a GPU), tiny steps:

    python -m benchmarks.runner.time_to_first_step --config examples/searchr1/config/embedded_cpu_async.yaml \\
        --tag cpu runner.max_steps=1 data.rollout_batch_size=1 algorithm.group_size=2 \\
        agentloop.max_turns=1 agentloop.max_new_tokens_per_turn=16 agentloop.max_response_tokens=32

A run whose code writes no startup.json (an older commit) still reports its printed time to first step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import write_json

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "examples" / "searchr1" / "config"
DEFAULT_OVERRIDES = ["runner.max_steps=3", "runner.val_interval=0", "runner.val_before_train=false"]
FIRST_STEP_LINE = re.compile(r"time to first step:? ([0-9.]+) s")
# (label, process, phase): the points the summary reads off the timeline, when present
MILESTONES = [
    ("ray initialized", "driver", "ray initialized"),
    ("actor ready", "driver", "actor ready"),
    ("engine healthy", "rollout engine 0", "first /health answered"),
    ("retrieval healthy", "retrieval server", "first /health answered"),
    ("all services ready", "driver", "all services ready"),
    ("runner starting", "driver", "runner starting"),
    ("first rollout request", "driver", "first rollout request sent"),
    ("first group done", "driver", "first group done"),
    ("step 1 generation done", "driver", "step 1 generation done (hand-off taken)"),
    ("step 1 train done", "driver", "step 1 train done"),
    ("step 1 done", "driver", "step 1 done"),
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(CONFIG_DIR / "smollm2_h200_async.yaml"))
    parser.add_argument(
        "--runs", type=int, default=1, help="starts on the machine's own caches, one after the other"
    )
    parser.add_argument(
        "--sequence",
        default=None,
        help="instead of --runs, e.g. cold,shipped,warm: cold = empty kernel-tuning and Triton caches and no "
        "shipped kernel choices (a fresh machine without them); shipped = empty caches with the choices the "
        "cold run made, shipped (a fresh machine with them); warm = the cold run's caches (a second start)",
    )
    parser.add_argument(
        "--tag", default=None, help="results file suffix (default: h200 or cpu, from the config)"
    )
    parser.add_argument("--runs-dir", default="/tmp/time_to_first_step", help="each run's runner.output_dir")
    parser.add_argument("--keep", action="store_true", help="keep the runs' checkpoints (deleted by default)")
    parser.add_argument(
        "--out", default=None, help="default: benchmarks/results/runner/time_to_first_step_<tag>.json"
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides, after the defaults")
    return parser.parse_args()


def cache_env(kind: str, output_dir: Path, runs_dir: Path, cold_dir: Path | None) -> dict[str, str]:
    """The environment a `--sequence` start runs in (see parse_args); {} for the machine's own caches."""
    from tandemrl.engine import tuning_cache

    if kind == "warm":
        if cold_dir is None:
            return {}
        return {
            tuning_cache.CACHE_DIR_ENV: str(cold_dir / "tuning"),
            "TRITON_CACHE_DIR": str(cold_dir / "triton"),
        }
    env = {
        tuning_cache.CACHE_DIR_ENV: str(output_dir / "tuning"),
        "TRITON_CACHE_DIR": str(output_dir / "triton"),
    }
    if kind == "cold":
        env[tuning_cache.SHIPPED_DIR_ENV] = str(output_dir / "nothing-shipped")
    elif cold_dir is not None:  # shipped: what the cold run chose, else the package's own choices
        shipped = runs_dir / "shipped"
        shutil.rmtree(shipped, ignore_errors=True)
        tuning_cache.ship(cold_dir / "tuning", shipped)
        env[tuning_cache.SHIPPED_DIR_ENV] = str(shipped)
    return env


def run_once(config: str, output_dir: Path, overrides: list[str], env: dict[str, str] | None = None) -> dict:
    """One `tandem train` process; returns its wall time, printed time to first step and timeline."""
    shutil.rmtree(output_dir, ignore_errors=True)
    command = [sys.executable, "-m", "tandemrl.cli", "train", config, *DEFAULT_OVERRIDES, *overrides]
    command.append(f"runner.output_dir={output_dir}")
    print("$", " ".join(f"{k}={v}" for k, v in (env or {}).items()), " ".join(command), flush=True)
    start_s = time.monotonic()
    proc = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    wall_s = time.monotonic() - start_s
    output = proc.stdout + proc.stderr
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "train.log").write_text(output)
    if proc.returncode != 0:
        raise SystemExit(f"tandem train exited with {proc.returncode}; end of its output:\n{output[-4000:]}")
    printed = FIRST_STEP_LINE.findall(output)
    report_path = output_dir / "startup.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {"phases": []}
    return {
        "wall_s": round(wall_s, 2),
        "time_to_first_step_s": float(printed[0]) if printed else None,
        "origin": report.get("origin"),
        "phases": report["phases"],
        "milestones": milestones(report["phases"]),
        "log": str(output_dir / "train.log"),
    }


def milestones(phases: list[dict]) -> dict[str, float]:
    at = {(row["process"], row["phase"]): row["s"] for row in phases}
    return {label: at[(process, phase)] for label, process, phase in MILESTONES if (process, phase) in at}


def print_run(index: int, run: dict) -> None:
    print(
        f"\nrun {index} ({run['start']}): time to first step {run['time_to_first_step_s']} s (wall {run['wall_s']} s)"
    )
    width = max((len(row["process"]) for row in run["phases"]), default=0)
    for row in run["phases"]:
        print(f"{row['s']:8.2f} s  {row['process']:<{width}}  {row['phase']}")
    points = list(run["milestones"].items())
    if points:
        print("milestones (s since process start; + gap from the previous):")
        previous = 0.0
        for label, seconds in points:
            print(f"  {label:<24} {seconds:8.2f}  +{seconds - previous:.2f}")
            previous = seconds


def main() -> int:
    args = parse_args()
    tag = args.tag or ("h200" if "h200" in Path(args.config).name else "cpu")
    runs, cold_dir = [], None
    kinds = args.sequence.split(",") if args.sequence else ["own caches"] * args.runs
    for index, kind in enumerate(kinds, start=1):
        if kind not in ("cold", "shipped", "warm", "own caches"):
            raise SystemExit(f"--sequence: {kind!r} is not one of cold, shipped, warm")
        output_dir = Path(args.runs_dir) / f"run{index}"
        env = cache_env(kind, output_dir, Path(args.runs_dir), cold_dir) if args.sequence else {}
        shutil.rmtree(output_dir, ignore_errors=True)
        runs.append({"start": kind, **run_once(args.config, output_dir, args.overrides, env)})
        cold_dir = output_dir if kind == "cold" else cold_dir
        if not args.keep:
            shutil.rmtree(output_dir / "checkpoints", ignore_errors=True)
        print_run(index, runs[-1])
    result = {
        "command": " ".join(sys.argv),
        "config": args.config,
        "overrides": DEFAULT_OVERRIDES + args.overrides,
        "runs": runs,
    }
    try:
        import torch

        result["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        result["device"] = "unknown"
    print()
    write_json(
        args.out or ROOT / "benchmarks" / "results" / "runner" / f"time_to_first_step_{tag}.json",
        result,
        indent=1,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
