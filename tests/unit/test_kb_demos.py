"""Demo rendering: token ids + loss mask in exactly the agent loop's Search-R1 format.

The real SearchTool talks HTTP to `FakeRetrievalServer`, an in-test aiohttp server on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web

from tandemrl.agent.demos import model_turn_texts, render_demo
from tandemrl.agent.prompt import build_prompt_ids, encode_text, format_information
from tandemrl.agent.search_tool import SearchTool
from tandemrl.data.demos import load_demos
from tandemrl.data.kb import generate_kb


class FakeRetrievalServer:
    """Stands in for the retrieval server process (Search-R1 `/retrieve` API): returns the passages
    mapped to a query first (an oracle retriever), then the first corpus passages as padding."""

    def __init__(self, corpus: list[dict], hits: dict[str, list[str]], num_padding: int = 50):
        self.by_id = {passage["id"]: passage for passage in corpus}
        self.padding = corpus[:num_padding]
        self.hits = hits
        self.runner: web.AppRunner | None = None
        self.addr = ""

    async def _retrieve(self, request: web.Request) -> web.Response:
        body = await request.json()
        result = []
        for query in body["queries"]:
            docs = [self.by_id[pid] for pid in self.hits.get(query, [])]
            docs += [p for p in self.padding if p not in docs]
            result.append(
                [
                    {"document": doc, "score": 1.0 / (rank + 1)}
                    for rank, doc in enumerate(docs[: body["topk"]])
                ]
            )
        return web.json_response({"result": result})

    async def __aenter__(self) -> FakeRetrievalServer:
        app = web.Application()
        app.router.add_post("/retrieve", self._retrieve)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.addr = f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def kb(tmp_path_factory) -> Path:
    return generate_kb(
        tmp_path_factory.mktemp("kb"), seed=5, num_entities=200, num_train=200, num_val=20, num_test=20
    )


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def oracle_hits(kb: Path) -> dict[str, list[str]]:
    """Each demo query -> the gold passage of its hop."""
    records = {r["id"]: r for r in read_jsonl(kb / "train.jsonl")}
    hits = {}
    for demo in load_demos(kb / "demos.jsonl"):
        for step, passage_id in zip(demo["steps"], records[demo["id"]]["gold_passage_ids"], strict=True):
            hits[step["query"]] = [passage_id]
    return hits


def spans(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """Maximal runs of equal mask value: [(mask value, ids), ...]."""
    runs: list[tuple[int, list[int]]] = []
    for token, bit in zip(ids, mask, strict=True):
        if runs and runs[-1][0] == bit:
            runs[-1][1].append(token)
        else:
            runs.append((bit, [token]))
    return runs


async def _render_all(kb, tokenizer, hits, demos, num_padding=50, **kwargs):
    corpus = read_jsonl(kb / "corpus.jsonl")
    async with FakeRetrievalServer(corpus, hits, num_padding) as server:
        search = SearchTool(server.addr, topk=3)
        try:
            return [await render_demo(demo, search, tokenizer, topk=3, **kwargs) for demo in demos]
        finally:
            await search.close()


def test_render_matches_the_agent_loop_format(kb, tokenizer):
    demos = load_demos(kb / "demos.jsonl")
    two_hop = [d for d in demos if len(d["steps"]) == 2][:3]
    one_hop = [d for d in demos if len(d["steps"]) == 1][:3]
    rendered = asyncio.run(_render_all(kb, tokenizer, oracle_hits(kb), one_hop + two_hop))
    for demo, (ids, mask) in zip(one_hop + two_hop, rendered, strict=True):
        assert len(ids) == len(mask)
        prompt = build_prompt_ids(tokenizer, demo["question"])
        assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
        runs = spans(ids[len(prompt) :], mask[len(prompt) :])
        turns = model_turn_texts(demo)
        assert [bit for bit, _ in runs] == [1, 0] * len(demo["steps"]) + [1]
        model_runs = [run for bit, run in runs if bit == 1]
        assert model_runs[:-1] == [encode_text(tokenizer, text) for text in turns[:-1]]
        assert model_runs[-1] == encode_text(tokenizer, turns[-1]) + [tokenizer.eos_token_id]
        for (_, run), step in zip(runs[1::2], demo["steps"], strict=True):
            info = tokenizer.decode(run)
            assert info.startswith("\n\n<information>Doc 1(Title: ") and info.endswith("</information>\n\n")
            assert step["expect"] in info
        assert tokenizer.decode(model_runs[-1]).endswith(f"<answer> {demo['answer']} </answer><|im_end|>")


def test_information_is_the_agent_loops_block(kb, tokenizer):
    demo = load_demos(kb / "demos.jsonl")[0]
    corpus = {p["id"]: p for p in read_jsonl(kb / "corpus.jsonl")}
    hits = oracle_hits(kb)
    ((ids, mask),) = asyncio.run(_render_all(kb, tokenizer, hits, [demo]))
    docs = [corpus[pid] for pid in hits[demo["steps"][0]["query"]]] + read_jsonl(kb / "corpus.jsonl")[:2]
    block = format_information([{"document": d, "score": 0.0} for d in docs])
    assert encode_text(tokenizer, block) == spans(ids, mask)[2][1]


def test_skip_on_miss_drops_demos_whose_search_misses(kb, tokenizer):
    demos = load_demos(kb / "demos.jsonl", num_demos=4, seed=1)
    hits = oracle_hits(kb)
    queries = [step["query"] for demo in demos for step in demo["steps"]]
    # every search finds the passage another search wanted: a passage about another entity
    wrong = {query: hits[queries[(i + 1) % len(queries)]] for i, query in enumerate(queries)}
    rendered = asyncio.run(_render_all(kb, tokenizer, wrong, demos, num_padding=0, skip_on_miss=True))
    assert all(ids == [] and mask == [] for ids, mask in rendered)
    kept = asyncio.run(_render_all(kb, tokenizer, hits, demos, num_padding=0, skip_on_miss=True))
    assert all(len(ids) > 0 for ids, _ in kept)


def test_load_demos_subset_is_seeded_and_sized(kb):
    all_demos = load_demos(kb / "demos.jsonl")
    subset = load_demos(kb / "demos.jsonl", num_demos=50, seed=3)
    assert len(subset) == 50 and subset == load_demos(kb / "demos.jsonl", num_demos=50, seed=3)
    assert subset != load_demos(kb / "demos.jsonl", num_demos=50, seed=4)
    assert all(demo in all_demos for demo in subset)
    assert len(load_demos(kb / "demos.jsonl", num_demos=10**6)) == len(all_demos)
    with pytest.raises(FileNotFoundError, match="tandem prepare kb"):
        load_demos(kb / "missing.jsonl")


def test_load_demos_per_source_mix(kb):
    all_demos = load_demos(kb / "demos.jsonl")
    sources = sorted({demo["data_source"] for demo in all_demos})
    assert sources == ["kb_1hop", "kb_2hop"]
    mix = load_demos(kb / "demos.jsonl", seed=2, per_source={"kb_1hop": 5, "kb_2hop": 30})
    counts = {s: sum(d["data_source"] == s for d in mix) for s in sources}
    assert counts == {"kb_1hop": 5, "kb_2hop": 30}
    assert mix == load_demos(kb / "demos.jsonl", seed=2, per_source={"kb_2hop": 30, "kb_1hop": 5})
    only = load_demos(kb / "demos.jsonl", per_source={"kb_2hop": 10**6})
    assert len(only) == sum(d["data_source"] == "kb_2hop" for d in all_demos)
    with pytest.raises(ValueError, match=r"\['kb_3hop'\].*kb_1hop"):
        load_demos(kb / "demos.jsonl", per_source={"kb_3hop": 4})


def test_sft_config_per_source_mix_errors():
    from tandemrl.config.errors import ConfigError
    from tandemrl.config.loader import load_config

    config = load_config(None, ["actor.sft.num_demos_per_source.kb_2hop=40"])
    assert config.actor.sft.num_demos_per_source == {"kb_2hop": 40}
    with pytest.raises(ConfigError, match="num_demos_per_source.kb_1hop=-1"):
        load_config(None, ["actor.sft.num_demos_per_source.kb_1hop=-1"])
    with pytest.raises(ConfigError, match="cannot be combined"):
        load_config(None, ["actor.sft.num_demos=10", "actor.sft.num_demos_per_source.kb_1hop=3"])
