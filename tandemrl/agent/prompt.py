"""The Search-R1 prompt and the tool texts the agent loop inserts between model turns.

Invariant: everything here is text or ids produced by *us* (template, information blocks,
correction messages); the model's own tokens never pass through this module. Information blocks
are truncated by tokens so that one block never exceeds `max_info_tokens`, whatever the documents.
"""

from __future__ import annotations

from tandemrl.agent.search_tool import format_documents

# Search-R1's instruction (scripts/data_process/nq_search.py, make_prefix, template "base"), verbatim.
INSTRUCTION = (
    "Answer the given question. "
    "You must conduct reasoning inside <think> and </think> first every time you get new information. "
    "After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query "
    "</search> and it will return the top searched results between <information> and </information>. "
    "You can search as many times as your want. "
    "If you find no further external knowledge needed, you can directly provide the answer inside <answer> "
    "and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
    "Question: {question}\n"
)

# Search-R1's correction for a turn with neither a search nor an answer (llm_agent/generation.py).
INVALID_ACTION_TEXT = (
    "\nMy previous action is invalid. "
    "If I want to search, I should put the query between <search> and </search>. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)

# Ours: the reply to a search attempted when no search is left (Search-R1 simply stops there).
ANSWER_NOW_TEXT = (
    "\nI have used all my searches. I must now give the final answer between <answer> and </answer>.\n"
)

INFO_OPEN, INFO_CLOSE = "\n\n<information>", "</information>\n\n"
STOP_STRINGS = ["</search>", "</answer>"]


def build_prompt_text(tokenizer, question: str) -> str:
    """The instruction as the user turn of the model's chat template, ready for the assistant's reply."""
    content = INSTRUCTION.format(question=question.strip())
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": content}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return content  # a base model without a template gets the bare instruction, as in Search-R1


def build_prompt_ids(tokenizer, question: str) -> list[int]:
    """Token ids of `build_prompt_text`; the template already carries the special tokens it needs."""
    return encode_text(tokenizer, build_prompt_text(tokenizer, question))


def encode_text(tokenizer, text: str) -> list[int]:
    """Tool or template text to ids, without BOS/EOS being added around it."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def format_information(docs: list[dict], tokenizer=None, max_info_tokens: int | None = None) -> str:
    """`\\n\\n<information>Doc 1(Title: ...) text\\nDoc 2...</information>\\n\\n` for retrieval results.

    `docs` are the retriever's results for one query (`{"document": {"id", "contents"}, "score"}`).
    With a tokenizer and `max_info_tokens`, the documents' text is cut (longest first) until the
    whole block fits; titles stay, and documents are only dropped when the titles alone do not fit.
    """
    block = _render(docs)
    if tokenizer is None or max_info_tokens is None:
        return block
    docs = [_split_contents(doc) for doc in docs]
    for _ in range(4 * len(docs) + 8):  # each round cuts a text or drops a document
        excess = len(encode_text(tokenizer, block)) - max_info_tokens
        if excess <= 0:
            return block
        docs = _shrink(docs, excess, tokenizer)
        block = _render([_join_contents(title, text) for title, text in docs])
    raise AssertionError(f"information block did not fit into {max_info_tokens} tokens")


def format_message(text: str, tokenizer, max_tokens: int) -> str:
    """A tool message (error text) cut to `max_tokens`; the closing tag is kept when present."""
    if len(encode_text(tokenizer, text)) <= max_tokens:
        return text
    closing = INFO_CLOSE if text.endswith(INFO_CLOSE) else ""
    body = text[: len(text) - len(closing)]
    body_ids = encode_text(tokenizer, body)[: max(0, max_tokens - len(encode_text(tokenizer, closing)) - 1)]
    return tokenizer.decode(body_ids) + closing


def _render(docs: list[dict]) -> str:
    return INFO_OPEN + format_documents(docs).strip() + INFO_CLOSE


def _split_contents(doc: dict) -> tuple[str, str]:
    title, _, text = doc["document"]["contents"].partition("\n")
    return title, text


def _join_contents(title: str, text: str) -> dict:
    return {"document": {"id": "", "contents": f"{title}\n{text}"}, "score": 0.0}


def _shrink(docs: list[tuple[str, str]], excess: int, tokenizer) -> list[tuple[str, str]]:
    """Cut `excess` tokens (plus one for re-tokenisation drift) from the longest text; drop the
    last document when no text is left to cut."""
    if not docs:
        raise AssertionError("an empty information block does not fit its budget")
    lengths = [len(encode_text(tokenizer, text)) for _, text in docs]
    if max(lengths) == 0:
        return docs[:-1]
    index = max(range(len(docs)), key=lambda i: lengths[i])
    title, text = docs[index]
    keep = max(0, lengths[index] - excess - 1)
    cut = tokenizer.decode(encode_text(tokenizer, text)[:keep]) if keep else ""
    return docs[:index] + [(title, cut)] + docs[index + 1:]
