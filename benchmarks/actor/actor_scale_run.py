"""One run of benchmarks/actor/actor_scale.py, in a process of its own: one Qwen2.5 size (or `tiny`) built
with random weights on the device, the actor over it, one warm-up `Actor.train_step` and the timed steps;
its record (trained, memory peaks, step time, tokens/s, MFU) written as JSON where the spec says.

    python -m benchmarks.actor.actor_scale_run SPEC_JSON   # the parent starts it; by hand for one run

The model is built without a host copy: parameters on the meta device (trainer/loading.py `build_on_meta`,
whose buffers, the rotary inverse frequencies, stay real on the host), `to_empty` on the device, the
buffers put back and the tied head re-tied (`to_empty` gives every tensor fresh storage), the weights drawn
there: normal(0, 0.02), norms 1, biases 0. Any error is a run that did not train (`oom` when it was
`torch.OutOfMemoryError`, `stage` where it hit); the record is written either way.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from benchmarks.actor.trainer_smollm2 import make_rl_samples  # noqa: E402
from benchmarks.engine.model_shapes import QWEN25_3B, QWEN25_7B, QWEN25_15B, TINY  # noqa: E402
from tandemrl.config.loader import load_config  # noqa: E402

SHAPES = {"tiny": TINY, "qwen2.5-1.5b": QWEN25_15B, "qwen2.5-3b": QWEN25_3B, "qwen2.5-7b": QWEN25_7B}
INIT_STD = 0.02
GIB = 2**30
FLOPS = {
    "mfu": "6 x (non-embedding parameters x tokens + lm_head parameters x loss tokens) per step: forward and "
    "backward of the matmuls (the head runs on loss positions only); no attention-score term (<1% at 512 "
    "tokens), no recompute",
    "hfu": "mfu's FLOPs plus the forwards recomputed in backward (2 x their parameters x tokens): the logit "
    "chunks' always, the decoder layers' under activation checkpointing (the run's gradient_checkpointing)",
}


def build_model(
    shape: dict, device: torch.device, attn_implementation: str, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """The Qwen2 model of `shape`, its weights in `dtype` (the actor's param_dtype: no fp32 copy first) drawn
    on `device` (never whole on the host)."""
    from transformers import Qwen2Config

    from tandemrl.trainer.loading import build_on_meta, to_empty_keeping_buffers

    model = build_on_meta(Qwen2Config(**shape), attn_implementation, dtype)
    to_empty_keeping_buffers(model, device)
    model.tie_weights()  # to_empty gives each module's parameters fresh storage of their own
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, INIT_STD)
            elif name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.zero_()
    assert not any(t.is_meta for t in model.state_dict().values()), "a tensor left on meta"
    return model


def param_counts(model: torch.nn.Module) -> dict[str, int]:
    """Unique parameters; those the matmuls use (all but the input embedding, tied or not); the head's."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    is_tied = head is embedding
    body = total - embedding.numel() - (0 if is_tied else head.numel())
    return {"num_params": total, "num_body_params": body, "num_head_params": head.numel()}


def flops_per_step(
    counts: dict[str, int], tokens: int, loss_tokens: int, is_checkpointed: bool
) -> tuple[int, int]:
    """(model FLOPs, hardware FLOPs: with the forwards recomputed in backward) of one step; see FLOPS."""
    body, head = 2 * counts["num_body_params"] * tokens, 2 * counts["num_head_params"] * loss_tokens
    return 3 * (body + head), 3 * (body + head) + head + (body if is_checkpointed else 0)


def build_actor(spec: dict, device: torch.device, record: dict):
    from tandemrl.config.derive import actor_setup
    from tandemrl.trainer.actor import Actor
    from tandemrl.trainer.memory_estimate import BYTES_PER_PARAM
    from tandemrl.trainer.optim import DTYPES
    from tandemrl.trainer.policy import resolve_attn_implementation, resolve_compute_dtype

    setup = actor_setup(load_config(None, spec["overrides"]))
    param_dtype, state_dtype = setup.actor.param_dtype, setup.actor.optim.state_dtype
    compute_dtype = resolve_compute_dtype(setup.actor.dtype, device, param_dtype)
    # one rank keeps the model it is given: it must be built with the attention the actor would pick
    attn = resolve_attn_implementation(setup.actor.attn_implementation, device, compute_dtype)
    torch.manual_seed(0)
    start = time.perf_counter()
    model = build_model(SHAPES[spec["size"]], device, attn, DTYPES[param_dtype])
    counts = param_counts(model)
    actor = Actor(setup, hf_model=model)
    del model
    _sync(device)
    record.update(
        counts,
        # weights, gradients (param_dtype) and AdamW's two moments (state_dtype)
        state_gib=BYTES_PER_PARAM[(param_dtype, state_dtype)] * counts["num_params"] / GIB,
        param_dtype=param_dtype,
        state_dtype=state_dtype,
        build_s=time.perf_counter() - start,
        attn_implementation=attn,
        micro_batch_tokens=actor.micro_batch_tokens,
        n_minibatches=setup.algorithm.n_minibatches,
        gradient_checkpointing=setup.actor.gradient_checkpointing,
    )
    _progress(
        record, f"built in {record['build_s']:.1f} s ({attn}, micro-batches of {actor.micro_batch_tokens})"
    )
    return actor, counts


def time_steps(actor, spec: dict, device: torch.device, counts: dict, record: dict) -> None:
    vocab = SHAPES[spec["size"]]["vocab_size"]
    samples = make_rl_samples(spec["trajectories"], spec["tokens"], spec["tokens"], vocab, seed=0)
    tokens = sum(s.num_tokens for s in samples)
    loss_tokens = sum(s.num_loss_tokens for s in samples)
    record.update(stage="warm-up", tokens_per_step=tokens, loss_tokens_per_step=loss_tokens)
    start = time.perf_counter()
    actor.train_step(samples)
    _sync(device)
    record.update(warmup_s=time.perf_counter() - start, stage="step")
    _progress(record, f"warm-up step {record['warmup_s']:.1f} s")
    steps = []
    for _ in range(spec["steps"]):
        start = time.perf_counter()
        actor.train_step(samples)
        _sync(device)
        steps.append(time.perf_counter() - start)
    step_s = statistics.median(steps)
    model_flops, hardware_flops = flops_per_step(
        counts, tokens, loss_tokens, record["gradient_checkpointing"]
    )
    peak = spec["peak_tflops"] * 1e12
    record.update(
        trained=True,
        step_s=step_s,
        step_s_all=steps,
        tokens_per_s=tokens / step_s,
        mfu=model_flops / step_s / peak,
        hfu=hardware_flops / step_s / peak,
        num_skipped_updates=actor.num_skipped_updates,
    )
    del record["stage"]


def train_one(spec: dict) -> dict:
    """One size, offload option and mode, in this (fresh) process: the record of the run."""
    device = torch.device("cuda", 0) if spec["device"] == "cuda" else torch.device("cpu")
    record = {key: spec[key] for key in ("size", "offload", "mode", "command")}
    record.update(trained=False, stage="build", **_gpu_before(device))
    actor = None
    try:
        actor, counts = build_actor(spec, device, record)
        if device.type == "cuda":  # the peak of training, not of the build (offload moves the model out)
            record["build_peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / GIB
            torch.cuda.reset_peak_memory_stats(device)
        time_steps(actor, spec, device, counts, record)
    except torch.OutOfMemoryError as exc:
        record.update(oom=True, error=_first_line(exc))
    except Exception as exc:  # any failure is a run that did not train; the traceback goes to the log
        traceback.print_exc()
        record.update(oom=False, error=f"{type(exc).__name__}: {_first_line(exc)}")
    del actor  # the failed step's tensors went with the exception; the cache is emptied below
    gc.collect()
    record.update(_memory_after(device))
    return record


def summary_line(record: dict) -> str:
    where = f"{record['size']} {record['mode']} offload={'on' if record['offload'] else 'off'}"
    if not record["trained"]:
        return f"{where}: not trained ({record.get('stage', '?')}): {record.get('error')}"
    peak = record.get("peak_gpu_gib")
    memory = f", peak {peak:.1f} GiB (reserved {record['peak_reserved_gib']:.1f})" if peak is not None else ""
    return (
        f"{where}: step {record['step_s']:.2f} s, {record['tokens_per_s']:.0f} tokens/s, "
        f"MFU {record['mfu']:.3f} (HFU {record['hfu']:.3f}){memory}"
    )


def _gpu_before(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"gpu": f"cpu ({platform.processor() or platform.machine()})"}
    free, total = torch.cuda.mem_get_info(device)
    return {
        "gpu": torch.cuda.get_device_name(device),
        "gpu_total_gib": total / GIB,
        "gpu_used_before_gib": (total - free) / GIB,  # this process's context, and the engine's memory
    }


def _memory_after(device: torch.device) -> dict:
    import resource

    # the kernel's high-water mark of this process (it starts at the parent's size when forked)
    host = {"peak_host_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}
    if device.type != "cuda":
        return {"peak_gpu_gib": None, "peak_reserved_gib": None, **host}
    torch.cuda.empty_cache()
    return {
        "peak_gpu_gib": torch.cuda.max_memory_allocated(device) / GIB,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
        "alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries", 0),
        **host,
    }


def _progress(record: dict, text: str) -> None:
    """Where a long run is, on stderr (the parent prints each run's result line)."""
    where = f"{record['size']} {record['mode']} offload={'on' if record['offload'] else 'off'}"
    print(f"[{time.strftime('%T')}] {where}: {text}", file=sys.stderr, flush=True)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:400]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    spec = json.loads((argv if argv is not None else sys.argv[1:])[0])
    Path(spec["result_path"]).write_text(json.dumps(train_one(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
