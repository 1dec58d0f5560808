"""SmolLM2-135M actor benchmark: `Actor.train_step` tokens/s alone and while an embedded engine process
on the same GPU generates, for the session-7 settings ("before": sdpa over length-sorted padded rows,
8192-token micro-batches, HF's eager RMSNorm) and the current defaults ("after": auto attention, i.e.
torch's varlen flash kernel over packed rows where it works, the auto micro-batch budget, fused RMSNorm).

    python3 -m benchmarks.actor.trainer_smollm2          # H200: the prepared SmolLM2 (random weights without it)
    python3 -m benchmarks.actor.trainer_smollm2 --tiny   # CPU smoke check of the same code (no figures)

Steps are the real code path: `Actor(actor_setup(config))` loads the model directory, `train_step` runs
`algorithm.n_minibatches` updates on RL-shaped samples (a ~250-token prompt, then model turns
alternating with masked information blocks, 300-1000 tokens). Order: "before" alone; the engine
starts (its KV cache takes its default share of the free memory, as in a run); "after" alone (engine
idle); at the after budget, sdpa over padded rows and HF's own RMSNorm (which lever did what); the
engine's generation rate alone (actor idle); then "after" while a client process keeps
`--engine-concurrency` /generate requests in flight. Options: `--shared-before` times "before" next
to generation too; `--mps` runs it all under a private MPS daemon (kernels of the two processes may
overlap instead of time-slicing); `--compile-variant` adds "after" with `actor.compile_layers` (its
compile time shows in `warmup_step_s`); `--decoupled-variant` adds "after" with
`algorithm.off_policy_correction=decoupled` (what its proximal recompute adds to a step), and the two
together "after" with both, and with both and `algorithm.proximal_logprobs=loglinear` (no proximal pass);
`--profile`
adds the top GPU kernels of one "after" step.
Each variant: one warm-up step, then `--steps` timed steps; the median is reported, with the
process's CPU seconds per step (all threads, CUDA spin-waits included: an upper bound on host work),
its peak GPU memory and allocator retries (memory pressure), and the engine's tokens/s in the same
window (`gpu_share_sum_after` near 1: the two split the GPU's time). Writes
benchmarks/results/actor/trainer_smollm2_h200.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from benchmarks import write_json  # noqa: E402
from benchmarks.actor.trainer import write_engine_dir  # noqa: E402
from benchmarks.engine.engine_load import GenerationLoad  # noqa: E402
from benchmarks.engine.model_shapes import SMOLLM2_135M, TINY  # noqa: E402
from tandemrl.cluster.mps import MpsDaemon  # noqa: E402
from tandemrl.config.loader import load_config  # noqa: E402
from tandemrl.trainer.batching import TrainSample  # noqa: E402

# the actor settings of session 7
BEFORE = ("actor.attn_implementation=sdpa", "actor.micro_batch_tokens=8192", "actor.fused_rms_norm=false")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny random model on CPU: a smoke check")
    p.add_argument("--num-samples", type=int, default=None, help="trajectories per step (512; tiny 8)")
    p.add_argument("--min-len", type=int, default=None, help="300; tiny 24")
    p.add_argument("--max-len", type=int, default=None, help="1000; tiny 64")
    p.add_argument("--n-minibatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant, after one warm-up")
    p.add_argument("--after-attn", default=None, help="actor.attn_implementation after (auto; tiny varlen)")
    p.add_argument("--after-micro-batch-tokens", default="null", help="null: the auto budget")
    p.add_argument("--no-ablation", action="store_true", help="skip sdpa padded rows at the after budget")
    p.add_argument("--profile", action="store_true", help="profile one 'after' step: top kernels, GPU busy")
    p.add_argument("--compile-variant", action="store_true", help="also time after + actor.compile_layers")
    p.add_argument(
        "--decoupled-variant",
        action="store_true",
        help="also time after + algorithm.off_policy_correction=decoupled (the proximal recompute's cost)",
    )
    p.add_argument("--shared-before", action="store_true", help="also time 'before' next to generation")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="engine KV cache (default: auto)")
    p.add_argument(
        "--engine-concurrency",
        type=int,
        default=None,
        help="requests in flight (64; tiny 4); raises rollout.max_running_requests to it",
    )
    p.add_argument("--max-new-tokens", type=int, default=None, help="per request (256; tiny 8)")
    p.add_argument("--engine-window-s", type=float, default=None, help="engine-alone window (6; tiny 1)")
    p.add_argument("--mps", action="store_true", help="run actor and engine under a private MPS daemon")
    p.add_argument(
        "--engine-sm-percents",
        type=lambda text: [int(x) for x in text.split(",")],
        default=None,
        help="with --mps: time 'after' shared once per engine SM cap, e.g. 100,50,25 (cluster.mps_sm_percent)",
    )
    p.add_argument(
        "--out", default=None, help="benchmarks/results/actor/trainer_smollm2_h200.json (tiny: under /tmp)"
    )
    args = p.parse_args()
    if args.out is None:
        results = Path(__file__).resolve().parents[1] / "results" / "actor"
        args.out = (
            "/tmp/trainer_smollm2_tiny.json" if args.tiny else str(results / "trainer_smollm2_h200.json")
        )
    tiny = dict(num_samples=8, min_len=24, max_len=64, after_attn="varlen", engine_concurrency=4)
    full = dict(num_samples=512, min_len=300, max_len=1000, after_attn="auto", engine_concurrency=64)
    tiny.update(max_new_tokens=8, engine_window_s=1.0)
    full.update(max_new_tokens=256, engine_window_s=6.0)
    for name, value in (tiny if args.tiny else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def make_rl_samples(num: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[TrainSample]:
    """Search-R1-shaped trajectories: a prompt of ~3/8 of min_len (mask 0), then model turns (mask 1)
    alternating with information blocks (mask 0) up to a random length; rollout logprobs in [-3, 0]."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n = rng.randint(min_len, max_len)
        mask = [0] * (3 * min_len // 8 + rng.randint(0, min_len // 8))
        while len(mask) < n:
            mask += [1] * rng.randint(max(2, min_len // 10), max(3, min_len // 3))
            if len(mask) < n - min_len // 10:
                mask += [0] * rng.randint(max(2, min_len // 5), max(3, min_len // 2))
        mask = mask[:n]
        ids = [rng.randrange(vocab) for _ in range(n)]
        old = [-rng.uniform(0.0, 3.0) * m for m in mask]
        out.append(TrainSample(ids, mask, old, rng.uniform(-1, 1)))
    return out


def model_dir_for(args, tmp: Path) -> tuple[Path, str]:
    """The prepared SmolLM2 (full run) or a random model of its (or the tiny) shape saved to `tmp`."""
    from tandemrl.host.home import default_model_dir

    prepared = default_model_dir()
    if not args.tiny and (prepared / "config.json").is_file():
        return prepared, f"prepared {prepared}"
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    shape = TINY if args.tiny else SMOLLM2_135M
    model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.float32)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    return write_engine_dir(model, tmp / "model", dtype), "random weights from the config"


def make_actor(model_dir: Path, args, device: torch.device, *settings: str):
    """An Actor loading `model_dir`, with the benchmark's overrides and then `settings` (key=value)."""
    from tandemrl.config.derive import actor_setup
    from tandemrl.trainer.actor import Actor

    overrides = [
        f"actor.device={device.type}",
        f"actor.model.model_path={model_dir}",
        "runner.output_dir=/tmp/tandem-bench",
        f"algorithm.n_minibatches={args.n_minibatches}",
        *settings,
    ]
    return Actor(actor_setup(load_config(None, overrides)))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_variant(actor, samples, args, device: torch.device, load=None) -> dict:
    """One warm-up step, then `args.steps` timed ones: wall and process CPU seconds, GPU memory."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    warm_start = time.perf_counter()
    actor.train_step(samples)
    sync(device)
    warmup_s = time.perf_counter() - warm_start
    wall, cpu, rates = [], [], []
    for _ in range(args.steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        actor.train_step(samples)
        sync(device)
        end = time.perf_counter()
        wall.append(end - start)
        cpu.append(time.process_time() - cpu_start)
        if load is not None:
            rates.append(load.tokens_per_s(start, end))
    tokens = sum(s.num_tokens for s in samples)
    # progress on stderr as each variant ends, so a run cut short still shows where its time went
    print(
        f"[{time.strftime('%T')}] variant done: warm-up {warmup_s:.1f} s, steps {[round(w, 2) for w in wall]} s",
        file=sys.stderr,
        flush=True,
    )
    result = {
        "attn_implementation": actor.hf_model.config._attn_implementation,
        "layout": "padded rows" if actor.is_padded else "packed rows",
        "micro_batch_tokens": actor.micro_batch_tokens,
        "micro_batches_per_step": sum(len(actor._plan(mb)) for mb in _minibatches(samples, args)),
        "compile_layers": actor.setup.actor.compile_layers,
        "warmup_step_s": warmup_s,
        "train_step_s": wall,
        "cpu_s_per_step": cpu,
        "train_tokens_per_s": tokens / statistics.median(wall),
        "cpu_share_of_step": statistics.median(cpu) / statistics.median(wall),
        "num_skipped_updates": actor.num_skipped_updates,
    }
    if load is not None:
        result["engine_tokens_per_s_during"] = statistics.median(rates)
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        free, total = torch.cuda.mem_get_info(device)
        result.update(
            actor_peak_allocated_gb=stats["allocated_bytes.all.peak"] / 1e9,
            actor_peak_reserved_gb=stats["reserved_bytes.all.peak"] / 1e9,
            actor_alloc_retries=stats["num_alloc_retries"],
            gpu_used_gb=(total - free) / 1e9,
        )
    return result


def _minibatches(samples, args):
    from tandemrl.trainer.batching import split_minibatches

    return split_minibatches(samples, args.n_minibatches)


def free_actor(actor, device: torch.device) -> None:
    del actor
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def start_engine(model_dir: Path, args, device: torch.device, sm_percent: int | None = None):
    """The embedded engine as a run starts it; `sm_percent` caps its SMs under MPS (cluster/mps.py)."""
    from tandemrl.cluster.mps import SM_PERCENT_ENV
    from tandemrl.rollout.engine_process import EngineProcess

    rollout = load_config(None, []).rollout
    if args.kv_cache_gb is not None:
        rollout.engine.kv_cache_gb = args.kv_cache_gb
    rollout.max_running_requests = max(rollout.max_running_requests, args.engine_concurrency)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    engine = EngineProcess.from_rollout(rollout, model_dir, device.type, dtype, seed=0)
    if sm_percent is not None:
        engine.env = {**(engine.env or {}), SM_PERCENT_ENV: str(sm_percent)}
    return engine


def profile_step(actor, samples, device: torch.device, top: int = 25) -> dict:
    """One more step under torch.profiler: the kernels with the most GPU time, and the GPU-busy share of
    the step (summed kernel time over wall time: near 1 the step is GPU-bound, well below it the host
    or syncs leave the GPU idle). The profiler slows the host, so the wall time here is pessimistic."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        actor.train_step(samples)
        sync(device)
        wall = time.perf_counter() - start
    rows = [e for e in prof.key_averages() if e.device_type.name == device.type.upper()] or list(
        prof.key_averages()
    )
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    rows.sort(key=lambda e: -getattr(e, key))
    busy_s = sum(getattr(e, key) for e in rows) / 1e6
    return {
        "wall_s": wall,
        "kernel_time_s": busy_s,
        "busy_share": busy_s / wall,
        "top": [{"name": e.key[:120], "time_s": getattr(e, key) / 1e6, "calls": e.count} for e in rows[:top]],
    }


def after_variants(args, device: torch.device, model_dir: Path, samples, variants: dict):
    """'after' alone (kept for sharing, returned), its profile and the ablations (which lever did what)."""
    after_settings = (
        f"actor.attn_implementation={args.after_attn}",
        f"actor.micro_batch_tokens={args.after_micro_batch_tokens}",
        "actor.fused_rms_norm=true",
    )
    after = make_actor(model_dir, args, device, *after_settings)
    variants["after_alone"] = time_variant(after, samples, args, device)
    if args.profile:
        try:
            variants["after_alone"]["profile"] = profile_step(after, samples, device)
        except Exception as exc:  # a diagnostic; the measurements must still come back
            variants["after_alone"]["profile"] = {"error": repr(exc)[:500]}
    budget = f"actor.micro_batch_tokens={after.micro_batch_tokens}"
    others = {}
    if not args.no_ablation:
        others["sdpa_padded_after_budget_alone"] = ("actor.attn_implementation=sdpa", budget)
        others["after_without_fused_rms_norm_alone"] = (*after_settings, budget, "actor.fused_rms_norm=false")
    if args.compile_variant:
        others["after_compiled_alone"] = (*after_settings, budget, "actor.compile_layers=true")
    if args.decoupled_variant:
        others["after_decoupled_alone"] = (
            *after_settings,
            budget,
            "algorithm.off_policy_correction=decoupled",
        )
    if args.compile_variant and args.decoupled_variant:  # the async recipe's actor, compiled
        others["after_compiled_decoupled_alone"] = (
            *after_settings,
            budget,
            "actor.compile_layers=true",
            "algorithm.off_policy_correction=decoupled",
        )
        # the same without the proximal pass (docs/LEARNING.md, Off-policy correction)
        others["after_compiled_decoupled_loglinear_alone"] = (
            *others["after_compiled_decoupled_alone"],
            "algorithm.proximal_logprobs=loglinear",
        )
    for name, settings in others.items():
        actor = make_actor(model_dir, args, device, *settings)
        variants[name] = time_variant(actor, samples, args, device)
        free_actor(actor, device)
    return after


def run(args, device: torch.device, model_dir: Path, samples: list[TrainSample]) -> dict:
    """The variants in the order of the module docstring; the engine lives from 'after' on."""
    variants: dict[str, dict] = {}
    before = make_actor(model_dir, args, device, *BEFORE)
    variants["before_alone"] = time_variant(before, samples, args, device)
    free_actor(before, device)
    percents = args.engine_sm_percents or [None]
    engine = start_engine(model_dir, args, device, percents[0])
    started = time.perf_counter()
    with engine:
        engine_startup_s = time.perf_counter() - started
        after = after_variants(args, device, model_dir, samples, variants)
        shared = {percents[0]: share_gpu(engine, after, samples, args, device, variants)}
    for percent in percents[1:]:  # the next cap needs a new engine process: MPS reads it at start
        print(f"[{time.strftime('%T')}] engine with SM cap {percent} %", file=sys.stderr, flush=True)
        with start_engine(model_dir, args, device, percent) as engine:
            shared[percent] = share_gpu(engine, after, samples, args, device)
    first = shared[percents[0]]
    variants["after_shared"] = first["variant"]
    sweep = (
        [sweep_row(p, shared[p], variants["after_alone"]) for p in percents]
        if args.engine_sm_percents
        else []
    )
    return {
        "variants": variants,
        "engine_startup_s": engine_startup_s,
        "engine_tokens_per_s_alone": first["engine_alone"],
        "engine_requests_done": first["num_done"],
        "engine_errors": first["errors"][:5],
        "kv_cache_gb": args.kv_cache_gb,
        "engine_concurrency": args.engine_concurrency,
        "max_new_tokens": args.max_new_tokens,
        "engine_sm_sweep": sweep,
        # the cap under which the two together did the most of their alone-rates (share sum)
        "best_engine_sm_percent": max(sweep, key=lambda r: r["gpu_share_sum"])["engine_sm_percent"]
        if sweep
        else None,
    }


def share_gpu(engine, after, samples, args, device: torch.device, variants: dict | None = None) -> dict:
    """The engine's rate alone, then 'after' while it generates (and 'before', with --shared-before)."""
    vocab = after.hf_model.config.vocab_size
    prompt_len = min(250, 3 * args.min_len // 8)
    load = GenerationLoad(
        engine.url, args.engine_concurrency, args.max_new_tokens, vocab, prompt_len, engine.api_key
    )
    with load:
        load.rate_over(args.engine_window_s / 3)  # warm: batches fill, first requests finish
        engine_alone = load.rate_over(args.engine_window_s)
        variant = time_variant(after, samples, args, device, load)
        if args.shared_before and variants is not None:
            before = make_actor(Path(engine.model_path), args, device, *BEFORE)
            variants["before_shared"] = time_variant(before, samples, args, device, load)
            free_actor(before, device)
    return {
        "engine_alone": engine_alone,
        "variant": variant,
        "errors": load.errors(),
        "num_done": len(load.records()),
    }


def sweep_row(percent: int | None, shared: dict, alone: dict) -> dict:
    train_share = shared["variant"]["train_tokens_per_s"] / alone["train_tokens_per_s"]
    engine_share = shared["variant"]["engine_tokens_per_s_during"] / max(shared["engine_alone"], 1e-9)
    return {
        "engine_sm_percent": percent or 100,
        "train_tokens_per_s_shared": shared["variant"]["train_tokens_per_s"],
        "train_shared_over_alone": train_share,
        "engine_tokens_per_s_alone": shared["engine_alone"],
        "engine_tokens_per_s_shared": shared["variant"]["engine_tokens_per_s_during"],
        "engine_shared_over_alone": engine_share,
        "gpu_share_sum": train_share + engine_share,
    }


def summarise(result: dict) -> dict:
    v = result["variants"]
    tps = {name: v[name]["train_tokens_per_s"] for name in v}
    shared = {"variant": v["after_shared"], "engine_alone": result["engine_tokens_per_s_alone"]}
    share = sweep_row(None, shared, v["after_alone"])
    summary = {
        "speedup_after_vs_before_alone": tps["after_alone"] / tps["before_alone"],
        "shared_over_alone_after": share["train_shared_over_alone"],
        "engine_shared_over_alone": share["engine_shared_over_alone"],
        # ~1: the two processes split the GPU's time (time-slicing); < 1: sharing itself costs
        # (context switches, host or memory contention); > 1: their kernels overlap (MPS)
        "gpu_share_sum_after": share["gpu_share_sum"],
    }
    if "before_shared" in v:
        summary["shared_over_alone_before"] = tps["before_shared"] / tps["before_alone"]
    return summary


def main() -> int:
    args = parse_args()
    if args.engine_sm_percents and not args.mps:
        raise SystemExit("--engine-sm-percents caps the engine's SMs under MPS: add --mps.")
    mps = None
    if args.mps and not args.tiny:  # before this process touches CUDA
        mps = MpsDaemon(Path(tempfile.mkdtemp(prefix="tandem-bench-mps-"))).start()
        os.environ.update(mps.env)
    use_cuda = not args.tiny and torch.cuda.is_available()
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    if args.tiny:
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-smollm2-") as tmp:
        model_dir, source = model_dir_for(args, Path(tmp))
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        samples = make_rl_samples(args.num_samples, args.min_len, args.max_len, vocab, seed=0)
        try:
            measured = run(args, device, model_dir, samples)
        finally:
            if mps is not None:
                mps.stop()
    algorithm = load_config(None, [f"algorithm.n_minibatches={args.n_minibatches}"]).algorithm
    env = " ".join(f"{k}={os.environ[k]}" for k in ("PYTHONPATH", "TANDEM_HOME") if k in os.environ)
    result = {
        "gpu": torch.cuda.get_device_name(device) if use_cuda else f"cpu ({platform.processor()})",
        "command": f"{env} python3 {' '.join(sys.argv)}".strip(),
        "tiny": args.tiny,
        "model": source,
        "torch": torch.__version__,
        "num_samples": len(samples),
        "tokens_per_step": sum(s.num_tokens for s in samples),
        "loss_tokens_per_step": sum(s.num_loss_tokens for s in samples),
        "n_minibatches": args.n_minibatches,
        "off_policy_correction": algorithm.off_policy_correction,
        "recompute_logprobs": algorithm.recompute_logprobs,
        "mps": mps is not None,
        "before_settings": list(BEFORE),
        **measured,
    }
    result["summary"] = summarise(result)
    print(json.dumps(result, indent=2))
    write_json(args.out, result)
    v, s = result["variants"], result["summary"]
    print(
        f"before {v['before_alone']['train_tokens_per_s']:.0f} tok/s, after {v['after_alone']['train_tokens_per_s']:.0f} "
        f"tok/s ({s['speedup_after_vs_before_alone']:.2f}x); shared {v['after_shared']['train_tokens_per_s']:.0f} "
        f"tok/s ({s['shared_over_alone_after']:.2f} of alone); engine {result['engine_tokens_per_s_alone']:.0f} -> "
        f"{v['after_shared']['engine_tokens_per_s_during']:.0f} tok/s -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
