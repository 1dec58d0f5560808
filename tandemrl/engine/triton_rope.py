"""RoPE inside the Triton attention kernels: a token's cos/sin rows and the rotation, as fp32 halves.

Shared by the fused RoPE + store kernel of `triton_attention` and the fused RoPE + decode kernel of
`triton_decode` (both rotate exactly as `engine/rope.py` does in torch).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rope_tables(Cos, Sin, row, stride, HALF: tl.constexpr):
    """A token's cos and sin rows as fp32 halves: (cos1, cos2, sin1, sin2)."""
    half = tl.arange(0, HALF)
    cos1 = tl.load(Cos + row * stride + half).to(tl.float32)
    cos2 = tl.load(Cos + row * stride + HALF + half).to(tl.float32)
    sin1 = tl.load(Sin + row * stride + half).to(tl.float32)
    sin2 = tl.load(Sin + row * stride + HALF + half).to(tl.float32)
    return cos1, cos2, sin1, sin2


@triton.jit
def rotate(x1, x2, cos1, cos2, sin1, sin2):
    """RoPE of heads given as fp32 halves `[..., HALF]`: x * cos + rotate_half(x) * sin, half by half."""
    return x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2
