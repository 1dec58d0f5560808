"""The Search-R1 reward: exact match of the final answer, optionally with Search-R1's format score;
the built-in reward functions (exact match, F1) and the reward plug-in (`reward.function`).

Invariant: the reward depends only on the response text (never the prompt, whose example answer
would otherwise count) and the gold answers. Normalisation is SQuAD's, as in Search-R1's
`qa_em.py`: lowercase, drop punctuation, drop the articles a/an/the, collapse whitespace. One addition:
Unicode NFC first, so text typed composed ("ô") and stored decomposed ("o" + U+0302) is the same answer.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
import string
import unicodedata
from collections.abc import Callable
from typing import TYPE_CHECKING

from tandemrl.agent.parser import extract_answer
from tandemrl.config.errors import ConfigError
from tandemrl.host.messages import one_line as _one_line

if TYPE_CHECKING:
    from tandemrl.config.agent import RewardConfig

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
    """The form exact match and F1 compare: NFC, then Search-R1's (ASCII punctuation, as there)."""
    text = "".join(ch for ch in unicodedata.normalize("NFC", text).lower() if ch not in _PUNCTUATION)
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


# ---- built-in reward functions and the reward plug-in (`reward.function`) ---------------------------

REWARD_ARGS = ("answer", "golden_answers", "response_text", "searches", "data_source")
# the dry call at start-up: a well-formed, correct one-search trajectory
SAMPLE_CALL = {
    "answer": "Paris",
    "golden_answers": ["Paris"],
    "response_text": "<think> I need the capital. </think>\n<search> capital of France </search>\n\n"
    '<information>Doc 1(Title: "France") Paris is the capital of France.</information>\n\n'
    "<think> It is Paris. </think>\n<answer> Paris </answer>",
    "searches": ["capital of France"],
    "data_source": "startup_check",
}


def exact_match(answer: str | None, golden_answers: list[str], **_: object) -> float:
    """`tandemrl.agent.reward:exact_match`: 1.0 when the answer matches a gold answer (SQuAD-normalised)."""
    return 1.0 if em_check(answer, golden_answers) else 0.0


def f1(answer: str | None, golden_answers: list[str], **_: object) -> float:
    """`tandemrl.agent.reward:f1`: SQuAD's token F1 of the answer against the best gold answer (0 without
    an answer)."""
    if answer is None:
        return 0.0
    predicted = normalize_answer(answer).split()
    best = 0.0
    for gold in [golden_answers] if isinstance(golden_answers, str) else golden_answers:
        expected = normalize_answer(gold).split()
        common = sum(min(predicted.count(t), expected.count(t)) for t in set(predicted))
        if common:
            precision, recall = common / len(predicted), common / len(expected)
            best = max(best, 2 * precision * recall / (precision + recall))
        elif not predicted and not expected:
            best = 1.0
    return best


class RewardError(ConfigError):
    """The configured reward function failed or returned something that is not a reward."""


class RewardFunction:
    """The reward every trajectory gets, in the runners, `tandem eval` and the demo alike: the built-in
    exact match (+ format score), or the callable `reward.function` names, called with the keyword
    arguments of REWARD_ARGS it declares. It returns a float, or a dict with a float `score` and other
    floats that are logged per data source (`rollout/reward_extra/<name>/<source>`)."""

    def __init__(self, fn: Callable | None = None, key: str = "reward.function", format_reward: bool = False):
        self.fn, self.key, self.format_reward = fn, key, format_reward
        self._arg_names = REWARD_ARGS if fn is None else _accepted_args(fn, key)

    def __call__(
        self,
        answer: str | None,
        golden_answers: list[str],
        response_text: str,
        searches: list[str],
        data_source: str,
    ) -> tuple[float, dict[str, float]]:
        """(score, extra metrics); raises RewardError naming the key for anything that is not a reward."""
        if self.fn is None:
            return score_answer(answer, golden_answers, response_text, self.format_reward), {}
        values = {
            "answer": answer,
            "golden_answers": list(golden_answers),
            "response_text": response_text,
            "searches": list(searches),
            "data_source": data_source,
        }
        try:
            result = self.fn(**{name: values[name] for name in self._arg_names})
        except (Exception, SystemExit) as error:  # `sys:exit` would end a run, or `config show` silently
            raise RewardError(
                f"{self.key} raised {_one_line(error)} (data source {data_source!r})."
            ) from None
        return _check_result(result, self.key)

    def check(self) -> None:
        """The start-up dry call on SAMPLE_CALL: the function runs and returns a finite reward."""
        self(**SAMPLE_CALL)


def load_reward(reward: RewardConfig, format_reward: bool) -> RewardFunction:
    """The run's reward from `reward.function` (None: the built-in, with Search-R1's format score when
    `format_reward`, agentloop.format_reward), dry-called once; ConfigError (one line, naming the key)
    for anything wrong."""
    from tandemrl.agent.plugin import load_callable

    spec = reward.function
    if spec is None:
        return RewardFunction(format_reward=format_reward)
    key = f"reward.function={spec!r}"
    if format_reward:
        raise ConfigError(
            f"{key} with agentloop.format_reward=true: the format score belongs to the built-in reward, and a "
            "reward function replaces it. Set agentloop.format_reward=false, or add the score in your function."
        )
    function = RewardFunction(load_callable(spec, "reward.function"), key)
    function.check()
    return function


def reward_extra_means(trajectories: list) -> dict[str, float]:
    """Per extra metric a reward function returned, its mean over the trajectories that have it (logged
    as `rollout/reward_extra/<name>/<source>`, and in `tandem eval`'s summary as `reward_extra/<name>`)."""
    values: dict[str, list[float]] = {}
    for traj in trajectories:
        for name, value in getattr(traj, "reward_extra", {}).items():
            values.setdefault(name, []).append(value)
    return {name: sum(v) / len(v) for name, v in sorted(values.items())}


def _accepted_args(fn: Callable, key: str) -> tuple[str, ...]:
    """The REWARD_ARGS `fn` takes (all of them with **kwargs); a parameter it requires that is not one of
    them is refused."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return REWARD_ARGS  # a builtin without a signature: give it everything
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return REWARD_ARGS
    unknown = [
        p.name
        for p in params
        if p.name not in REWARD_ARGS and p.default is p.empty and p.kind is not p.VAR_POSITIONAL
    ]
    if unknown:
        raise ConfigError(
            f"{key}: the function requires {', '.join(map(repr, unknown))}, which the agent loop does not "
            f"pass. Its parameters are keyword arguments named from: {', '.join(REWARD_ARGS)}."
        )
    return tuple(p.name for p in params if p.name in REWARD_ARGS)


def _check_result(result: object, key: str) -> tuple[float, dict[str, float]]:
    extra: dict[str, float] = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise RewardError(
                f"{key} returned a dict without 'score' (keys: {sorted(map(str, result))[:8]})."
            )
        extra = {
            str(name): _finite(value, key, f"[{name!r}]") for name, value in result.items() if name != "score"
        }
        result = result["score"]
    return _finite(result, key, "['score']" if extra else ""), extra


def _finite(value: object, key: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy scalars are Real too
        raise RewardError(
            f"{key} returned{where} {type(value).__name__} {_short(value)}; a reward is a float, or a dict "
            "with a float 'score' and other floats."
        )
    number = float(value)
    if not math.isfinite(number):
        raise RewardError(f"{key} returned{where} {number}; a reward must be a finite number.")
    return number


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
