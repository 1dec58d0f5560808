"""The Search-R1 reward: exact match of the final answer, optionally with Search-R1's format score.

Invariant: the reward depends only on the response text (never the prompt, whose example answer
would otherwise count) and the gold answers. Normalisation is SQuAD's, as in Search-R1's
`qa_em.py`: lowercase, drop punctuation, drop the articles a/an/the, collapse whitespace.
"""

from __future__ import annotations

import re
import string

from tandemrl.agent.parser import extract_answer

# Search-R1's qa_em_format.py weights (the values its comments give: 1, 0.8, 0.3, 0.2, 0.1).
STRUCTURE_FORMAT_SCORE = 0.2  # a well-formed think/search/information/answer sequence
FINAL_FORMAT_SCORE = 0.1  # an answer was given, but wrong and in a malformed sequence
RETRIEVAL_SCORE = 0.1  # well-formed and a retrieved block contains a gold answer

_PUNCTUATION = set(string.punctuation)
_TAGS = ("think", "search", "information", "answer")
_TAG_RE = re.compile(r"(</?(?:think|search|information|answer)>)")
_INFO_RE = re.compile(r"<information>(.*?)</information>", re.DOTALL)
# state machine of a valid response: (state, tag) -> next state
_TRANSITIONS = {
    ("start", "<think>"): "in_think",
    ("information", "<think>"): "in_think",
    ("in_think", "</think>"): "after_think",
    ("after_think", "<search>"): "in_search",
    ("in_search", "</search>"): "after_search",
    ("after_search", "<information>"): "in_information",
    ("in_information", "</information>"): "information",
    ("after_think", "<answer>"): "in_answer",
    ("in_answer", "</answer>"): "end",
}


def normalize_answer(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def em_check(prediction: str | None, golden_answers: list[str] | str) -> bool:
    """True when the normalised prediction equals any normalised gold answer."""
    if prediction is None:
        return False
    if isinstance(golden_answers, str):
        golden_answers = [golden_answers]
    normalized = normalize_answer(prediction)
    return any(normalize_answer(gold) == normalized for gold in golden_answers)


def is_valid_sequence(response_text: str) -> bool:
    """Search-R1's structure check: balanced tags in think (search information think)* answer order,
    with only whitespace between tags and nothing after the answer."""
    for tag in _TAGS:
        if response_text.count(f"<{tag}>") != response_text.count(f"</{tag}>"):
            return False
    state = "start"
    for part in _TAG_RE.split(response_text):
        if not part.strip():
            continue
        if _TAG_RE.fullmatch(part):
            state = _TRANSITIONS.get((state, part), "")
            if not state:
                return False
        elif not state.startswith("in_"):
            return False  # text outside tags, e.g. a correction message or text after </answer>
    return state == "end"


def retrieval_contains_answer(response_text: str, golden_answers: list[str]) -> bool:
    blocks = [normalize_answer(block) for block in _INFO_RE.findall(response_text)]
    golds = [normalize_answer(gold) for gold in golden_answers]
    return any(gold in block for block in blocks for gold in golds)


def compute_reward(response_text: str, golden_answers: list[str], format_reward: bool = False) -> float:
    """The reward of a response whose text is all the model's: its last `<answer>` is scored."""
    return score_answer(extract_answer(response_text), golden_answers, response_text, format_reward)


def score_answer(
    answer: str | None, golden_answers: list[str], response_text: str = "", format_reward: bool = False
) -> float:
    """1.0 when `answer` matches a gold answer, else 0.0; with `format_reward`, Search-R1's qa_em_format
    score over the whole `response_text` (0.2 structure, +0.1 retrieval hit, 0.1 malformed answer,
    0.8 malformed hit).

    The agent loop passes the answer taken from the model's own turns: tool text never counts (the
    correction message itself says "<answer> and </answer>", which would otherwise read as the answer "and").
    """
    is_correct = em_check(answer, golden_answers)
    if not format_reward:
        return 1.0 if is_correct else 0.0
    is_valid = is_valid_sequence(response_text)
    if is_correct:
        return 1.0 if is_valid else 1.0 - STRUCTURE_FORMAT_SCORE
    if is_valid:
        hit = retrieval_contains_answer(response_text, golden_answers)
        return STRUCTURE_FORMAT_SCORE + (RETRIEVAL_SCORE if hit else 0.0)
    return FINAL_FORMAT_SCORE if answer is not None else 0.0
