"""Token-budget packing: no padding, budget respected, rank plans in lockstep, and a packed forward of
a real HF model (sdpa, CPU) equal to per-sample forwards."""

from __future__ import annotations

import pytest
import torch

from tandemrl.trainer.batching import (
    TrainSample,
    build_micro_batch,
    pack_indices,
    partition_for_ranks,
    plan_rank_micro_batches,
    split_minibatches,
)


def _sample(n: int, adv: float = 1.0, first_masked: int = 2) -> TrainSample:
    mask = [0] * first_masked + [1] * (n - first_masked)
    return TrainSample(list(range(10, 10 + n)), mask, [-0.5 * m for m in mask], adv)


def test_pack_respects_budget_and_loses_nothing():
    lengths = [7, 3, 9, 4, 4, 1, 6]
    bins = pack_indices(lengths, max_tokens=10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 4  # 34 tokens need >= 4 bins of 10


def test_oversized_sample_gets_its_own_bin():
    assert pack_indices([15, 3], max_tokens=10) == [[0], [1]]


def test_packed_layout_is_next_token_without_padding():
    a, b = _sample(4, adv=2.0), _sample(3, adv=-1.0, first_masked=1)
    micro = build_micro_batch([a, b], [0, 1])
    assert micro.num_tokens == 7 and micro.attention_mask_RL is None  # no padding
    assert micro.position_ids_RL.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert micro.labels_N.tolist() == [11, 12, 13, 0, 11, 12, 0]
    assert micro.mask_N.tolist() == [0, 1, 1, 0, 1, 1, 0]  # a's first predicted token is masked prompt
    assert micro.old_logprobs_N.tolist() == [0.0, -0.5, -0.5, 0.0, -0.5, -0.5, 0.0]
    assert micro.advantages_N.tolist() == [2.0] * 4 + [-1.0] * 3
    assert micro.select_K.tolist() == [1, 2, 4, 5]
    assert micro.split_per_sample(torch.arange(7.0)) == [[0.0, 0.0, 1.0, 2.0], [0.0, 4.0, 5.0]]


def test_lags_follow_the_next_token_layout_in_both_layouts():
    a = TrainSample([10, 11, 12, 13], [0, 1, 1, 1], [0.0, -0.5, -0.5, -0.5], 1.0, lags=[0, 2, 1, 0])
    b = TrainSample([10, 11, 12], [0, 1, 1], [0.0, -0.5, -0.5], 1.0)  # no lags: all 0
    assert build_micro_batch([a, b], [0, 1]).lags_N.tolist() == [2, 1, 0, 0, 0, 0, 0]
    assert build_micro_batch([a, b], [0, 1], padded=True).lags_N.tolist() == [2, 1, 0, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="lags 3"):
        TrainSample([10, 11], [0, 1], [0.0, -0.5], lags=[0, 1, 2])


def test_padded_layout_rows_and_flat_positions():
    a, b = _sample(4, adv=2.0), _sample(3, adv=-1.0, first_masked=1)
    micro = build_micro_batch([a, b], [0, 1], padded=True)
    assert micro.input_ids_RL.tolist() == [[10, 11, 12, 13], [10, 11, 12, 0]]
    assert micro.attention_mask_RL.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert micro.mask_N.tolist() == [0, 1, 1, 0, 1, 1, 0, 0]
    assert micro.labels_N.tolist() == [11, 12, 13, 0, 11, 12, 0, 0]
    assert micro.sample_offsets == [0, 4]
    assert micro.split_per_sample(torch.arange(8.0)) == [[0.0, 0.0, 1.0, 2.0], [0.0, 4.0, 5.0]]


def test_padded_grouping_keeps_similar_lengths_together():
    lengths = [100, 12, 98, 10, 11, 50]
    groups = pack_indices(lengths, max_tokens=200, padded=True)
    assert groups == [[0, 2], [5], [1, 3, 4]]
    padded_tokens = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    assert padded_tokens - sum(lengths) == 2 + 0 + 3  # little padding
    assert all(len(g) * max(lengths[i] for i in g) <= 200 for g in groups)


def test_split_minibatches_keeps_order_and_sizes():
    samples = [_sample(3 + i) for i in range(10)]
    parts = split_minibatches(samples, 4)
    assert sorted(len(p) for p in parts) == [2, 2, 3, 3]
    assert [s for p in parts for s in p] == samples
    assert len(split_minibatches(samples[:2], 4)) == 2


def test_ranks_are_balanced_and_plans_have_equal_length():
    samples = [_sample(n) for n in (30, 5, 5, 5, 5, 5, 4)]
    parts = partition_for_ranks(samples, 2)
    loads = [sum(samples[i].num_tokens for i in p) for p in parts]
    assert sorted(i for p in parts for i in p) == list(range(7))
    assert abs(loads[0] - loads[1]) <= 5
    plans = [plan_rank_micro_batches(samples, r, 2, max_tokens=10) for r in range(2)]
    assert len(plans[0]) == len(plans[1])
    padding = [m for plan in plans for m in plan if not m.sample_indices]
    assert padding and all(float(m.mask_N.sum()) == 0 for m in padding)
    total_loss_tokens = sum(float(m.mask_N.sum()) for plan in plans for m in plan)
    assert total_loss_tokens == sum(s.num_loss_tokens for s in samples)


def test_misaligned_sample_is_rejected():
    with pytest.raises(ValueError, match="aligned"):
        TrainSample([1, 2, 3], [0, 1], [0.0, 0.0, 0.0], 1.0)


@pytest.mark.parametrize("padded", [False, True])
def test_micro_batch_forward_equals_separate_forwards(tiny_llama_dir, padded):
    """Packed: HF reads position_ids restarts as sequence boundaries (block-diagonal mask, CPU sdpa);
    padded: right-padded rows with an attention mask. Both equal per-sample forwards."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    samples = [_sample(n) for n in (9, 5, 12)]
    micro = build_micro_batch(samples, [0, 1, 2], padded=padded)
    with torch.no_grad():
        logits = model(
            input_ids=micro.input_ids_RL,
            position_ids=micro.position_ids_RL,
            attention_mask=micro.attention_mask_RL,
            use_cache=False,
        ).logits
        flat = logits.reshape(-1, logits.shape[-1])
        together = torch.cat(
            [flat[o : o + s.num_tokens] for o, s in zip(micro.sample_offsets, samples, strict=True)]
        )
        separate = torch.cat([model(input_ids=torch.tensor([s.input_ids])).logits[0] for s in samples])
    assert (together - separate).abs().max().item() < 1e-5
