"""The Search-R1 prompt in the chat template, and information blocks with their token budget."""

from __future__ import annotations

import pytest

from tandemrl.agent.prompt import (
    INFO_CLOSE,
    INFO_OPEN,
    INSTRUCTION,
    build_prompt_ids,
    build_prompt_text,
    encode_text,
    format_information,
    format_message,
)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def docs(*texts: str) -> list[dict]:
    return [
        {"document": {"id": str(i), "contents": f'"Title {i}"\n{text}'}, "score": 0.5}
        for i, text in enumerate(texts)
    ]


def test_instruction_is_search_r1s():
    text = INSTRUCTION.format(question="Who wrote Hamlet?")
    assert text.startswith(
        "Answer the given question. You must conduct reasoning inside <think> and </think> "
        "first every time you get new information. After reasoning, if you find you lack"
    )
    assert (
        "call a search engine by <search> query </search> and it will return the top searched results "
        "between <information> and </information>. You can search as many times as your want." in text
    )
    assert text.endswith("For example, <answer> Beijing </answer>. Question: Who wrote Hamlet?\n")


def test_prompt_in_chat_template(tokenizer):
    text = build_prompt_text(tokenizer, "  Who founded Zorvia?  ")
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nAnswer the given question." in text
    assert "Question: Who founded Zorvia?\n<|im_end|>" in text
    ids = build_prompt_ids(tokenizer, "Who founded Zorvia?")
    assert tokenizer.decode(ids) == build_prompt_text(tokenizer, "Who founded Zorvia?")
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # special tokens, not text


def test_prompt_without_chat_template(tokenizer):
    class BaseTokenizer:
        chat_template = None

    assert build_prompt_text(BaseTokenizer(), "Q?") == INSTRUCTION.format(question="Q?")


def test_information_format():
    block = format_information(docs("first text", "second text"))
    assert (
        block == f'{INFO_OPEN}Doc 1(Title: "Title 0") first text\nDoc 2(Title: "Title 1") second text'
        f"{INFO_CLOSE}"
    )
    assert block.startswith("\n\n<information>") and block.endswith("</information>\n\n")


def test_information_fits_its_budget(tokenizer):
    long = docs("alpha " * 300, "beta " * 50, "short")
    full = format_information(long)
    assert len(encode_text(tokenizer, full)) > 120
    for budget in (120, 60, 30):
        block = format_information(long, tokenizer, budget)
        assert len(encode_text(tokenizer, block)) <= budget
        assert block.startswith(INFO_OPEN + 'Doc 1(Title: "Title 0")') and block.endswith(INFO_CLOSE)
    # one common cap: the long documents are cut, the short one keeps its text
    block = format_information(long, tokenizer, 120)
    assert "short" in block and "alpha alpha" in block and "beta beta" in block
    # a budget that fits everything leaves the block unchanged
    assert format_information(long, tokenizer, 10_000) == full


def test_equal_documents_are_cut_equally(tokenizer):
    """The best-ranked document is never sacrificed for the others."""
    block = format_information(docs("one " * 100, "two " * 100, "three " * 100), tokenizer, 90)
    counts = [block.count(word) for word in ("one", "two", "three")]
    assert min(counts) > 0 and max(counts) - min(counts) <= 1
    assert len(encode_text(tokenizer, block)) <= 90


def test_information_drops_documents_when_titles_alone_do_not_fit(tokenizer):
    block = format_information(docs("a", "b", "c"), tokenizer, 20)
    assert (
        len(encode_text(tokenizer, block)) <= 20
        and block.startswith(INFO_OPEN)
        and block.endswith(INFO_CLOSE)
    )
    assert "Doc 3" not in block


def test_format_message_keeps_the_closing_tag(tokenizer):
    text = f"{INFO_OPEN}search failed: {'x ' * 100}{INFO_CLOSE}"
    cut = format_message(text, tokenizer, 25)
    assert len(encode_text(tokenizer, cut)) <= 25 and cut.startswith(INFO_OPEN) and cut.endswith(INFO_CLOSE)
    assert format_message("short", tokenizer, 25) == "short"


def test_information_block_ids_are_the_blocks(tokenizer):
    from tandemrl.agent.prompt import information_block

    long = docs("alpha " * 300, "beta " * 50, "short")
    for budget in (10_000, 120, 20):
        block, ids = information_block(long, tokenizer, budget)
        assert block == format_information(long, tokenizer, budget)
        assert ids == encode_text(tokenizer, block) and len(ids) <= budget
