"""Prompts too long for the engine's context with the response budget after it are set aside by the
training feed and the validation set (runner/prompt_feed.py, runner/session.py), as verl's
`filter_overlong_prompts` does: the engine refused them with a 400 and the run ended on it, steps in."""

from __future__ import annotations

import json
import logging

import pytest

from tandemrl.agent.prompt import build_prompt_ids
from tandemrl.data.loader import PromptLoader
from tandemrl.runner.prompt_feed import PromptFeed


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def write_questions(path, questions):
    rows = [{"id": str(i), "question": q, "golden_answers": ["a"]} for i, q in enumerate(questions)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_the_feed_sets_aside_only_the_prompts_that_do_not_fit(tmp_path, tokenizer, caplog):
    short = "Who founded the city of Amberlane?"
    room = len(build_prompt_ids(tokenizer, short)) + 40
    questions = [short, "word " * 400, "城市" * 60, short + " And when?", "x" * 30]  # 2nd and 3rd too long
    loader = PromptLoader([write_questions(tmp_path / "q.jsonl", questions)], seed=0, shuffle=False)
    feed = PromptFeed(loader, prefetch=2, tokenizer=tokenizer, max_prompt_tokens=room)
    with caplog.at_level(logging.WARNING):
        drawn = [feed.next().question for _ in range(6)]  # into the second epoch
    assert drawn == [short, short + " And when?", "x" * 30] * 2
    assert feed.num_overlong == 4
    assert "q:1 set aside" in caplog.text and "more than the" in caplog.text
    for question in drawn:
        assert len(build_prompt_ids(tokenizer, question)) <= room
    # without a bound nothing is set aside
    plain = PromptFeed(PromptLoader([tmp_path / "q.jsonl"], seed=0, shuffle=False), prefetch=2)
    assert [plain.next().question for _ in range(5)] == [q.strip() for q in questions]


def test_a_feed_where_nothing_fits_is_refused_not_a_hang(tmp_path, tokenizer):
    loader = PromptLoader([write_questions(tmp_path / "q.jsonl", ["long " * 300] * 3)], seed=0, shuffle=False)
    feed = PromptFeed(loader, prefetch=2, tokenizer=tokenizer, max_prompt_tokens=50)
    with pytest.raises(ValueError, match="no prompt of data.train_data_paths fits"):
        feed.next()


def test_validation_prompts_that_do_not_fit_are_set_aside(tmp_path, tokenizer):
    from tandemrl.config.errors import ConfigError
    from tandemrl.config.loader import load_config
    from tandemrl.data.loader import load_prompts
    from tandemrl.runner.session import _fitting_val_prompts

    path = write_questions(tmp_path / "val.jsonl", ["Who?", "word " * 3000, "Where?"])
    config = load_config(
        None,
        [
            f"data.val_data_paths=[{path}]",
            "rollout.max_context_len=2048",
            "agentloop.max_response_tokens=1024",
        ],
    )
    prompts = load_prompts([str(path)])
    assert [p.question for p in _fitting_val_prompts(config, tokenizer, prompts)] == ["Who?", "Where?"]
    with pytest.raises(ConfigError, match="no validation question fits"):
        _fitting_val_prompts(config, tokenizer, prompts[1:2])
