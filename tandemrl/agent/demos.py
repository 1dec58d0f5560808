"""Rendering a cold-start demonstration plan (data/demos.py) to token ids and a loss mask, exactly as the
agent loop builds a trajectory: the prompt and information blocks from agent/prompt.py (mask 0), the
model turns tokenized separately (mask 1), with the real retriever's results (`tandem sft`,
commands/sft.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandemrl.agent.search_tool import SearchTool


def model_turn_texts(demo: dict) -> list[str]:
    """The model's text per turn: one per search, then the answer turn (without EOS)."""
    turns = [
        f"<think> {step['think']} </think>\n<search> {step['query']} </search>" for step in demo["steps"]
    ]
    turns.append(f"<think> {demo['final_think']} </think>\n<answer> {demo['answer']} </answer>")
    return turns


def info_hits(demo: dict, results: list[list[dict]]) -> list[bool]:
    """Per search, whether a retrieved document states the step's fact (names its entity and value)."""

    def states(step: dict, contents: str) -> bool:
        return step["entity"] in contents and step["expect"] in contents

    return [
        any(states(step, doc["document"]["contents"]) for doc in docs)
        for step, docs in zip(demo["steps"], results, strict=True)
    ]


async def render_demo(
    demo: dict,
    search: SearchTool,
    tokenizer,
    topk: int,
    max_info_tokens: int | None = None,
    skip_on_miss: bool = False,
) -> tuple[list[int], list[int]]:
    """input_ids (prompt + response) and loss_mask (1 on model turns and the final EOS, 0 elsewhere).

    The information blocks hold what the retriever returns now for the plan's queries. With
    `skip_on_miss`, a demo whose searches miss the fact they expect renders as ([], []), so that SFT
    never teaches answering from documents that do not say the answer.
    """
    from tandemrl.agent.prompt import build_prompt_ids, encode_text, format_information

    queries = [step["query"] for step in demo["steps"]]
    results = await search.search(queries, topk=topk) if queries else []
    if skip_on_miss and not all(info_hits(demo, results)):
        return [], []
    input_ids = build_prompt_ids(tokenizer, demo["question"])
    loss_mask = [0] * len(input_ids)
    turns = model_turn_texts(demo)
    for index, text in enumerate(turns):
        turn_ids = encode_text(tokenizer, text)
        if index == len(turns) - 1 and tokenizer.eos_token_id is not None:
            turn_ids.append(tokenizer.eos_token_id)
        input_ids += turn_ids
        loss_mask += [1] * len(turn_ids)
        if index < len(results):
            info_ids = encode_text(tokenizer, format_information(results[index], tokenizer, max_info_tokens))
            input_ids += info_ids
            loss_mask += [0] * len(info_ids)
    return input_ids, loss_mask
