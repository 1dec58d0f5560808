"""Rotary position embedding computed exactly as the installed transformers computes it.

The inverse frequencies come from transformers' own RoPE init functions (`rope_parameters` in
transformers 5, `rope_scaling`/`rope_theta` in 4.x), so scaled variants (linear, llama3, yarn) match
the HF model bit for bit. Types whose frequencies depend on the sequence length (dynamic NTK, longrope)
are refused: the paged cache stores rotated keys, which would go stale when the length changes.
"""

from __future__ import annotations

import torch

_LENGTH_DEPENDENT_TYPES = ("dynamic", "longrope")


def _rope_params(hf_config) -> dict:
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding:
    def __init__(self, hf_config, head_dim: int):
        params = _rope_params(hf_config)
        rope_type = params.get("rope_type", "default")
        if rope_type in _LENGTH_DEPENDENT_TYPES:
            raise ValueError(
                f"rope_type {rope_type!r} changes with the sequence length and is not supported "
                "by the embedded engine; use rollout.backend=sglang for this model"
            )
        if rope_type == "default":
            base = params["rope_theta"]
            self.inv_freq = 1.0 / (
                base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim)
            )
            self.attention_scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            self.inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
        self.inv_freq = self.inv_freq.float()

    def to_device(self, device: torch.device) -> None:
        self.inv_freq = self.inv_freq.to(device)

    def cos_sin(self, positions_T: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions_T[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos[:, None, :], sin[:, None, :]  # [T, 1, head_dim], broadcast over heads

    @staticmethod
    def apply(q_THD: torch.Tensor, k_THD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return q_THD * cos + _rotate_half(q_THD) * sin, k_THD * cos + _rotate_half(k_THD) * sin
