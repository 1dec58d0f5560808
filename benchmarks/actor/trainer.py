"""Trainer benchmark: training tokens/s and MFU of the Actor against a plain HF forward/backward loop on
the same micro-batches in the same run, and the time of a full weight sync into an engine process.

    python -m benchmarks.actor.trainer                 # H200: Qwen2.5-1.5B-shaped model, random weights, bf16
    python -m benchmarks.actor.trainer --tiny          # CPU smoke check of the same code (no figures)

The model is built from a config (no download). Both loops see identical micro-batches (the Actor's
token-budget grouping: one packed row with flash-attn, length-sorted padded rows with sdpa) and do one
AdamW update per minibatch; the HF loop is the textbook one (autocast bf16 over fp32 weights, `labels=`
loss over the full logits, clip, step). Both models stay resident (~50 GB of weights and optimizer
state at 1.5B); lower --micro-batch-tokens if activations do not fit. Measured steps alternate
between the two so clock drift hits both alike; the median step is reported. Weight sync: CUDA IPC into
a `tandem serve-engine` process on the same GPU (gloo on CPU), median of a few pushes.
MFU = (6 N T + 6 L d sum(len^2)) / time / peak, N = all parameters (lm_head included), T = tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import json
import math
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
from benchmarks.engine.model_shapes import QWEN25_15B, TINY  # noqa: E402
from tandemrl.config.loader import load_config  # noqa: E402
from tandemrl.trainer.batching import TrainSample, plan_rank_micro_batches, split_minibatches  # noqa: E402

PEAK_BF16_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU: a smoke check, not figures")
    p.add_argument("--num-samples", type=int, default=None, help="trajectories per step (default 64; tiny 8)")
    p.add_argument("--min-len", type=int, default=None)
    p.add_argument("--max-len", type=int, default=None)
    p.add_argument("--micro-batch-tokens", type=int, default=None)
    p.add_argument("--n-minibatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="measured steps per loop (after one warm-up)")
    p.add_argument("--sync-repeats", type=int, default=3)
    p.add_argument("--no-sync", action="store_true", help="skip the weight-sync measurement")
    p.add_argument(
        "--out", default=str(Path(__file__).resolve().parents[1] / "results" / "actor" / "trainer.json")
    )
    args = p.parse_args()
    defaults = (8, 16, 64, 128) if args.tiny else (64, 512, 2048, 8192)
    for name, value in zip(
        ("num_samples", "min_len", "max_len", "micro_batch_tokens"), defaults, strict=True
    ):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def make_samples(num: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[TrainSample]:
    """Random trajectories: a quarter prompt (mask 0), the rest model tokens whose rollout logprobs sit
    near a random-weight model's (about -log(vocab)), so PPO ratios stay near 1 as in real training."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n = rng.randint(min_len, max_len)
        mask = [0] * (n // 4) + [1] * (n - n // 4)
        out.append(
            TrainSample(
                [rng.randrange(vocab) for _ in range(n)],
                mask,
                [(-math.log(vocab) + rng.uniform(-0.3, 0.3)) * m for m in mask],
                rng.uniform(-1, 1),
            )
        )
    return out


def build_model(shape: dict, seed: int):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(
        Qwen2Config(**shape), dtype=torch.float32, attn_implementation="sdpa"
    )


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HFBaseline:
    """The plain loop: autocast bf16 on GPU, HF's own `labels=` loss, AdamW, clip; same micro-batches."""

    def __init__(self, model, device: torch.device, lr: float):
        self.model = model.to(device).train()
        self.device = device
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def step(self, samples: list[TrainSample], n_minibatches: int, budget: int, padded: bool) -> None:
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda")
        for minibatch in split_minibatches(samples, n_minibatches):
            for micro in plan_rank_micro_batches(minibatch, 0, 1, budget, padded=padded):
                micro = micro.to(self.device)
                labels = micro.input_ids_RL.clone()  # HF shifts labels itself
                if micro.attention_mask_RL is not None:  # masked_fill: no host sync (a bool index would)
                    labels.masked_fill_(micro.attention_mask_RL == 0, -100)
                with autocast:
                    loss = self.model(
                        input_ids=micro.input_ids_RL,
                        position_ids=micro.position_ids_RL,
                        attention_mask=micro.attention_mask_RL,
                        labels=labels,
                        use_cache=False,
                    ).loss
                loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def processed_tokens(samples: list[TrainSample], args, padded: bool) -> int:
    """Tokens the forwards see, padding included (tokens_per_step excludes padding)."""
    return sum(
        m.num_tokens
        for mb in split_minibatches(samples, args.n_minibatches)
        for m in plan_rank_micro_batches(mb, 0, 1, args.micro_batch_tokens, padded=padded)
    )


def model_flops(num_params: int, shape: dict, samples: list[TrainSample]) -> float:
    tokens = sum(s.num_tokens for s in samples)
    attention = 6 * shape["num_hidden_layers"] * shape["hidden_size"] * sum(s.num_tokens**2 for s in samples)
    return 6 * num_params * tokens + attention


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def time_steps(actor, baseline: HFBaseline, samples, args, device) -> tuple[list[float], list[float]]:
    """One warm-up each, then alternate measured steps: actor, baseline, actor, ..."""
    actor_s, hf_s = [], []
    for i in range(args.steps + 1):
        for fn, sink in (
            (lambda: actor.train_step(samples), actor_s),
            (
                lambda: baseline.step(samples, args.n_minibatches, args.micro_batch_tokens, actor.is_padded),
                hf_s,
            ),
        ):
            sync_device(device)
            start = time.perf_counter()
            fn()
            sync_device(device)
            if i > 0:
                sink.append(time.perf_counter() - start)
    return actor_s, hf_s


def write_engine_dir(model, out_dir: Path, dtype: torch.dtype) -> Path:
    """The random model as an HF directory for the engine, with a minimal word-level tokenizer (the
    engine needs one for stop strings; nothing here decodes text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(254)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(
        out_dir
    )
    return out_dir


async def measure_sync(actor, engine_url: str, backend: str, bucket_mb: int, repeats: int) -> list[dict]:
    from tandemrl.rollout.client import EngineClient
    from tandemrl.rollout.weight_sync import WeightSender

    client = EngineClient(engine_url)
    try:
        sender = WeightSender([client], backend=backend, bucket_mb=bucket_mb)
        await sender.connect()
        results = []
        for _ in range(repeats):
            results.append(await actor.sync_weights(sender))
        version = await client.get_weight_version()
        assert str(version) == str(actor.weight_version), (version, actor.weight_version)
        return results
    finally:
        await client.close()


def run_sync(actor, engine_model, args, device: torch.device) -> dict:
    from tandemrl.config.engine import EngineOptions
    from tandemrl.rollout.engine_process import EngineProcess

    backend = "cuda_ipc" if device.type == "cuda" else "gloo"
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    with tempfile.TemporaryDirectory(prefix="tandem-bench-model-") as tmp:
        model_dir = write_engine_dir(engine_model, Path(tmp), getattr(torch, dtype))
        engine = EngineProcess(
            model_dir,
            device=device.type,
            dtype=dtype,
            max_context_len=4096,
            options=EngineOptions(kv_cache_gb=2.0 if device.type == "cuda" else None),
        )
        with engine:
            results = asyncio.run(measure_sync(actor, engine.url, backend, 256, args.sync_repeats))
    times = [r["time/sync_weights"] for r in results]
    return {
        "weight_sync_backend": backend,
        "weight_sync_s": statistics.median(times),
        "weight_sync_first_s": times[0],
        "weight_sync_all_s": times,
        "weight_sync_bytes": results[0]["sync_weights/bytes"],
    }


def throughput(args, device: torch.device, shape: dict, actor) -> dict:
    """Actor vs HF loop on the same samples; tokens/s and MFU of each."""
    baseline = HFBaseline(
        build_model(shape, seed=0), device, lr=1e-6
    )  # same seed: the actor's initial weights
    samples = make_samples(args.num_samples, args.min_len, args.max_len, shape["vocab_size"], seed=0)
    tokens = sum(s.num_tokens for s in samples)
    actor_s, hf_s = time_steps(actor, baseline, samples, args, device)
    del baseline
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    peak, flops = peak_flops(device), model_flops(args.num_params, shape, samples)
    actor_tps, hf_tps = tokens / statistics.median(actor_s), tokens / statistics.median(hf_s)
    return {
        "num_samples": len(samples),
        "tokens_per_step": tokens,
        "processed_tokens_per_step": processed_tokens(samples, args, actor.is_padded),
        "train_step_s": actor_s,
        "hf_baseline_step_s": hf_s,
        "train_tokens_per_s": actor_tps,
        "hf_baseline_tokens_per_s": hf_tps,
        "ratio_vs_hf": actor_tps / hf_tps,
        "mfu": flops / statistics.median(actor_s) / peak if peak else None,
        "hf_baseline_mfu": flops / statistics.median(hf_s) / peak if peak else None,
        "num_skipped_updates": actor.num_skipped_updates,
    }


def main() -> int:
    args = parse_args()
    from tandemrl.config.derive import actor_setup
    from tandemrl.trainer.actor import Actor
    from tandemrl.trainer.policy import is_sharded

    use_cuda = not args.tiny and torch.cuda.is_available()
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    shape = TINY if args.tiny else QWEN25_15B
    model = build_model(shape, seed=0)
    args.num_params = sum(p.numel() for p in model.parameters())
    engine_model = None if args.no_sync else copy.deepcopy(model)
    overrides = [
        f"actor.device={device.type}",
        "actor.optim.lr=0.000001",
        "runner.output_dir=/tmp/tandem-bench",
        f"algorithm.n_minibatches={args.n_minibatches}",
        f"actor.micro_batch_tokens={args.micro_batch_tokens}",
    ]
    actor = Actor(actor_setup(load_config(None, overrides)), hf_model=model)
    result = {
        "gpu": torch.cuda.get_device_name(device) if use_cuda else f"cpu ({platform.processor()})",
        "command": " ".join([sys.executable, *sys.argv]),
        "tiny": args.tiny,
        "model": "tiny qwen2 (random)" if args.tiny else "Qwen2.5-1.5B-shaped (random weights)",
        "num_params": args.num_params,
        "micro_batch_tokens": args.micro_batch_tokens,
        "n_minibatches": args.n_minibatches,
        "actor_dtype": str(actor.compute_dtype),
        "actor_fsdp": is_sharded(actor.policy),  # one rank: plain module under autocast, fused AdamW
        "attn_implementation": actor.hf_model.config._attn_implementation,
        "layout": "padded rows" if actor.is_padded else "packed row",
        "torch": torch.__version__,
        **throughput(args, device, shape, actor),
        "weight_sync_s": None,
    }
    if engine_model is not None:
        result.update(run_sync(actor, engine_model, args, device))
    print(json.dumps(result, indent=2))
    write_json(args.out, result)
    print(
        f"train {result['train_tokens_per_s']:.0f} tok/s vs HF {result['hf_baseline_tokens_per_s']:.0f} tok/s "
        f"({result['ratio_vs_hf']:.2f}x), MFU {result['mfu']}, weight sync {result['weight_sync_s']} s -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
