"""Decode attention: each candidate kernel's time and effective bandwidth at several context lengths.

    python -m benchmarks.engine.engine_attention [--batch 256] [--contexts 256 384 512]

Batch 256 of Qwen2.5-1.5B's attention shape (12 query heads, 2 KV heads, head_dim 128, bf16), block size 16;
block tables are laid out as the engine allocates them for requests admitted together (each request's
blocks in a run, requests interleaved by admission order), plus one layout of shuffled blocks. Bytes
counted: every context token's K and V once. Three timings per candidate: the attention alone (`attend`,
K/V already stored), and the whole decode attention of a step from the QKV output, once as two kernels
(`rope_store` then `attend`) and once as the step runs it (`rope_attend`: one kernel for RoPE, the K/V
store and the attention, except for split-KV candidates). Each timing replays a CUDA graph of one call per
layer, each layer on its own cache (as in a decode step: no launch gaps, the K/V come from HBM, not L2),
and divides by the layer count. JSON under benchmarks/results/engine/engine_attention.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks import write_json


def graph_us_per_call(fn, caches: list[torch.Tensor], replays: int = 20) -> float:
    """Microseconds per call of `fn(cache)`, from replays of a CUDA graph that calls it once per cache."""
    from tandemrl.engine.kernel_tuning import graph_ms

    return graph_ms(lambda i: fn(caches[i]), len(caches), replays) * 1e3 / len(caches)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 384, 512])
    p.add_argument("--layers", type=int, default=28, help="calls per graph, each on its own cache")
    p.add_argument(
        "--out",
        default=str(Path(__file__).resolve().parents[1] / "results" / "engine" / "engine_attention.json"),
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 1
    from tandemrl.engine.attention_tiles import DECODE_CANDIDATES
    from tandemrl.engine.triton_attention import decode_metadata, rope_store

    device, block_size, heads, kv_heads, dim = torch.device("cuda"), 16, 12, 2, 128
    max_ctx = max(args.contexts)
    width = -(-max_ctx // block_size)
    num_blocks = args.batch * width + 16
    caches = [
        torch.randn(2, num_blocks * block_size, kv_heads, dim, device=device, dtype=torch.bfloat16)
        for _ in range(args.layers)
    ]
    q = torch.randn(args.batch, heads, dim, device=device, dtype=torch.bfloat16)
    qkv = torch.randn(args.batch, (heads + 2 * kv_heads) * dim, device=device, dtype=torch.bfloat16)
    angles = torch.rand(args.batch, dim, device=device) * 6.28
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    layouts = {
        "runs": (torch.arange(args.batch * width, device=device).view(args.batch, width)),
        "shuffled": torch.randperm(args.batch * width, device=device).view(args.batch, width),
    }
    report = dict(
        command=" ".join([Path(sys.executable).name, *sys.argv]), gpu=torch.cuda.get_device_name(), results={}
    )
    per_token = 2 * kv_heads * dim * 2
    for layout, tables in layouts.items():
        for ctx in args.contexts:
            lens = torch.full((args.batch,), ctx, dtype=torch.long, device=device)
            for config in DECODE_CANDIDATES:
                meta = decode_metadata(tables, lens, ctx, block_size, config)  # slots -1: no K/V writes

                def two_kernels(cache, m=meta):
                    return m.attend_stored(
                        rope_store(qkv, cos, sin, cache, m.slot_mapping_T, heads), cache, 0.1
                    )

                runs = {
                    "attend": lambda cache, m=meta: m.attend_stored(q, cache, 0.1),
                    "rope_store+attend": two_kernels,
                    "rope_attend": lambda cache, m=meta: m.rope_attend(qkv, cos, sin, cache, heads, 0.1),
                }
                entry = {}
                for name, fn in runs.items():
                    us = graph_us_per_call(fn, caches)
                    tb_s = args.batch * ctx * per_token / (us / 1e6) / 1e12
                    entry[name] = dict(us=round(us, 2), tb_per_s=round(tb_s, 3))
                report["results"][f"{layout} ctx={ctx} {config}"] = entry
                print(
                    f"{layout:8s} ctx {ctx:4d} "
                    + " ".join(f"{n} {e['us']:7.2f} us ({e['tb_per_s']:4.2f} TB/s)" for n, e in entry.items())
                    + f"  {config}",
                    flush=True,
                )
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
