"""RoPE inside Triton kernels, shared by the paged attention (engine/triton_attention.py) and the split-KV
decode (engine/triton_decode.py): a token's cos/sin rows and the rotation of a head given as halves.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rope_tables(Cos, Sin, row, stride, HALF: tl.constexpr):
    """A token's cos and sin rows as fp32 halves: (cos1, cos2, sin1, sin2)."""
    half = tl.arange(0, HALF)
    cos1 = tl.load(Cos + row * stride + half).to(tl.float32)
    cos2 = tl.load(Cos + row * stride + HALF + half).to(tl.float32)
    sin1 = tl.load(Sin + row * stride + half).to(tl.float32)
    sin2 = tl.load(Sin + row * stride + HALF + half).to(tl.float32)
    return cos1, cos2, sin1, sin2


@triton.jit
def _rotate(x1, x2, cos1, cos2, sin1, sin2):
    """RoPE of heads given as fp32 halves `[..., HALF]`: x * cos + rotate_half(x) * sin, half by half."""
    return x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2
