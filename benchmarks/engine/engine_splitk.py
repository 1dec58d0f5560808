"""Split-K decode GEMMs: cuBLAS's `F.linear` against one batched GEMM of fp32 partials over slices of K
(`fast_layers.split_k_linear`) whose sum the next add + RMSNorm takes as it reads them.

    python -m benchmarks.engine.engine_splitk [--out benchmarks/results/engine/engine_splitk.json]

Qwen2.5-1.5B shapes at 256 and 128 rows, each variant timed in a CUDA graph of 28 calls with a weight per
call (as a decode step reads 28 layers; none sits in L2). Per projection: the GEMM alone, fp32 and bf16
partials, and for the projections an add + RMSNorm consumes (o_proj, down) the GEMM with that norm, plus
how far its outputs are from `F.linear` + norm. The engine tunes the down projection's split at start-up
(`kernel_tuning.tune_down_split`); this script shows why only down_proj gains.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import write_json
from benchmarks.engine.model_shapes import QWEN25_15B

LAYERS = 28


def graph_us(fn, calls: int, replays: int = 20) -> float:
    """Microseconds per call of `fn(i)`, from replays of a CUDA graph of `calls` calls."""
    from tandemrl.engine.kernel_tuning import graph_ms  # GPU only (Triton): `--help` runs anywhere

    return graph_ms(fn, calls, replays) * 1e3 / calls


def bf16_partials(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    rows, k = x.shape
    return torch.bmm(
        x.view(rows, parts, k // parts).transpose(0, 1),
        weight.view(weight.shape[0], parts, k // parts).permute(1, 2, 0),
    )


def time_shape(rows: int, n: int, k: int, parts_list: list[int], normed: bool, device) -> dict[str, float]:
    """Microseconds per call of each variant of one projection (and, when `normed`, with its norm)."""
    from tandemrl.engine.fast_layers import add_rmsnorm, split_k_linear  # GPU only (Triton)

    ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    xs = [torch.randn(rows, k, device=device, dtype=torch.bfloat16) for _ in range(LAYERS)]
    residual = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
    norm = torch.rand(n, device=device, dtype=torch.bfloat16) + 0.5
    out = {"linear": graph_us(lambda i: F.linear(xs[i], ws[i]), LAYERS)}
    if normed:
        out["linear+norm"] = graph_us(
            lambda i: add_rmsnorm(F.linear(xs[i], ws[i]), residual, norm, 1e-6), LAYERS
        )
    for parts in parts_list:
        out[f"bmm{parts}"] = graph_us(lambda i, p=parts: split_k_linear(xs[i], ws[i], p), LAYERS)
        out[f"bmm{parts}bf16"] = graph_us(lambda i, p=parts: bf16_partials(xs[i], ws[i], p), LAYERS)
        if normed:
            out[f"bmm{parts}+norm"] = graph_us(
                lambda i, p=parts: add_rmsnorm(split_k_linear(xs[i], ws[i], p), residual, norm, 1e-6), LAYERS
            )
            ref, _ = add_rmsnorm(F.linear(xs[0], ws[0]), residual, norm, 1e-6)
            got, _ = add_rmsnorm(split_k_linear(xs[0], ws[0], parts), residual, norm, 1e-6)
            out[f"bmm{parts}_maxdiff"] = (ref.float() - got.float()).abs().max().item()
            out[f"bmm{parts}_mismatch_frac"] = (ref != got).float().mean().item()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--out",
        default=str(Path(__file__).resolve().parents[1] / "results" / "engine" / "engine_splitk.json"),
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    hidden, inter = QWEN25_15B["hidden_size"], QWEN25_15B["intermediate_size"]
    shapes = {
        "o_proj": (hidden, hidden, [2, 3, 4, 6]),
        "down": (hidden, inter, [2, 4, 5, 7, 10, 14]),
        "qkv": (hidden + 512, hidden, [2, 3, 4]),
        "gate_up": (2 * inter, hidden, [2, 3]),
    }
    results = {}
    for rows in (256, 128):
        for name, (n, k, parts_list) in shapes.items():
            results[f"{name}[M={rows}]"] = out = time_shape(rows, n, k, parts_list, n == hidden, device)
            print(name, rows, {key: round(value, 2) for key, value in out.items()}, flush=True)
    report = dict(
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        gpu=torch.cuda.get_device_name(device),
        torch=torch.__version__,
        us_per_call=results,
    )
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
