"""Tiny random HF causal LMs (2 layers, hidden 64) built from a config, saved with SmolLM2's tokenizer.

Real model classes, real tokenizer, random weights: tests run the production code paths in seconds.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

ARCHS = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2", use_sliding_window=False),
    "qwen3": dict(model_type="qwen3", use_sliding_window=False, head_dim=16),
}


def make_tiny_model_dir(
    out_dir: Path,
    tokenizer_dir: Path,
    arch: str = "llama",
    seed: int = 0,
    num_layers: int = 2,
    hidden: int = 64,
    tie_word_embeddings: bool = True,
) -> Path:
    """Write a random `arch` model with `tokenizer_dir`'s vocabulary and tokenizer to `out_dir`."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    extra = dict(ARCHS[arch])
    model_type = extra.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
