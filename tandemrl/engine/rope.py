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
        self.table: torch.Tensor | None = None  # [positions, 2, head_dim]: cos, sin (see `keep_table`)

    def to_device(self, device: torch.device) -> None:
        self.inv_freq = self.inv_freq.to(device)
        if self.table is not None:
            self.table = self.table.to(device)

    def cos_sin(self, positions_T: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions_T[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos[:, None, :], sin[:, None, :]  # [T, 1, head_dim], broadcast over heads

    def keep_table(self, length: int, dtype: torch.dtype) -> None:
        """Keep cos and sin of positions [0, length) in `dtype`, computed by `cos_sin` itself (so the values
        are the same): `cos_sin_rows` then gathers a step's rows in one kernel where `cos_sin` runs nine."""
        cos, sin = self.cos_sin(torch.arange(length, device=self.inv_freq.device), dtype)
        self.table = torch.stack([cos[:, 0], sin[:, 0]], dim=1)

    def cos_sin_rows(
        self, positions_T: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos_sin` as `[T, head_dim]` rows; with a kept table of `dtype`, two views of one gather (cos and sin
        share a row stride). Positions must lie in the table; -1 (a padded decode row) reads its last row."""
        if self.table is None or self.table.dtype != dtype:
            cos, sin = self.cos_sin(positions_T, dtype)
            return cos[:, 0], sin[:, 0]
        rows = self.table[positions_T]
        return rows[:, 0], rows[:, 1]

    @staticmethod
    def apply(q_THD: torch.Tensor, k_THD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return q_THD * cos + _rotate_half(q_THD) * sin, k_THD * cos + _rotate_half(k_THD) * sin
