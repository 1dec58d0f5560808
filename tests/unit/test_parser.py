"""The turn parser and answer extraction: every defined outcome of tandemrl.agent.parser."""

from __future__ import annotations

import pytest

from tandemrl.agent.parser import ANSWER, INVALID, SEARCH, Action, extract_answer, parse_action


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "<think>need facts</think>\n<search> capital of Zorvia </search>",
            Action(SEARCH, "capital of Zorvia"),
        ),
        ("<think>ok</think><answer> Paris </answer>", Action(ANSWER, "Paris")),
        ("<answer>multi\nline</answer>", Action(ANSWER, "multi\nline")),
        ("<answer></answer>", Action(ANSWER, "")),  # an empty answer is still an answer (it scores 0)
        # unbalanced: the last opening tag before the closing one starts the content
        ("<search> a <search> b </search>", Action(SEARCH, "b")),
        ("<answer> x <answer> y </answer>", Action(ANSWER, "y")),
        # text after </answer> (the last token may carry more than the stop string) is ignored
        ("<answer> Paris </answer>.\n", Action(ANSWER, "Paris")),
        # the first closing tag decides, as the engine stops there
        ("<search> q1 </search> <answer> a </answer>", Action(SEARCH, "q1")),
        # an unclosed tag of the other kind is ignored, as by Search-R1's regex
        ("<answer> <search> q </search>", Action(SEARCH, "q")),
        ("<search> q <answer> a </answer>", Action(ANSWER, "a")),
    ],
)
def test_valid_actions(text, expected):
    assert parse_action(text) == Action(expected.kind, expected.content)


@pytest.mark.parametrize(
    "text, reason",
    [
        ("<search>   </search>", "empty search query"),
        ("<search></search>", "empty search query"),
        ("The answer is Paris.", "no </search> or </answer>"),  # an answer without tags
        ("<answer> Paris", "no </search> or </answer>"),  # cut by a length limit
        ("", "no </search> or </answer>"),  # plain EOS
        ("Paris </answer>", "</answer> without <answer>"),
        ("<search> q </answer>", "</answer> without <answer>"),
    ],
)
def test_invalid_actions(text, reason):
    action = parse_action(text)
    assert action.kind == INVALID
    assert action.content == ""
    assert reason in action.reason


def test_last_answer_wins():
    text = "<answer> first </answer> more <answer> second </answer>"
    assert extract_answer(text) == "second"


def test_extract_answer_unbalanced_and_missing():
    assert extract_answer("<answer> a <answer> b </answer>") == "b"
    assert extract_answer("<answer> cut off") is None
    assert extract_answer("no tags at all") is None
    assert extract_answer("<answer> a </answer> trailing text") == "a"
    assert extract_answer("<answer>\n  spaced  \n</answer>") == "spaced"
