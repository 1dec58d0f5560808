"""The kept cos/sin table of `RotaryEmbedding` (a step gathers its rows) holds exactly `cos_sin`'s values."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

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
