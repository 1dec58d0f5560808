"""The largest model one GPU can train: one GRPO `Actor.train_step` per Qwen2.5 size (1.5B, 3B, 7B, random
weights) on 256 trajectories of 512 tokens, with activation checkpointing and bf16 compute, alone and
beside an engine's memory, with and without `actor.cpu_offload` (FSDP2's CPUOffloadPolicy), with fp32 or bf16
weights (`--param-dtype`: `actor.param_dtype`) and AdamW moments (`--state-dtype`: `actor.optim.state_dtype`).

    python -m benchmarks.actor.actor_scale                          # H200: every size alone, no offload
    python -m benchmarks.actor.actor_scale --offload fallback --beside-engine both
    python -m benchmarks.actor.actor_scale --sizes qwen2.5-7b --param-dtype bfloat16   # 12 bytes a parameter
    python -m benchmarks.actor.actor_scale --sizes tiny --device cpu --trajectories 8 --tokens 32  # smoke

Each run (benchmarks/actor/actor_scale_run.py) builds its model from the config in
benchmarks/engine/model_shapes.py straight on the device (no host copy), gives it to
`Actor(setup, hf_model=model)` with this script's overrides and the `--override`s, and times `--steps` steps
after one warm-up (which allocates AdamW's moments). Per run: `trained` (false on any error; `oom` when it
was `torch.OutOfMemoryError`, with the stage it hit), the peak allocated and reserved GPU memory of the
steps, the median step, trained tokens/s (every token of every trajectory) and MFU over `--peak-tflops`
(default 989: the H200's dense bf16); `sizes` holds each size's best run, `runs` every one.

Every run (size x offload x mode) is a fresh child process: an out-of-memory error leaves tensors held by
its traceback and a fragmented cache behind, a host OOM kill or a CUDA error ends the process, and the peak
counters are per process, so no run's failure or leftovers can change the next one's figures; a killed
child is recorded as not trained. The parent never touches CUDA (its context would take GPU memory).

Beside the engine (`--beside-engine`) a separate process holds, for each size, the memory the embedded
engine would hold serving that same model in a colocated run: its bf16 weights plus its default KV cache
(`rollout.max_running_requests` x `rollout.max_context_len` tokens), or `--engine-gib` for every size.
A held tensor, not a real engine: the engine's footprint grows with the model it serves, and a real one
would need the weights of each size written to disk first. Its own CUDA context stands in for the engine's;
CUDA graphs and the engine's activations are not held, and nothing generates, so the GPU's time is the
actor's alone (benchmarks/actor/trainer_smollm2.py measures the time sharing).
`--offload fallback` tries offload only for a size that failed without it. `--merge` adds the runs to
`--out`'s (a run of the same size, offload and mode replaced), so a session can run the modes one command
at a time. Writes benchmarks/results/actor/actor_scale_h200.json after every run (with bf16 weights or
moments: actor_scale_h200_param-bfloat16[_state-bfloat16].json, so runs of each precision keep a file of their
own).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from benchmarks import write_json  # noqa: E402
from benchmarks.actor.actor_scale_run import FLOPS, GIB, SHAPES, summary_line  # noqa: E402
from tandemrl.config.errors import ConfigError  # noqa: E402
from tandemrl.config.loader import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "actor" / "actor_scale_h200.json"
SCALE_SIZES = ("qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b")
H200_DENSE_BF16_TFLOPS = 989.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=",".join(SCALE_SIZES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the smoke run")
    p.add_argument("--trajectories", type=int, default=256)
    p.add_argument("--tokens", type=int, default=512, help="tokens per trajectory")
    p.add_argument("--steps", type=int, default=1, help="timed steps, after one warm-up step")
    p.add_argument(
        "--offload",
        nargs="?",
        const="on",
        default="off",
        choices=("off", "on", "both", "fallback"),
        help="actor.cpu_offload: on (bare --offload), both, or fallback (on only where off failed)",
    )
    p.add_argument("--beside-engine", nargs="?", const="on", default="off", choices=("off", "on", "both"))
    p.add_argument("--engine-gib", type=float, default=None, help="held beside the actor (default: per size)")
    p.add_argument("--peak-tflops", type=float, default=H200_DENSE_BF16_TFLOPS, help="the GPU's dense bf16")
    p.add_argument(
        "--param-dtype", choices=("float32", "bfloat16"), default="float32", help="actor.param_dtype"
    )
    p.add_argument(
        "--state-dtype", choices=("float32", "bfloat16"), default="float32", help="actor.optim.state_dtype"
    )
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--run-timeout-s", type=float, default=1800.0, help="per child process")
    p.add_argument("--merge", action="store_true", help="keep --out's other runs")
    p.add_argument("--out", default=None, help="default: per precision, see the module docstring")
    args = p.parse_args(argv)
    args.out = args.out or str(default_out(args.param_dtype, args.state_dtype))
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in args.sizes if s not in SHAPES]
    if unknown or not args.sizes:
        p.error(f"--sizes {unknown or 'empty'}: choose from {', '.join(SHAPES)}")
    if min(args.trajectories, args.tokens, args.steps) < 1:
        p.error("--trajectories, --tokens and --steps must be >= 1")
    return args


def default_out(param_dtype: str, state_dtype: str) -> Path:
    """The results file of a precision: DEFAULT_OUT for fp32 weights and moments, suffixed otherwise."""
    suffix = "".join(
        f"_{name}-{dtype}"
        for name, dtype in (("param", param_dtype), ("state", state_dtype))
        if dtype != "float32"
    )
    return DEFAULT_OUT.with_name(f"{DEFAULT_OUT.stem}{suffix}.json")


def actor_overrides(args: argparse.Namespace, offload: bool, output_dir: str) -> list[str]:
    """The config overrides of one run; the user's `--override`s last, so they win."""
    overrides = [
        f"actor.device={args.device}",
        "actor.gradient_checkpointing=true",
        "algorithm.n_minibatches=1",
        f"runner.output_dir={output_dir}",
    ]
    # only where not the default: a results file written before these options still merges
    if args.param_dtype != "float32":
        overrides.append(f"actor.param_dtype={args.param_dtype}")
    if args.state_dtype != "float32":
        overrides.append(f"actor.optim.state_dtype={args.state_dtype}")
    if args.device == "cuda":
        overrides.append("actor.dtype=bfloat16")
    if offload:
        overrides.append("actor.cpu_offload=true")
    return overrides + list(args.override)


def check_config(args: argparse.Namespace, offloads: list[bool]) -> None:
    """Refuse, before any run, a config the actor would refuse (an unknown key, a bad value)."""
    for offload in offloads:
        try:
            load_config(None, actor_overrides(args, offload, tempfile.gettempdir()))
        except ConfigError as exc:
            if offload and "unknown key actor.cpu_offload" in str(exc):
                raise SystemExit(
                    "--offload sets actor.cpu_offload (FSDP2's CPUOffloadPolicy), which this tree's config "
                    "does not have yet. Run without --offload, or on a tree that has the key."
                ) from None
            flag = " with --offload" if offload else ""
            raise SystemExit(f"the actor's config{flag} is refused: {exc}") from None


ENGINE_HOLDER = """import sys, torch
size, device = int(sys.argv[1]), sys.argv[2]
held = torch.empty(size, dtype=torch.uint8, device=device)
if device == "cuda":
    held.fill_(0)
    torch.cuda.synchronize()
print("held", flush=True)
sys.stdin.read()
"""


class EngineMemory:
    """A process holding `gib` GiB of `device` memory while the actor beside it runs (see the docstring)."""

    def __init__(self, gib: float, device: str):
        self.gib, self.device = gib, device
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> EngineMemory:
        argv = [sys.executable, "-c", ENGINE_HOLDER, str(int(self.gib * GIB)), self.device]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "held":
            self.proc.kill()
            raise RuntimeError(f"the process holding the engine's {self.gib:.1f} GiB did not start")
        return self

    def __exit__(self, *exc) -> None:
        self.proc.stdin.close()  # its read returns, and it exits
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def engine_gib(size: str, args: argparse.Namespace) -> float:
    """`--engine-gib`, or the embedded engine serving `size` in bf16: its weights and its default KV cache."""
    if args.engine_gib is not None:
        return args.engine_gib
    from transformers import AutoModelForCausalLM, Qwen2Config

    from tandemrl.engine.kv_cache import kv_bytes_per_token

    shape = SHAPES[size]
    with torch.device("meta"):
        num_params = sum(
            p.numel() for p in AutoModelForCausalLM.from_config(Qwen2Config(**shape)).parameters()
        )
    rollout = load_config(None, list(args.override)).rollout
    cfg = {
        "num_layers": shape["num_hidden_layers"],
        "num_kv_heads": shape["num_key_value_heads"],
        "head_dim": shape["hidden_size"] // shape["num_attention_heads"],
    }
    kv_tokens = rollout.max_running_requests * rollout.max_context_len
    return (2 * num_params + kv_tokens * kv_bytes_per_token(cfg, torch.bfloat16)) / GIB


def run_spec(args: argparse.Namespace, size: str, offload: bool, mode: str, tmp: str) -> dict:
    return {
        "size": size,
        "offload": offload,
        "mode": mode,
        "device": args.device,
        "trajectories": args.trajectories,
        "tokens": args.tokens,
        "steps": args.steps,
        "peak_tflops": args.peak_tflops,
        "overrides": actor_overrides(args, offload, tmp),
        "command": args.command,
        "result_path": str(Path(tmp) / "result.json"),
    }


def run_child(args: argparse.Namespace, size: str, offload: bool, mode: str) -> dict:
    """One run in a fresh process (beside `EngineMemory` in mode 'beside_engine'): its record."""
    gib = engine_gib(size, args) if mode == "beside_engine" else None
    with tempfile.TemporaryDirectory(prefix="tandem-actor-scale-") as tmp:
        spec = run_spec(args, size, offload, mode, tmp)
        argv = [sys.executable, "-m", "benchmarks.actor.actor_scale_run", json.dumps(spec)]
        failed = "the run wrote no result"
        with EngineMemory(gib, args.device) if gib is not None else contextlib.nullcontext():
            try:
                code = subprocess.run(argv, cwd=ROOT, timeout=args.run_timeout_s).returncode
                if code != 0:
                    failed = f"the run's process exited with code {code} (a negative code: killed, host OOM?)"
            except subprocess.TimeoutExpired:
                failed = f"the run's process took over {args.run_timeout_s:.0f} s (--run-timeout-s)"
        result = Path(spec["result_path"])
        if result.is_file():
            record = json.loads(result.read_text())
        else:
            record = {key: spec[key] for key in ("size", "offload", "mode", "command")}
            record.update(trained=False, oom=False, error=failed)
    if gib is not None:
        record["engine_gib"] = gib
    return record


def size_entry(runs: list[dict]) -> dict:
    """A size's entry: its fastest run that trained, else its first (the failure without offload)."""
    trained = [r for r in runs if r["trained"]]
    run = max(trained, key=lambda r: r["tokens_per_s"]) if trained else runs[0]
    keys = ("trained", "peak_gpu_gib", "peak_reserved_gib", "step_s", "tokens_per_s", "mfu", "hfu", "offload")
    return {key: run.get(key) for key in keys} | ({} if run["trained"] else {"error": run.get("error")})


def largest(runs: list[dict], offload: bool | None = None) -> str | None:
    """The largest size with a run that trained (with `offload` that option only); None if none did."""
    fits = {r["size"] for r in runs if r["trained"] and offload in (None, r["offload"])}
    return max(fits, key=list(SHAPES).index) if fits else None


def summarise(runs: list[dict]) -> dict:
    """The issue's keys: `sizes` (alone where that mode ran, else beside the engine) and the largest size
    that trained in each mode (None: the mode did not run, or nothing trained; `modes_run` tells which)."""
    per_mode = {mode: [r for r in runs if r["mode"] == mode] for mode in ("alone", "beside_engine")}
    entries = {
        mode: {
            s: size_entry([r for r in mine if r["size"] == s])
            for s in SHAPES
            if any(r["size"] == s for r in mine)
        }
        for mode, mine in per_mode.items()
    }
    return {
        "sizes": entries["alone"] if per_mode["alone"] else entries["beside_engine"],
        "largest_alone": largest(per_mode["alone"]),
        "sizes_beside_engine": entries["beside_engine"],
        "largest_beside_engine": largest(per_mode["beside_engine"]),
        "largest_by_offload": {
            mode: {
                f"offload_{'on' if o else 'off'}": largest(mine, o)
                for o in sorted({r["offload"] for r in mine})
            }
            for mode, mine in per_mode.items()
            if mine
        },
        "modes_run": [mode for mode, mine in per_mode.items() if mine],
    }


def settings(args: argparse.Namespace) -> dict:
    return {
        "device": args.device,
        "trajectories": args.trajectories,
        "tokens_per_trajectory": args.tokens,
        "warmup_steps": 1,
        "timed_steps": args.steps,
        "peak_tflops": args.peak_tflops,
        # every run's config overrides (the user's last); an offloaded run adds actor.cpu_offload=true
        "overrides": actor_overrides(args, False, "<tmp>"),
    }


def write(args: argparse.Namespace, previous: dict | None, runs: list[dict]) -> dict:
    """The JSON of these runs (and, with --merge, the previous file's others), written to --out."""
    mine = {(r["size"], r["offload"], r["mode"]) for r in runs}
    kept = [r for r in (previous or {}).get("runs", []) if (r["size"], r["offload"], r["mode"]) not in mine]
    all_runs = sorted(kept + runs, key=lambda r: (r["mode"], list(SHAPES).index(r["size"]), r["offload"]))
    gpu_runs = [r for r in all_runs if "gpu" in r]
    engines = {r["size"]: r["engine_gib"] for r in all_runs if "engine_gib" in r}
    result = {
        "commands": sorted({r["command"] for r in all_runs}),
        "gpu": gpu_runs[-1]["gpu"] if gpu_runs else None,
        "gpu_total_gib": gpu_runs[-1].get("gpu_total_gib") if gpu_runs else None,
        "torch": torch.__version__,
        "transformers": _transformers_version(),
        "settings": settings(args),
        "flops": FLOPS,
        "engine": {
            "kind": "reserved memory: a process holding a tensor, not a running engine (module docstring)",
            "gib": engines,
            "sized_by": "--engine-gib" if args.engine_gib is not None else "bf16 weights + default KV cache",
        }
        if engines
        else None,
        **summarise(all_runs),
        "runs": all_runs,
    }
    write_json(args.out, result)
    return result


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def load_previous(args: argparse.Namespace) -> dict | None:
    """--merge: the runs already in --out, when they were made with the same settings."""
    path = Path(args.out)
    if not (args.merge and path.is_file()):
        return None
    previous = json.loads(path.read_text())
    if previous.get("settings") != settings(args):
        raise SystemExit(
            f"--merge: {path} was made with other settings ({previous.get('settings')}); run with the same "
            "--device, --trajectories, --tokens, --steps, --peak-tflops and --override, or another --out."
        )
    return previous


def plan(args: argparse.Namespace) -> tuple[list[str], list[bool]]:
    modes = {"off": ["alone"], "on": ["beside_engine"], "both": ["alone", "beside_engine"]}[
        args.beside_engine
    ]
    offloads = {"off": [False], "on": [True], "both": [False, True], "fallback": [False, True]}[args.offload]
    return modes, offloads


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() == 0:  # counts without making a CUDA context
        raise SystemExit("--device cuda: no CUDA device here. Use --device cpu for the smoke run.")
    modes, offloads = plan(args)
    check_config(args, offloads)
    args.command = "python -m benchmarks.actor.actor_scale " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    previous = load_previous(args)
    print(f"MFU against {args.peak_tflops:g} TFLOPS (--peak-tflops; the H200's dense bf16: 989)", flush=True)
    runs: list[dict] = []
    for mode in modes:
        for size in args.sizes:
            for offload in offloads:
                if (
                    offload
                    and args.offload == "fallback"
                    and any(r["trained"] for r in runs if (r["size"], r["mode"]) == (size, mode))
                ):
                    continue
                runs.append(run_child(args, size, offload, mode))
                print(summary_line(runs[-1]), flush=True)
                result = write(args, previous, runs)
    print(
        f"largest alone: {result['largest_alone']}, beside the engine: {result['largest_beside_engine']} "
        f"-> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
