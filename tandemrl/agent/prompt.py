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
    With a tokenizer and `max_info_tokens`, every document's text is cut to one common token cap, the
    largest that lets the whole block fit (short documents stay whole, the best-ranked is never
    cut more than the others); titles stay, and the lowest-ranked documents are dropped only when
    the titles alone do not fit.
    """
    if tokenizer is None or max_info_tokens is None:
        return _render(docs)
    return information_block(docs, tokenizer, max_info_tokens)[0]


def information_block(docs: list[dict], tokenizer, max_info_tokens: int) -> tuple[str, list[int]]:
    """`format_information`'s block with its token ids (`encode_text` of the block), so the agent loop
    appends the block without encoding it a second time (tokenizing runs on the driver's event loop)."""
    block = _render(docs)
    ids = encode_text(tokenizer, block)
    if len(ids) <= max_info_tokens:
        return block, ids
    parts = [_split_contents(doc) for doc in docs]
    parts = [(title, encode_text(tokenizer, text)) for title, text in parts]
    for num_docs in range(len(parts), -1, -1):
        titles_only = _render_capped(parts[:num_docs], 0, tokenizer)
        titles_ids = encode_text(tokenizer, titles_only)
        if len(titles_ids) <= max_info_tokens:
            return _largest_fit(parts[:num_docs], tokenizer, max_info_tokens, (titles_only, titles_ids))
    raise AssertionError(f"an empty information block does not fit into {max_info_tokens} tokens")


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


def _render_capped(parts: list[tuple[str, list[int]]], cap: int, tokenizer) -> str:
    docs = [
        {"document": {"id": "", "contents": f"{title}\n{tokenizer.decode(ids[:cap]) if cap else ''}"}}
        for title, ids in parts
    ]
    return _render(docs)


def _largest_fit(
    parts: list[tuple[str, list[int]]], tokenizer, max_info_tokens: int, titles_only: tuple[str, list[int]]
) -> tuple[str, list[int]]:
    """Binary search for the largest per-document token cap whose block fits; the block and its ids
    (cap 0, `titles_only`, is known to fit)."""
    best, fits, too_big = titles_only, 0, max((len(ids) for _, ids in parts), default=0) + 1
    while too_big - fits > 1:
        cap = (fits + too_big) // 2
        block = _render_capped(parts, cap, tokenizer)
        ids = encode_text(tokenizer, block)
        if len(ids) <= max_info_tokens:
            best, fits = (block, ids), cap
        else:
            too_big = cap
    return best
