"""The kept cos/sin table of `RotaryEmbedding` (a step gathers its rows) holds exactly `cos_sin`'s values; the
longest context a model's positions allow, as the engine reads it."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from tandemrl.config.engine import model_context_limit
from tandemrl.engine.engine import Engine, EngineConfig
from tandemrl.engine.rope import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}])
def test_table_rows_equal_cos_sin(dtype, scaling):
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_scaling=scaling)
    rope = RotaryEmbedding(config, 16)
    positions = torch.tensor([0, 1, 17, 511, 1023, 5])
    cos, sin = rope.cos_sin(positions, dtype)
    computed = rope.cos_sin_rows(positions, dtype)  # no table yet: computed
    rope.keep_table(1024, dtype)
    gathered = rope.cos_sin_rows(positions, dtype)
    for rows in (computed, gathered):
        assert torch.equal(rows[0], cos[:, 0]) and torch.equal(rows[1], sin[:, 0])
    assert rope.table.shape == (1024, 2, 16)
    # a padded decode row (position -1) reads the last row instead of failing
    last = rope.cos_sin_rows(torch.tensor([-1]), dtype)
    assert torch.equal(last[0][0], rope.table[-1, 0])
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16  # not the table's dtype: computed
    assert torch.equal(rope.cos_sin_rows(positions, other)[0], rope.cos_sin(positions, other)[0][:, 0])


def test_the_context_limit_reads_the_config_as_transformers_writes_it():
    """The engine reads `model_context_limit` from the loaded config's `to_dict()`: the scaling's key there
    is whatever the installed transformers names it (`rope_parameters` in 5, `rope_scaling` in 4)."""
    config = LlamaConfig(max_position_embeddings=2048, rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert model_context_limit(config.to_dict()) == 8192
    assert model_context_limit(LlamaConfig(max_position_embeddings=2048).to_dict()) == 2048


def test_an_engine_refuses_a_context_past_its_model(tiny_llama_dir):
    """A context of 10**12 tokens sized the rotary table and the KV cache by it: out of memory at start-up."""
    with pytest.raises(
        ValueError, match=r"max_context_len 1,000,000,000,000 is longer than the 4,096 tokens"
    ):
        Engine(EngineConfig(str(tiny_llama_dir), max_context_len=10**12))
