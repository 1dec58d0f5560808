"""benchmarks/engine/ngram_drafts.py replays trajectories through the engine's own drafter: a turn that
copies its context is emitted in few steps, one with nothing to copy in one step a token, and a prefill's
token is never counted as a decode step's."""

from __future__ import annotations

from benchmarks.engine.ngram_drafts import model_turns, replay


def trajectory(prompt: list[int], turns: list[list[int]], blocks: list[list[int]]) -> dict:
    response, mask = [], []
    for turn, block in zip(turns, blocks, strict=True):
        response += turn + block
        mask += [1] * len(turn) + [0] * len(block)
    return {"prompt_ids": prompt, "response_ids": response, "loss_mask": mask}


def test_model_turns_are_the_masked_runs_after_the_prompt():
    row = trajectory([1, 2, 3], [[4, 5], [6]], [[7, 8], []])
    assert model_turns(row) == [(3, 5), (7, 8)]


def test_copying_turns_take_few_steps_and_fresh_ones_one_a_token():
    span = list(range(100, 130))
    copying = trajectory([*span, 7, 8], [[9, *span]], [[]])  # the turn repeats the prompt's span
    fresh = trajectory([1, 2, 3], [list(range(200, 231))], [[]])  # nothing to look up
    copy = replay([copying], num_draft_tokens=4, ngram_min=1, ngram_max=3)
    plain = replay([fresh], num_draft_tokens=4, ngram_min=1, ngram_max=3)
    assert plain["decode_steps_per_token"] == 1.0 and plain["emitted_tokens"] == 30  # the prefill made one
    assert copy["emitted_tokens"] == 30 and copy["decode_steps"] < 30 / 3
    assert copy["acceptance_rate"] > 0.8 and copy["tokens_per_step"] > 3
    longer = replay([copying], num_draft_tokens=8, ngram_min=1, ngram_max=3)
    assert longer["decode_steps"] < copy["decode_steps"]  # longer drafts, fewer steps on a copy
