"""Engine benchmark: output tokens/s of the embedded engine against HF `generate` (static cache) and the
decode roofline, plus a multi-turn workload with and without prefix reuse.

    python -m benchmarks.engine.engine              # H200: Qwen2.5-1.5B-shaped model, random weights, bf16
    python -m benchmarks.engine.engine --tiny       # CPU smoke check of the same code (no figures)

Throughput workload: 256 concurrent requests of 256 random prompt tokens, 256 new tokens each at
temperature 1 (ignore_eos), through `Engine` in-process; tokens/s = output tokens / wall time, prefill
included. The same prompts go through HF `generate(cache_implementation="static")` in the same run.
Roofline: each decode step must read every weight once plus the K/V of every context token; the bytes
of all 256 steps over the device-to-device copy bandwidth (bytes read + written, measured here) give the
fastest possible decode, and roofline_fraction = tokens_per_s / that (prefill time counts against us).
Multi-turn workload: trajectories of 4 turns; after each of the first 3 turns a 300-token information
block is appended and the whole context is resent, as the agent does.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from benchmarks import write_json  # noqa: E402
from benchmarks.engine.model_shapes import QWEN25_15B, TINY  # noqa: E402
from tandemrl.engine.engine import Engine, EngineConfig  # noqa: E402
from tandemrl.engine.kv_cache import kv_bytes_per_token  # noqa: E402
from tandemrl.engine.sequence import SamplingParams  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU: a smoke check, not figures")
    p.add_argument("--num-requests", type=int, default=None, help="default 256 (tiny 8)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 256 (tiny 32)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 256 (tiny 16)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--info-len", type=int, default=300)
    p.add_argument(
        "--turn-trajectories", type=int, default=None, help="multi-turn trajectories (default 128)"
    )
    p.add_argument(
        "--prefill-tokens",
        type=int,
        default=16384,
        help="the engine's max_prefill_tokens (tokens per prefill step)",
    )
    p.add_argument("--no-hf", action="store_true", help="skip the HF generate baseline")
    p.add_argument("--no-multi-turn", action="store_true", help="skip the multi-turn prefix-reuse workload")
    p.add_argument("--profile-host", action="store_true", help="print a cProfile of 20 decode steps")
    p.add_argument(
        "--out", default=str(Path(__file__).resolve().parents[1] / "results" / "engine" / "engine.json")
    )
    args = p.parse_args()
    tiny = args.tiny
    args.num_requests = args.num_requests or (8 if tiny else 256)
    args.prompt_len = args.prompt_len or (32 if tiny else 256)
    args.new_tokens = args.new_tokens or (16 if tiny else 256)
    args.turn_trajectories = args.turn_trajectories or (4 if tiny else 128)
    if tiny:
        args.info_len = min(args.info_len, 24)
    return args


def write_model_dir(shape: dict, out_dir: Path, device: torch.device, dtype: torch.dtype) -> Path:
    """A random model built from `shape`, saved as an HF directory with a minimal word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(Qwen2Config(**shape), dtype=dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(254)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(
        out_dir
    )
    del model
    return out_dir


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device) -> float | None:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written."""
    if device.type != "cuda":
        return None
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 20
    del src, dst
    return 2 * 2 * 2**30 / seconds


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(num)]


def make_engine(
    model_dir: Path, device: torch.device, args, prefix_caching: bool = True, cuda_graphs: bool = True
) -> Engine:
    max_context = args.prompt_len + args.turns * (args.new_tokens + args.info_len) + 16
    return Engine(
        EngineConfig(
            str(model_dir),
            device=str(device),
            dtype="auto",
            max_running_requests=args.num_requests,
            max_context_len=max_context,
            kv_cache_gb=None if device.type == "cuda" else 0.25,
            max_prefill_tokens=args.prefill_tokens,
            enable_prefix_caching=prefix_caching,
            enable_cuda_graphs=cuda_graphs,
            freeze_gc=True,  # as `tandem serve-engine` runs it
        )
    )


def run_batch(engine: Engine, prompts: dict[str, list[int]], new_tokens: int, device) -> dict:
    """Serve `prompts` to completion; returns outputs, wall time and the engine's token counters."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    prefill_before, decode_s = engine.num_prefill_tokens, 0.0
    is_cuda = device.type == "cuda"
    sync(device)
    start = time.perf_counter()
    marks = [torch.cuda.Event(enable_timing=True)] if is_cuda else []  # GPU timeline: start, last prefill
    for mark in marks:
        mark.record()
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    outputs = {}
    while engine.has_work():
        step_start, prefill_seen = time.perf_counter(), engine.num_prefill_tokens
        finished = engine.step()
        if engine.num_prefill_tokens == prefill_seen:  # a decode step
            decode_s += time.perf_counter() - step_start
        elif is_cuda:  # enqueued after this prefill's launch: marks the end of the prefill phase
            marks[1:] = [torch.cuda.Event(enable_timing=True)]
            marks[1].record()
        for seq in finished:
            outputs[seq.rid] = seq.output_ids
    sync(device)
    wall_s = time.perf_counter() - start
    phases = {}
    if len(marks) == 2:  # GPU-side split of the wall time (bubbles included)
        phases = dict(prefill_phase_s=marks[0].elapsed_time(marks[1]) / 1e3)
        phases["decode_phase_s"] = wall_s - phases["prefill_phase_s"]
    return dict(
        outputs=outputs,
        wall_s=wall_s,
        decode_s=decode_s,
        output_tokens=sum(len(o) for o in outputs.values()),
        prefill_tokens=engine.num_prefill_tokens - prefill_before,
        **phases,
    )


def throughput(engine: Engine, args, vocab: int, device) -> dict:
    run_batch(
        engine, {f"w{i}": p for i, p in enumerate(random_prompts(args.num_requests, 64, vocab, 1))}, 8, device
    )  # warm-up: Triton compiles, allocator settles
    prompts = random_prompts(args.num_requests, args.prompt_len, vocab, 2)
    steps_before = engine.num_steps
    # Time the host spends waiting for the GPU's results: near 0 means the host, not the GPU, sets the pace.
    waits, postprocess = [0.0], engine._postprocess

    def timed_postprocess(launched):
        start = time.perf_counter()
        launched.result.get()
        waits[0] += time.perf_counter() - start
        return postprocess(launched)

    engine._postprocess = timed_postprocess
    # Garbage collections during the run: each one stalls the host, and the GPU once its queue runs dry.
    collections, started = [], {}

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            collections.append((info["generation"], time.perf_counter() - started.pop("t")))

    gc.callbacks.append(on_gc)
    try:
        result = run_batch(engine, {f"r{i}": p for i, p in enumerate(prompts)}, args.new_tokens, device)
    finally:
        del engine._postprocess
        gc.callbacks.remove(on_gc)
    result["host_wait_s"] = waits[0]
    result["gc_collections"] = [dict(generation=g, ms=round(s * 1e3, 3)) for g, s in collections]
    assert result["output_tokens"] == args.num_requests * args.new_tokens, "every request must run to length"
    result["num_steps"] = engine.num_steps - steps_before
    result["tokens_per_s"] = result["output_tokens"] / result["wall_s"]
    result["prompts"] = prompts
    return result


def profile_host(engine: Engine, args, vocab: int) -> None:
    """cProfile of 20 full-batch decode steps: where the host time of a step goes (sync wait included)."""
    import cProfile
    import pstats

    params = SamplingParams(max_new_tokens=40, temperature=1.0, ignore_eos=True)
    for i, ids in enumerate(random_prompts(args.num_requests, args.prompt_len, vocab, 9)):
        engine.add_request(f"p{i}", ids, params)
    for _ in range(10):
        engine.step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        engine.step()
    profiler.disable()
    while engine.has_work():
        engine.step()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def decode_breakdown(engine: Engine, args) -> dict:
    """GPU time of one replay of the largest decode graph (forward + sampling; inputs as the throughput run
    left them, i.e. full contexts) and of the sampler alone on its logits."""
    graphs = getattr(engine.runner, "graphs", None)
    if graphs is None:
        return {}
    from tandemrl.engine.gpu_sampler import fused_sample

    size = max(graphs.sizes)
    temps, seed = (
        torch.ones(size, device=engine.device),
        torch.zeros(1, dtype=torch.long, device=engine.device),
    )
    timings = {}
    for name, fn in (
        ("graph_replay_ms", graphs.graphs[size].replay),
        ("sampling_ms", lambda: fused_sample(graphs.logits[size], temps, seed)),
    ):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        end.synchronize()
        timings[name] = start.elapsed_time(end) / 10
    timings["batch"] = size
    timings["kernels_us"] = kernel_profile(graphs.graphs[size].replay)
    timings["down_split_parts"] = engine.runner.down_splits
    timings["down_split_tuning_ms"] = engine.runner.down_split_timings
    timings["decode_attention_config"] = str(engine.runner.decode_config)
    timings["decode_attention_tuning_ms"] = engine.runner.decode_timings
    timings["prefill_attention_config"] = str(engine.runner.prefill_config)
    timings["prefill_attention_tuning_ms"] = engine.runner.prefill_timings
    return timings


def prefill_breakdown(engine: Engine, args, vocab: int) -> dict:
    """Kernels of one full prefill step (max_prefill_tokens of fresh prompts), by torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_new_tokens=1, temperature=1.0, ignore_eos=True)
    num = min(args.num_requests, engine.config.max_prefill_tokens // args.prompt_len)
    for i, ids in enumerate(random_prompts(num, args.prompt_len, vocab, 11)):
        engine.add_request(f"pf{i}", ids, params)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        while engine.has_work():
            engine.step()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    return dict(
        tokens=num * args.prompt_len,
        gpu_ms=sum(e.device_time_total for e in events) / 1e3,
        kernels_us={e.key[:90]: e.device_time_total for e in events[:12]},
    )


def gpu_timeline(engine: Engine, args, vocab: int, device) -> dict:
    """The throughput workload once more (fresh prompts) under torch.profiler: how much of the run's GPU
    span has a kernel or copy running, and the largest idle gaps with the work on either side."""
    from torch.profiler import ProfilerActivity, profile

    prompts = random_prompts(args.num_requests, args.prompt_len, vocab, 5)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = run_batch(engine, {f"g{i}": p for i, p in enumerate(prompts)}, args.new_tokens, device)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    work = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"][:60])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    busy, gaps, end = 0.0, [], work[0][0]
    previous = ""
    for start, stop, name in work:
        if start > end:
            gaps.append((start - end, previous, name))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, previous = stop, name
    span = end - work[0][0]
    gaps.sort(reverse=True)
    by_kernel: dict[str, float] = {}
    for start, stop, name in work:
        by_kernel[name] = by_kernel.get(name, 0.0) + (stop - start) / 1e3
    top = sorted(by_kernel.items(), key=lambda item: -item[1])[:14]
    return dict(
        wall_s=result["wall_s"],
        gpu_span_s=span / 1e6,
        gpu_busy_s=busy / 1e6,
        idle_s=(span - busy) / 1e6,
        idle_in_gaps_over_20us_s=sum(g for g, _, _ in gaps if g > 20) / 1e6,
        num_gaps_over_20us=sum(1 for g, _, _ in gaps if g > 20),
        largest_gaps_us=[dict(us=round(g, 1), after=a, before=b) for g, a, b in gaps[:8]],
        kernels_total_ms={name: round(ms, 2) for name, ms in top},
    )


def kernel_profile(fn, repeats: int = 5, top: int = 12) -> dict[str, float]:
    """GPU time per call of the `top` costliest kernels of `fn` (microseconds), by torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    return {e.key[:90]: e.device_time_total / repeats for e in events[:top]}


def hf_static(model_dir: Path, prompts: list[list[int]], new_tokens: int, device, dtype) -> dict:
    from transformers import AutoModelForCausalLM

    from tandemrl.host.hf import hf_load_kwargs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **hf_load_kwargs()).to(device).eval()
    model.generation_config.eos_token_id = None  # run every request to length, as ignore_eos does
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        cache_implementation="static",
        pad_token_id=0,
        attention_mask=torch.ones_like(ids),
    )
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, **kwargs)  # warm-up
        sync(device)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        sync(device)
    wall_s = time.perf_counter() - start
    num_out = (out.shape[1] - ids.shape[1]) * out.shape[0]
    del model, out
    gc.collect()
    return dict(wall_s=wall_s, output_tokens=num_out, tokens_per_s=num_out / wall_s)


def roofline(engine: Engine, args, bandwidth: float | None) -> dict:
    """Bytes every decode step must move (weights once + K/V of every context token) over the bandwidth."""
    weight_bytes = sum(
        {p.data_ptr(): p.numel() * p.element_size() for p in engine.model.parameters()}.values()
    )
    per_token_kv = kv_bytes_per_token(engine.model.cfg, engine.dtype)
    total_bytes = 0
    for step in range(args.new_tokens):  # step s reads the prompt and s generated tokens, writes one
        context = args.prompt_len + step + 1
        total_bytes += weight_bytes + args.num_requests * context * per_token_kv
    out = dict(
        weight_bytes=weight_bytes,
        kv_bytes_per_token=per_token_kv,
        bytes_per_step_mean=total_bytes / args.new_tokens,
    )
    if bandwidth:
        out["roofline_tokens_per_s"] = args.num_requests * args.new_tokens / (total_bytes / bandwidth)
    return out


def multi_turn(engine: Engine, args, vocab: int, device) -> dict:
    """4 turns per trajectory; an information block is appended after each turn but the last."""
    rng = random.Random(3)
    contexts = {
        f"t{i}": p for i, p in enumerate(random_prompts(args.turn_trajectories, args.prompt_len, vocab, 4))
    }
    prefill, wall_s = 0, 0.0
    for turn in range(args.turns):
        result = run_batch(
            engine, {f"{rid}-{turn}": ids for rid, ids in contexts.items()}, args.new_tokens, device
        )
        prefill += result["prefill_tokens"]
        wall_s += result["wall_s"]
        if turn < args.turns - 1:
            for rid in contexts:
                info = [rng.randrange(2, vocab) for _ in range(args.info_len)]
                contexts[rid] = contexts[rid] + result["outputs"][f"{rid}-{turn}"] + info
    return dict(prefill_tokens=prefill, wall_s=wall_s)


def compare_prefix_reuse(engine: Engine, model_dir: Path, args, vocab: int, device) -> dict:
    """The multi-turn workload on `engine` (prefix reuse on), then on a fresh engine with it off."""
    with_reuse = multi_turn(engine, args, vocab, device)
    release(engine)
    plain_engine = make_engine(model_dir, device, args, prefix_caching=False)
    without = multi_turn(plain_engine, args, vocab, device)
    release(plain_engine)
    return dict(
        multi_turn=dict(
            trajectories=args.turn_trajectories,
            turns=args.turns,
            info_len=args.info_len,
            with_reuse=with_reuse,
            without_reuse=without,
        ),
        prefix_reuse_prefill_cut=1 - with_reuse["prefill_tokens"] / without["prefill_tokens"],
        prefix_reuse_wall_cut=1 - with_reuse["wall_s"] / without["wall_s"],
    )


def release(engine: Engine) -> None:
    del engine.runner, engine.model
    gc.unfreeze()  # the engine froze the heap (`freeze_gc`): give its objects back to the collector
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> int:
    args = parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    shape = TINY if args.tiny else QWEN25_15B
    report: dict = dict(
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        host=platform.node(),
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        torch=torch.__version__,
        workload=dict(
            num_requests=args.num_requests,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            temperature=1.0,
            max_prefill_tokens=args.prefill_tokens,
        ),
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(shape, Path(tmp) / "model", device, dtype)
        report["copy_bandwidth_bytes_per_s"] = bandwidth = copy_bandwidth(device)
        engine = make_engine(model_dir, device, args)
        tp = throughput(engine, args, shape["vocab_size"], device)
        report.update(roofline(engine, args, bandwidth))
        report["decode_breakdown"] = decode_breakdown(engine, args) if device.type == "cuda" else {}
        if device.type == "cuda":
            report["prefill_breakdown"] = prefill_breakdown(engine, args, shape["vocab_size"])
            report["gpu_timeline"] = gpu_timeline(engine, args, shape["vocab_size"], device)
        if args.profile_host:
            profile_host(engine, args, shape["vocab_size"])
        report.update(
            tokens_per_s=tp["tokens_per_s"],
            engine_wall_s=tp["wall_s"],
            engine_steps=tp["num_steps"],
            engine_decode_s=tp["decode_s"],
            engine_prefill_tokens=tp["prefill_tokens"],
            host_wait_s=tp["host_wait_s"],
            gc_collections_in_run=tp["gc_collections"],
            prefill_phase_s=tp.get("prefill_phase_s"),
            decode_phase_s=tp.get("decode_phase_s"),
            decode_tokens_per_s=args.num_requests * (args.new_tokens - 1) / tp["decode_s"],
        )
        if args.no_multi_turn:
            release(engine)
        else:
            report.update(compare_prefix_reuse(engine, model_dir, args, shape["vocab_size"], device))
        print(
            f"engine {report['tokens_per_s']:.0f} tokens/s; multi-turn {report.get('multi_turn')}", flush=True
        )
        if not args.no_hf:
            hf = hf_static(model_dir, tp["prompts"], args.new_tokens, device, dtype)
            report.update(
                hf_static_tokens_per_s=hf["tokens_per_s"],
                hf_static_wall_s=hf["wall_s"],
                ratio_to_hf=tp["tokens_per_s"] / hf["tokens_per_s"],
            )
    if "roofline_tokens_per_s" in report:
        report["roofline_fraction"] = report["tokens_per_s"] / report["roofline_tokens_per_s"]
        report["decode_roofline_fraction"] = report["decode_tokens_per_s"] / report["roofline_tokens_per_s"]
    print_report(report)
    if not args.tiny:
        write_json(args.out, report)
    return 0


def print_report(r: dict) -> None:
    print(json.dumps(r, indent=2))
    print(
        f"engine: {r['tokens_per_s']:.0f} output tokens/s ({r['engine_wall_s']:.2f} s, {r['engine_steps']} steps; "
        f"decode steps alone {r['decode_tokens_per_s']:.0f} tokens/s; the host waited {r['host_wait_s']:.2f} s "
        "for the GPU)"
    )
    if "hf_static_tokens_per_s" in r:
        print(
            f"HF static generate: {r['hf_static_tokens_per_s']:.0f} tokens/s -> ratio {r['ratio_to_hf']:.2f}x"
        )
    if r.get("decode_breakdown"):
        b = r["decode_breakdown"]
        step_ms = 1e3 * r["engine_decode_s"] / max(1, r["workload"]["new_tokens"] - 1)
        print(
            f"decode step {step_ms:.2f} ms: graph replay {b['graph_replay_ms']:.2f} ms (sampling included: "
            f"{b['sampling_ms']:.2f} ms; batch {b['batch']}, full contexts)"
        )
        print(f"decode attention {b['decode_attention_config']}; tuning {b['decode_attention_tuning_ms']}")
        for name, us in b["kernels_us"].items():
            print(f"  {us:9.1f} us/replay  {name}")
    if r.get("prefill_breakdown"):
        b = r["prefill_breakdown"]
        print(
            f"prefill: {b['tokens']} tokens in {b['gpu_ms']:.1f} ms of kernels; phases of the run: prefill "
            f"{r['prefill_phase_s']:.3f} s, decode {r['decode_phase_s']:.3f} s"
        )
        for name, us in b["kernels_us"].items():
            print(f"  {us:9.1f} us  {name}")
    if r.get("gpu_timeline"):
        t = r["gpu_timeline"]
        print(
            f"GPU timeline (profiled re-run, {t['wall_s']:.3f} s): busy {t['gpu_busy_s']:.3f} s of a "
            f"{t['gpu_span_s']:.3f} s span; {t['num_gaps_over_20us']} gaps over 20 us hold "
            f"{t['idle_in_gaps_over_20us_s']:.3f} s; largest {t['largest_gaps_us'][:3]}"
        )
    if "roofline_tokens_per_s" in r:
        print(
            f"decode roofline: {r['roofline_tokens_per_s']:.0f} tokens/s at "
            f"{r['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s -> fraction {r['roofline_fraction']:.3f}"
        )
    mt = r.get("multi_turn")
    if mt:
        print(
            f"multi-turn prefill tokens: {mt['with_reuse']['prefill_tokens']} with reuse vs "
            f"{mt['without_reuse']['prefill_tokens']} without (cut {r['prefix_reuse_prefill_cut']:.1%}); wall "
            f"{mt['with_reuse']['wall_s']:.2f} s vs {mt['without_reuse']['wall_s']:.2f} s"
        )


if __name__ == "__main__":
    sys.exit(main())
