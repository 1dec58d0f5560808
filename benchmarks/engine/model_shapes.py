"""Model shapes the benchmarks build with random weights (no download): one definition for all, and the
tiny random model directory the CPU smoke checks and the hostile-input harnesses run a real engine on."""

from __future__ import annotations

from pathlib import Path

QWEN25_15B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    use_sliding_window=False,
)
QWEN25_3B = dict(  # Qwen/Qwen2.5-3B (3.09 B parameters)
    QWEN25_15B,
    hidden_size=2048,
    intermediate_size=11008,
    num_hidden_layers=36,
    num_attention_heads=16,
    num_key_value_heads=2,
)
QWEN25_7B = dict(  # Qwen/Qwen2.5-7B (7.62 B parameters): a larger vocabulary, and untied embeddings
    QWEN25_15B,
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)
TINY = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    use_sliding_window=False,
)
SMOLLM2_135M = dict(  # HuggingFaceTB/SmolLM2-135M-Instruct (a LlamaConfig)
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)


def make_tiny_model_dir(out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write a random 2-layer Llama of the TINY shape, with `tokenizer_dir`'s vocabulary and tokenizer, to
    `out_dir` (kept if already there). The same model as tests/tiny_models.py's default: the hostile-input
    harnesses measure older trees too, so they build it here rather than import a test fixture or a
    module the measured tree may lack."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    shape = {k: v for k, v in TINY.items() if k != "use_sliding_window"}  # a Qwen2 key
    config = LlamaConfig(
        **{**shape, "vocab_size": len(tokenizer)},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
