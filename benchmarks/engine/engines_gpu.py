"""The same workloads, on the same device, for the embedded engine, vLLM and SGLang, each started the way
`tandem train` starts it (the servers of rollout.backend=embedded|vllm|sglang, built from one config).

    python -m benchmarks.engine.engines_gpu                    # H200: every installed backend
        [--backends embedded,vllm,sglang] [--vllm-python PY] [--vllm-pythonpath DIR]
        [--sglang-python PY] [--sglang-pythonpath DIR] [--out benchmarks/results/engine/engines_h200.json]
    python -m benchmarks.engine.engines_gpu --cpu              # CPU smoke check of the same code, tiny sizes
                                                        # (writes engines_cpu.json, never GPU figures)

Per backend, in this order (each backend's first three, then the fixed batches while --deadline-s allows;
the JSON is rewritten after each backend, so a run cut short keeps what it measured):
- startup_s: launch to the first healthy /health of the SmolLM2 server (the model the recipe serves);
- weights_check: on that server (the cold-started SmolLM2 when prepared), push an actor's weights
  through the run's route (CUDA IPC on one GPU, gloo on CPU), then let the actor (HF) score the engine's
  greedy output on probe prompts, as the run's own check does (runner/weights_check.py): true when the
  actor ranks every engine token within runner.weights_check_tie_nats of its top (`exact`: each is
  its top; `max_gap_nats`; also recorded: whether the push changed the engine's output, so the check is
  not vacuous);
- agent_step_s: a rollout step of the H200 recipe (smollm2_h200_sync.yaml: 64 prompts x group 4 =
  256 trajectories with search) from the cold-started SmolLM2: `tandem train` for 1 + --agent-steps
  steps, the mean `time/wait_data` (the actor waiting for the 256 trajectories) of the steps after the
  first, which also pays for the server's first kernels (agent_first_step_s). GPU mode only;
- fixed_batch_tok_s: benchmarks/engine/engine.py's batch (256 requests x 256 random prompt ids -> 256 new
  tokens, temperature 1, ignore_eos; Qwen2.5-1.5B shape, random weights), all requests at once through
  the backend's own client (HTTP, as the runner drives it): output tokens / wall seconds, on a server of
  its own (fixed_batch_startup_s: its launch to healthy).
`vllm_eager` in --backends is vLLM under --enforce-eager (no CUDA graphs, no torch.compile), measured as a
backend of its own: what its shorter start costs in throughput. `vllm_pinned` is vLLM with 2 cores of its
own in the agent step's run (cluster.cpus_per_engine=2, the embedded engine's default): what pinning its
processes costs or saves.
A backend that is not installed (its interpreter cannot import it) is skipped, and the JSON says why.
The embedded engine's ratio to the best other backend is written per workload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from benchmarks import write_json  # noqa: E402
from benchmarks.engine.model_shapes import QWEN25_15B  # noqa: E402

BACKENDS = ("embedded", "vllm", "sglang")
# a backend under other flags of its own, measured as a backend of its own: name -> (backend, overrides)
VARIANTS = {
    "vllm_eager": ("vllm", ["rollout.vllm.extra_args=[--enforce-eager]"]),  # no CUDA graphs, no compile
    # the agent step's server on 2 cores of its own, as every engine was before cluster.cpus_per_engine
    # was derived per backend (vLLM's default is now the shared cores)
    "vllm_pinned": ("vllm", ["cluster.cpus_per_engine=2"]),
}
PROBES = ["The capital of France is", "Question: who wrote Hamlet?\nAnswer:", "1, 2, 3, 4,", "Water boils at"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="tiny sizes on CPU: a smoke check, not figures")
    p.add_argument("--backends", default=",".join(BACKENDS))
    for engine in ("vllm", "sglang"):
        p.add_argument(f"--{engine}-python", default=None, help=f"interpreter that runs {engine}")
        p.add_argument(f"--{engine}-pythonpath", default=None, help="put first on its PYTHONPATH")
    p.add_argument("--num-requests", type=int, default=None, help="default 256 (cpu 8)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 256 (cpu 32)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 256 (cpu 16)")
    p.add_argument("--probe-tokens", type=int, default=8)
    p.add_argument("--smollm2", default=None, help="SmolLM2 directory (default: the cold-started one)")
    p.add_argument("--skip-agent", action="store_true")
    p.add_argument(
        "--agent-steps",
        type=int,
        default=4,
        help="measured agent steps after the first (default 4: on an H100 vLLM's waits still fell over steps "
        "2 and 3, 5.57 s then 4.11 s)",
    )
    p.add_argument(
        "--agent-overrides", nargs="*", default=[], help="KEY=VALUE overrides of the agent step's run"
    )
    p.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="start no fixed batch after this many seconds of the run (the other workloads come first)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    unknown = [name for name in args.backends.split(",") if name not in (*BACKENDS, *VARIANTS)]
    if unknown:
        p.error(f"--backends: {unknown} are none of {[*BACKENDS, *VARIANTS]}")
    if args.agent_steps < 1:
        p.error(f"--agent-steps {args.agent_steps}: at least one step after the first is measured")
    args.num_requests = args.num_requests or (8 if args.cpu else 256)
    args.prompt_len = args.prompt_len or (32 if args.cpu else 256)
    args.new_tokens = args.new_tokens or (16 if args.cpu else 256)
    name = "engines_cpu.json" if args.cpu else "engines_h200.json"
    args.out = args.out or str(ROOT / "benchmarks" / "results" / "engine" / name)
    if (args.cpu or not torch.cuda.is_available()) and "h200" in Path(args.out).name:
        p.error(f"--out {args.out}: GPU figures come from a GPU run; a CPU run writes engines_cpu.json")
    return args


def engine_of(name: str) -> str:
    """The rollout.backend of a --backends entry (a variant's backend, else the name itself)."""
    return VARIANTS[name][0] if name in VARIANTS else name


def engine_overrides(args, name: str, device: str) -> list[str]:
    """The config of the servers `tandem train` would start for --backends entry `name` on this device."""
    overrides = [f"rollout.backend={engine_of(name)}", f"rollout.device={device}", "retrieval.launch=false"]
    overrides += ["rollout.dtype=float32"] if device == "cpu" else ["rollout.dtype=bfloat16"]
    for engine in ("vllm", "sglang"):
        if getattr(args, f"{engine}_python"):
            overrides.append(f"rollout.{engine}.python={getattr(args, f'{engine}_python')}")
        if getattr(args, f"{engine}_pythonpath"):
            overrides.append(f"rollout.{engine}.pythonpath=[{getattr(args, f'{engine}_pythonpath')}]")
    if device == "cpu":
        overrides += ["rollout.engine.kv_cache_gb=0.5", "rollout.vllm.cpu_kv_cache_gb=1"]
    return overrides + (VARIANTS[name][1] if name in VARIANTS else [])


def why_missing(args, name: str) -> str | None:
    """None when the backend's interpreter imports it, else the reason it is skipped."""
    backend = engine_of(name)
    if backend == "embedded":
        return None
    if backend == "sglang" and args.cpu:
        return "SGLang runs on GPUs only"
    python = getattr(args, f"{backend}_python") or sys.executable
    env = dict(os.environ)
    if getattr(args, f"{backend}_pythonpath"):
        env["PYTHONPATH"] = os.pathsep.join(
            [getattr(args, f"{backend}_pythonpath"), env.get("PYTHONPATH", "")]
        )
    probe = subprocess.run([python, "-c", f"import {backend}"], env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        return f"{python} cannot import {backend}: {probe.stderr.strip().splitlines()[-1:]}"
    return None


def start_server(backend: str, model_dir: Path, overrides: list[str], max_running: int, context: int):
    """The server `tandem train` would start (build_server of its ServerSpec); returns (server, key, s)."""
    from tandemrl.cluster.server_supervisor import ServerSpec, build_server
    from tandemrl.config.loader import load_config
    from tandemrl.host.http_guard import new_api_key

    config = load_config(
        None,
        overrides
        + [
            f"rollout.model.model_path={model_dir}",
            f"rollout.max_running_requests={max_running}",
            f"rollout.max_context_len={context}",
            "agentloop.max_response_tokens=64",  # the agent's budgets are no part of this workload
            "agentloop.max_new_tokens_per_turn=64",
            "agentloop.max_info_tokens=32",
            "rollout.startup_timeout_s=1200",
        ],
    )
    key = new_api_key()
    server = build_server(
        ServerSpec(engine_of(backend), 0, config, model_path=str(model_dir), api_key=key), "127.0.0.1"
    )
    start = time.perf_counter()
    server.start()
    return server, getattr(server, "api_key", None) or key, time.perf_counter() - start


async def fixed_batch(client, args, vocab: int) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(2, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    params = {"max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True}
    await client.generate(prompts[0][:8], {**params, "max_new_tokens": 4})  # warm-up
    start = time.perf_counter()
    results = await asyncio.gather(*(client.generate(p, params) for p in prompts))
    seconds = time.perf_counter() - start
    tokens = sum(len(r.output_ids) for r in results)
    return {"output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def actor_model(model_dir: Path, device: str):
    """The 'actor': the served model with every MLP down-projection halved (changes greedy output)."""
    from transformers import AutoModelForCausalLM

    from tandemrl.host.hf import hf_load_kwargs

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **hf_load_kwargs()).to(device).eval()
    for name, param in model.named_parameters():
        if name.endswith("mlp.down_proj.weight"):
            param.data.mul_(0.5)
    return model


async def weights_check(backend: str, client, url: str, key, model_dir: Path, device: str, args) -> dict:
    from tandemrl.rollout.backends import make_weight_sender

    route = "gloo" if device == "cpu" else "cuda_ipc"
    sender = make_weight_sender(engine_of(backend), route, [url], 256, api_key=key, pause_mode="drain")
    return {**await check_push(client, sender, model_dir, device, args.probe_tokens), "route": route}


async def check_push(client, sender, model_dir: Path, device: str, probe_tokens: int) -> dict:
    """Push `actor_model`'s weights through `sender` (its clients are closed after), then let the actor
    score the engine's greedy output on PROBES, as the run's weights check does (runner/weights_check.py)."""
    from transformers import AutoTokenizer

    from tandemrl.config.schema import RunnerConfig
    from tandemrl.runner.weights_check import judge
    from tandemrl.trainer.greedy_gaps import argmax_gaps

    tie_nats = RunnerConfig.weights_check_tie_nats
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.encode(p) for p in PROBES]
    params = {"max_new_tokens": probe_tokens, "temperature": 0.0, "ignore_eos": True}
    before = [(await client.generate(p, params)).output_ids for p in prompts]
    model = actor_model(model_dir, device)
    try:
        await sender.connect()
        named = [(n, t.detach()) for n, t in model.named_parameters()]  # tied weights once, as the actor
        pushed = await sender.push(named, weight_version=1)
    finally:
        for c in sender.clients:
            await c.close()
    engine = [(await client.generate(p, params)).output_ids for p in prompts]
    report = judge(
        [engine], [[argmax_gaps(model, p, ids) for p, ids in zip(prompts, engine, strict=True)]], tie_nats
    )
    return {
        "weights_check": report["weights_check"],
        "exact": report["exact"],
        "max_gap_nats": report["max_gap_nats"],
        "tie_nats": tie_nats,
        "push_s": pushed["seconds"],
        "push_changed_output": engine != before,
        "divergences": report["divergences"],
    }


def agent_step(backend: str, args, smollm2: Path, out_dir: Path) -> dict:
    """Steps of the sync recipe in one `tandem train`: `time/wait_data` of each (the actor waiting for the
    step's trajectories). The first step also pays for the server's first kernels (vLLM compiles Triton
    sampling kernels on its first requests: step 1 of the async recipe took 24 s there, step 2 2.0 s, on an
    H100), so agent_step_s is the mean of the steps after it."""
    config = ROOT / "examples" / "searchr1" / "config" / "smollm2_h200_sync.yaml"
    run_dir = out_dir / f"agent_{backend}"
    command = [sys.executable, "-m", "tandemrl.cli", "train", str(config), f"runner.output_dir={run_dir}"]
    command += [
        f"runner.max_steps={1 + args.agent_steps}",
        "runner.val_interval=0",
        "runner.val_before_train=false",
    ]
    command += ["runner.save_interval=0", f"rollout.model.model_path={smollm2}"]
    command += [
        o for o in engine_overrides(args, backend, "cuda") if o.startswith(("rollout.vllm", "rollout.sglang"))
    ]
    command.append(f"rollout.backend={engine_of(backend)}")
    if engine_of(backend) == "vllm":
        command += ["rollout.pause_mode=in_place", "rollout.vllm.gpu_memory_utilization=0.4"]
    if engine_of(backend) == "sglang":
        command += ["rollout.sglang.mem_fraction_static=0.4"]
    command += args.agent_overrides
    start = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    waits = [r["time/wait_data"] for r in rows if "time/wait_data" in r]
    return {
        "agent_step_s": sum(waits[1:]) / len(waits[1:]),
        "agent_first_step_s": waits[0],
        "agent_wait_data_s": waits,
        "run_s": time.perf_counter() - start,
        "command": command,
    }


def default_smollm2() -> Path:
    from tandemrl.host.home import default_model_dir

    base = Path(default_model_dir())
    coldstart = base.with_name(base.name + "-coldstart")
    return coldstart if coldstart.is_dir() else base


async def measure_smollm2(backend: str, args, device: str, smollm2: Path) -> dict:
    """startup_s and the weights check, on one SmolLM2 server."""
    from tandemrl.rollout.backends import make_client

    result: dict = {}
    overrides = engine_overrides(args, backend, device)
    server, key, result["startup_s"] = start_server(backend, smollm2, overrides, 16, 2048)
    client = make_client(engine_of(backend), server.url, api_key=key)
    try:
        result.update(await weights_check(backend, client, server.url, key, smollm2, device, args))
    finally:
        await client.close()
        server.stop()
    return result


async def measure_fixed_batch(backend: str, args, device: str, fixed_dir: Path, vocab: int) -> dict:
    from tandemrl.rollout.backends import make_client

    overrides = engine_overrides(args, backend, device)
    context = args.prompt_len + args.new_tokens + 64
    server, key, startup_s = start_server(backend, fixed_dir, overrides, args.num_requests, context)
    client = make_client(engine_of(backend), server.url, api_key=key)
    try:
        batch = await fixed_batch(client, args, vocab)
    finally:
        await client.close()
        server.stop()
    return {"fixed_batch": batch, "fixed_batch_tok_s": batch["tok_s"], "fixed_batch_startup_s": startup_s}


def ratios(backends: dict) -> dict:
    """embedded / best other per workload (tokens/s: higher is better; seconds: lower is better)."""
    others = {k: v for k, v in backends.items() if k != "embedded"}
    embedded, out = backends.get("embedded", {}), {}
    for key, higher_is_better in (("fixed_batch_tok_s", True), ("agent_step_s", False), ("startup_s", False)):
        values = [v[key] for v in others.values() if v.get(key) is not None]
        if embedded.get(key) is None or not values:
            continue
        best = max(values) if higher_is_better else min(values)
        out[key] = embedded[key] / best if higher_is_better else best / embedded[key]
    return out


def attempt(report: dict, what: str, measure, backend: str, *arguments) -> dict:
    """`measure(backend, *arguments)` (a coroutine function or a plain one); on a failure, {} and the failure
    recorded under report["failed"]: one failure leaves the others to run."""
    print(f"{backend}: {what}", flush=True)
    try:
        result = measure(backend, *arguments)
        if asyncio.iscoroutine(result):
            result = asyncio.run(result)
    except Exception as error:  # noqa: BLE001  one backend's failure is its result, the others still run
        report["failed"].setdefault(backend, {})[what] = f"{type(error).__name__}: {error}"
        print(f"{backend}: {what} failed ({report['failed'][backend][what]})", flush=True)
        return {}
    flat = {k: v for k, v in result.items() if not isinstance(v, dict | list)}
    print(f"{backend}: {what} {json.dumps(flat)}", flush=True)
    return result


def main() -> None:
    args = parse_args()
    device = "cpu" if args.cpu else "cuda"
    from benchmarks.engine.engine import write_model_dir

    work = Path(tempfile.mkdtemp(prefix="tandem-engines-"))
    smollm2 = Path(args.smollm2) if args.smollm2 else default_smollm2()
    # vLLM's CPU kernels refuse the tiny shape (head_dim 16): on CPU SmolLM2 itself stands in
    shape = {"vocab_size": 49152} if args.cpu else QWEN25_15B
    report = {
        "mode": device,
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "workloads": {
            "fixed_batch": f"{args.num_requests} requests x {args.prompt_len} prompt -> {args.new_tokens} new "
            f"tokens, T=1, ignore_eos, {'SmolLM2' if args.cpu else 'Qwen2.5-1.5B shape, random weights'}",
            "weights_check": f"{len(PROBES)} probe prompts x {args.probe_tokens} greedy tokens on {smollm2}",
            "agent_step": f"smollm2_h200_sync.yaml (64 prompts x group 4 a step), time/wait_data: the mean of "
            f"{args.agent_steps} step(s) after the first",
        },
        "backends": {},
        "skipped": {},
        "failed": {},
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    started = time.perf_counter()
    measured, fixed_dir = [], None
    for backend in args.backends.split(","):
        reason = why_missing(args, backend)
        if reason:
            report["skipped"][backend] = reason
            print(f"{backend}: skipped ({reason})", flush=True)
            continue
        measured.append(backend)
        result = report["backends"].setdefault(backend, {})
        result.update(attempt(report, "weights_check", measure_smollm2, backend, args, device, smollm2))
        if args.cpu or args.skip_agent:
            result["agent_step_s"] = None
            result["agent_step_skipped"] = "CPU mode" if args.cpu else "--skip-agent"
        else:
            result.update(attempt(report, "agent_step", agent_step, backend, args, smollm2, work))
        report["embedded_vs_best_other"] = ratios(report["backends"])
        write_json(args.out, report)
    for backend in measured:
        result = report["backends"][backend]
        if args.deadline_s is not None and time.perf_counter() - started > args.deadline_s:
            result["fixed_batch_skipped"] = f"past --deadline-s {args.deadline_s:g}"
            continue
        if fixed_dir is None:  # written once, when the first fixed batch runs
            fixed_dir = smollm2 if args.cpu else work / "fixed_model"
            if not args.cpu:
                write_model_dir(shape, fixed_dir, torch.device("cpu"), torch.bfloat16)
        vocab = shape["vocab_size"]
        result.update(
            attempt(report, "fixed_batch", measure_fixed_batch, backend, args, device, fixed_dir, vocab)
        )
        report["embedded_vs_best_other"] = ratios(report["backends"])
        write_json(args.out, report)
    report["run_s"] = time.perf_counter() - started
    write_json(args.out, report)


if __name__ == "__main__":
    main()
