"""Exact-match reward with Search-R1's (SQuAD) normalisation, and the optional format score."""

from __future__ import annotations

import unicodedata

import pytest

from tandemrl.agent.reward import compute_reward, em_check, f1, is_valid_sequence, normalize_answer


@pytest.mark.parametrize(
    "raw, normalized",
    [
        ("Paris", "paris"),
        ("  The   Eiffel Tower. ", "eiffel tower"),
        ("A cat, an owl & the dog!", "cat owl dog"),
        ("theatre", "theatre"),  # articles only as whole words
        ("Anne-Marie's", "annemaries"),
        ("", ""),
    ],
)
def test_normalize_answer(raw, normalized):
    assert normalize_answer(raw) == normalized


def test_em_check_several_golds_and_normalisation():
    golds = ["Zorvia City", "the city of Zorvia"]
    assert em_check("zorvia city", golds)
    assert em_check("City of Zorvia.", golds)
    assert em_check("THE  Zorvia   City!", golds)
    assert not em_check("Zorvia", golds)
    assert not em_check(None, golds)
    assert em_check("1912", "1912")  # a single gold string


COMPOSED = "C\u00f4te d'Ivoire"  # ô as one code point (NFC), as typed
DECOMPOSED = "Co\u0302te d'Ivoire"  # o + combining circumflex (NFD), as some sources store it


def test_composed_and_decomposed_text_is_the_same_answer():
    assert COMPOSED != DECOMPOSED and unicodedata.normalize("NFC", DECOMPOSED) == COMPOSED
    assert normalize_answer(DECOMPOSED) == normalize_answer(COMPOSED) == "c\u00f4te divoire"
    for prediction, gold in ((COMPOSED, DECOMPOSED), (DECOMPOSED, COMPOSED)):
        assert em_check(prediction, [gold])
        assert f1(prediction, [gold]) == 1.0
        assert compute_reward(f"<answer> {prediction} </answer>", [gold]) == 1.0
    # other letters stay other answers: the accent is kept, not stripped
    for prediction in ("Cote d'Ivoire", "C\u00f2te d'Ivoire"):  # no accent; ò, not ô
        assert not em_check(prediction, [DECOMPOSED])
        assert f1(prediction, [DECOMPOSED]) == pytest.approx(0.5)  # only "divoire" shared


def test_reward_uses_the_last_answer():
    golds = ["Paris"]
    assert compute_reward("<answer> London </answer> ... <answer> paris </answer>", golds) == 1.0
    assert compute_reward("<answer> Paris </answer> ... <answer> London </answer>", golds) == 0.0


def test_reward_zero_without_answer_tags():
    assert compute_reward("Paris", ["Paris"]) == 0.0
    assert compute_reward("<answer> Paris", ["Paris"]) == 0.0


def test_prompt_example_answer_never_counts():
    """The instruction's `<answer> Beijing </answer>` is in the prompt, which is never scored."""
    from tandemrl.agent.prompt import INSTRUCTION

    assert "<answer> Beijing </answer>" in INSTRUCTION
    assert compute_reward("<think>no idea</think>", ["Beijing"]) == 0.0
    assert compute_reward("<think>no idea</think><answer> Beijing </answer>", ["Beijing"]) == 1.0


VALID = (
    "<think>look up</think>\n<search> q </search>\n\n<information>Doc 1(Title: Paris) x</information>\n\n"
    "<think>found</think>\n<answer> Paris </answer>"
)


def test_structure_check():
    assert is_valid_sequence(VALID)
    assert is_valid_sequence("<think>sure</think><answer> x </answer>")
    assert not is_valid_sequence("<answer> x </answer>")  # no think first
    assert not is_valid_sequence("<think>a</think><answer> x </answer> trailing")  # text after answer
    assert not is_valid_sequence("<think>a</think><search> q </search>")  # never answered
    assert not is_valid_sequence("<think>a<think></think><answer>x</answer>")  # unbalanced
    invalid_msg = "<think>a</think>oops\nMy previous action is invalid.\n<think>b</think><answer>x</answer>"
    assert not is_valid_sequence(invalid_msg)


def test_format_reward_scores():
    golds = ["Paris"]
    assert compute_reward(VALID, golds, format_reward=True) == 1.0
    assert compute_reward(VALID.replace("<think>found</think>\n", ""), golds, format_reward=True) == 0.8
    wrong = VALID.replace("<answer> Paris", "<answer> Rome")
    assert compute_reward(wrong, golds, format_reward=True) == pytest.approx(0.3)  # retrieved the gold
    wrong_no_hit = wrong.replace("Title: Paris", "Title: Lyon")
    assert compute_reward(wrong_no_hit, golds, format_reward=True) == pytest.approx(0.2)
    assert compute_reward("<answer> Rome </answer>", golds, format_reward=True) == pytest.approx(0.1)
    assert compute_reward("rambling", golds, format_reward=True) == 0.0
    assert compute_reward(wrong, golds, format_reward=False) == 0.0
