"""Read the model's text: the action that ends a turn, and the final answer of a response.

Invariant: pure string functions, no tokenizer, no I/O. A turn ends at the first `</search>` or
`</answer>` (the engine's stop strings), so a turn's action is decided by the closing tag it ends
with; the final answer of a response is the last complete `<answer>...</answer>` in it.

Defined outcomes (see tests/unit/test_parser.py):
- `<search> q </search>` -> search "q" (stripped); `<answer> a </answer>` -> answer "a".
- unbalanced tags: the content runs from the *last* opening tag before the closing one, so
  `<search> a <search> b </search>` searches "b" and an unclosed tag of the other kind before it
  is ignored (`<answer> <search> q </search>` searches "q", as Search-R1's regex does); a closing
  tag without its opening tag, e.g. `<answer> x </search>`, is invalid.
- an empty or blank query is invalid (it is never sent to the retriever); an empty answer is an answer.
- no closing tag at all (an answer without tags, a turn cut by a length limit, plain EOS) is invalid.
- text after `</answer>` (e.g. when the last token carries more characters than the stop string)
  is ignored: the action is still the answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SEARCH, ANSWER, INVALID = "search", "answer", "invalid"
_CLOSING = re.compile(r"</(search|answer)>")
# an answer's content never holds another <answer>: with unbalanced tags the innermost opening wins
_ANSWER = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)


@dataclass(frozen=True)
class Action:
    kind: str  # search | answer | invalid | the tag of a plug-in tool
    content: str = ""  # the query or the answer, stripped; empty for invalid
    reason: str = ""  # why an action is invalid, for logs and trajectories


def parse_action(turn_text: str, tool_tags: tuple[str, ...] = (SEARCH,)) -> Action:
    """The action of one model turn (the text generated since the last tool message). `tool_tags`: the
    tags of the run's tools (agent/tools.py); a tool action's kind is its tag, and it needs an input."""
    closing = _CLOSING if tool_tags == (SEARCH,) else _closing_re(tool_tags)
    match = closing.search(turn_text)
    if match is None:
        names = " or ".join(f"</{tag}>" for tag in (*tool_tags, ANSWER))
        return Action(INVALID, reason=f"no {names} in the turn")
    tag = match.group(1)
    before = turn_text[: match.start()]
    opening = before.rfind(f"<{tag}>")
    if opening < 0:
        return Action(INVALID, reason=f"</{tag}> without <{tag}>")
    content = before[opening + len(tag) + 2 :].strip()
    if tag != ANSWER and not content:
        return Action(INVALID, reason="empty search query" if tag == SEARCH else f"empty <{tag}> input")
    return Action(tag, content)


def _closing_re(tool_tags: tuple[str, ...]) -> re.Pattern:
    return re.compile("</(" + "|".join(re.escape(tag) for tag in (*tool_tags, ANSWER)) + ")>")


def extract_answer(response_text: str) -> str | None:
    """The content of the last complete `<answer>...</answer>` in a response, stripped; None if none.

    Only the response is ever passed here, so the example answer of the instruction
    (`<answer> Beijing </answer>`) can never count.
    """
    matches = _ANSWER.findall(response_text)
    return matches[-1].strip() if matches else None
