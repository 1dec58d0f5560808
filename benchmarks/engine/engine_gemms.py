"""Decode GEMMs of the Qwen2.5-1.5B shape: which formulation of `x @ W.T` cuBLAS runs fastest at the
decode batch sizes the engine captures.

    python -m benchmarks.engine.engine_gemms [--rows 256 128] [--out benchmarks/results/engine/engine_gemms.json]

Per projection and batch size: `F.linear` (cuBLAS's default library), `F.linear` with cuBLASLt preferred,
and the transposed product `(W @ x.T).T` (other tile shapes for a narrow output), with the weight
bandwidth each reaches (weights dominate the bytes at these batch sizes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import write_json
from benchmarks.engine.model_shapes import QWEN25_15B


def projections(shape: dict) -> dict[str, tuple[int, int, bool]]:
    """name -> (out features, in features, has bias), as the fast forward runs them (fused QKV, gate/up)."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = hidden // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    return {
        "qkv": (hidden + 2 * kv, hidden, True),
        "o_proj": (hidden, hidden, False),
        "gate_up": (2 * inter, hidden, False),
        "down_proj": (hidden, inter, False),
        "lm_head": (shape["vocab_size"], hidden, False),
    }


def time_formulations(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> dict[str, float]:
    from triton.testing import do_bench  # GPU only: imported here so that `--help` runs anywhere

    def transposed():
        out = torch.mm(weight, x.t()).t().contiguous()
        return out + bias if bias is not None else out

    timings = {"F.linear": do_bench(lambda: F.linear(x, weight, bias), warmup=10, rep=50)}
    previous = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        timings["F.linear[cublaslt]"] = do_bench(lambda: F.linear(x, weight, bias), warmup=10, rep=50)
        torch.backends.cuda.preferred_blas_library("cublas")
        timings["F.linear[cublas]"] = do_bench(lambda: F.linear(x, weight, bias), warmup=10, rep=50)
    finally:
        torch.backends.cuda.preferred_blas_library(previous)
    timings["(W@x.T).T"] = do_bench(transposed, warmup=10, rep=50)
    half = weight.shape[1] // 2
    w1, w2, x1, x2 = weight[:, :half], weight[:, half:], x[:, :half], x[:, half:]

    def two_halves():  # split K by hand: the second GEMM accumulates into the first's output
        return torch.addmm(F.linear(x1, w1, bias), x2, w2.t())

    timings["K in halves"] = do_bench(two_halves, warmup=10, rep=50)
    return timings


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[256, 128, 64])
    p.add_argument(
        "--out", default=str(Path(__file__).resolve().parents[1] / "results" / "engine" / "engine_gemms.json")
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    device = torch.device("cuda")
    report = dict(
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        gpu=torch.cuda.get_device_name(device),
        torch=torch.__version__,
        shapes={},
    )
    for name, (n, k, has_bias) in projections(QWEN25_15B).items():
        weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        bias = torch.randn(n, device=device, dtype=torch.bfloat16) if has_bias else None
        for rows in args.rows:
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            timings = time_formulations(x, weight, bias)
            weight_gb = n * k * 2 / 1e9
            report["shapes"][f"{name}[M={rows}]"] = dict(
                timings_us={key: ms * 1e3 for key, ms in timings.items()},
                tb_per_s={key: weight_gb / ms for key, ms in timings.items()},
            )
            cells = "  ".join(
                f"{key} {ms * 1e3:6.1f} us ({weight_gb / ms:.2f} TB/s)" for key, ms in timings.items()
            )
            print(f"{name:9s} M={rows:3d} N={n:6d} K={k:5d}: {cells}", flush=True)
        del weight, bias
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
