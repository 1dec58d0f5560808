"""Block pool, scheduler and stop conditions, without a model (the real SmolLM2 tokenizer for stops)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tandemrl.engine.attention import build_metadata
from tandemrl.engine.kv_cache import BlockManager
from tandemrl.engine.scheduler import Scheduler
from tandemrl.engine.sequence import SamplingParams, Sequence, Status
from tandemrl.engine.stops import StopChecker


def seq(rid: str, num_prompt: int, max_new: int = 8, **params) -> Sequence:
    return Sequence(
        rid, list(range(3, 3 + num_prompt)), SamplingParams(max_new_tokens=max_new, **params), 4096
    )


def test_block_manager_allocates_and_frees():
    blocks = BlockManager(num_blocks=4, block_size=16)
    table: list[int] = []
    blocks.allocate(table, 17)
    assert len(table) == 2 and blocks.num_free_blocks == 2
    blocks.allocate(table, 32)  # still fits in two blocks
    assert len(table) == 2
    assert not blocks.can_allocate(table, 65)
    blocks.free(table)
    assert table == [] and blocks.num_free_blocks == 4


def run(batch: list[Sequence]) -> None:
    """What the runner and engine do to a launched step's sequences (tokens cached, chunk mark cleared)."""
    for s in batch:
        s.num_cached_tokens, s.chunk_end = s.step_end, None


def test_scheduler_respects_running_limit_and_prefill_budget():
    scheduler = Scheduler(BlockManager(64, 16), max_running_requests=3, max_prefill_tokens=50)
    for i, n in enumerate([30, 30, 10, 10]):
        scheduler.add(seq(str(i), n))
    batch, is_prefill = scheduler.schedule()
    assert is_prefill and [s.rid for s in batch] == ["0", "1"]  # "1" gets what is left of the 50
    assert [s.chunk_end for s in batch] == [None, 20] and scheduler.prefilling is batch[1]
    run(batch)
    batch, is_prefill = scheduler.schedule()
    assert not is_prefill and [s.rid for s in batch] == ["0"]  # a chunk ran: decode before the next
    run(batch)
    batch, is_prefill = scheduler.schedule()
    assert is_prefill and [s.rid for s in batch] == ["1", "2"]  # 10 + 10; the running limit (3) stops "3"
    assert batch[0].chunk_end is None and scheduler.prefilling is None
    run(batch)
    batch, is_prefill = scheduler.schedule()
    assert not is_prefill and len(batch) == 3 and [s.rid for s in scheduler.waiting] == ["3"]


def test_decode_retracts_newest_when_out_of_blocks():
    scheduler = Scheduler(BlockManager(3, 4), max_running_requests=4, max_prefill_tokens=100)
    a, b = seq("a", 4), seq("b", 4)
    scheduler.add(a)
    scheduler.add(b)
    batch, _ = scheduler.schedule()
    assert len(batch) == 2 and scheduler.blocks.num_free_blocks == 1
    for s in batch:
        s.num_cached_tokens = s.num_tokens
        s.append(99, -1.0, 0)  # each now needs a second block; only one is free
    batch, is_prefill = scheduler.schedule()
    assert not is_prefill and batch == [a]
    assert list(scheduler.waiting) == [b] and b.block_table == [] and b.num_cached_tokens == 0
    assert b.output_ids == [99] and b.num_retractions == 1 and scheduler.num_preemptions == 1


def test_retract_all_keeps_order_and_tokens():
    scheduler = Scheduler(BlockManager(16, 4), max_running_requests=8, max_prefill_tokens=100)
    seqs = [seq(str(i), 3) for i in range(3)]
    for s in seqs:
        scheduler.add(s)
    scheduler.schedule()
    assert scheduler.retract_all() == 3
    assert list(scheduler.waiting) == seqs and all(s.status is Status.WAITING for s in seqs)
    assert scheduler.blocks.num_free_blocks == 16


def step(scheduler: Scheduler) -> tuple[list[str], bool]:
    """One scheduled step, run: a step that samples appends a token to each request it completes."""
    batch, is_prefill = scheduler.schedule()
    run(batch)
    for s in batch:
        s.append(7, -1.0, 0)
    return [s.rid for s in batch], is_prefill


def decoding(scheduler: Scheduler, *rids: str) -> None:
    for rid in rids:
        scheduler.add(seq(rid, 4, max_new=64))
    assert step(scheduler) == (list(rids), True)


def test_prefill_delay_holds_a_waiting_request_for_n_decode_steps():
    for delay in (0, 1, 3):
        scheduler = Scheduler(BlockManager(64, 16), 8, max_prefill_tokens=100, prefill_delay_steps=delay)
        decoding(scheduler, "a", "b")
        scheduler.add(seq("c", 4))
        kinds = [step(scheduler) for _ in range(delay + 1)]
        assert kinds[:delay] == [(["a", "b"], False)] * delay, delay  # held: the others decode
        assert kinds[delay] == (["c"], True), delay
        assert scheduler.num_held_steps == 0
        # the count starts again: a request arriving later is held as long
        scheduler.add(seq("d", 4))
        assert [step(scheduler)[1] for _ in range(delay + 1)] == [False] * delay + [True]


def test_held_requests_go_at_once_when_they_fill_a_step_or_nothing_decodes():
    # the waiting tokens fill max_prefill_tokens
    scheduler = Scheduler(BlockManager(64, 16), 8, max_prefill_tokens=10, prefill_delay_steps=5)
    decoding(scheduler, "a")
    scheduler.add(seq("b", 6))
    assert step(scheduler) == (["a"], False)  # 6 tokens wait: held
    scheduler.add(seq("c", 6))
    assert step(scheduler) == (["b", "c"], True)  # 12 >= 10: no more holding (c gets a chunk)
    # as many wait as there are free running slots
    scheduler = Scheduler(BlockManager(64, 16), 3, max_prefill_tokens=100, prefill_delay_steps=5)
    decoding(scheduler, "a")
    scheduler.add(seq("b", 4))
    assert step(scheduler) == (["a"], False)
    scheduler.add(seq("c", 4))
    assert step(scheduler) == (["b", "c"], True)
    # nothing can decode: the waiting request is prefilled at once
    scheduler = Scheduler(BlockManager(64, 16), 8, max_prefill_tokens=100, prefill_delay_steps=5)
    scheduler.add(seq("a", 4, max_new=1))
    assert step(scheduler) == (["a"], True)  # its one token is its last: it cannot decode
    scheduler.add(seq("b", 4))
    assert step(scheduler) == (["b"], True)


def test_prefill_delay_steps_is_bounded():
    from tandemrl.config.engine import EngineOptions
    from tandemrl.config.errors import ConfigError

    assert EngineOptions(prefill_delay_steps=8).prefill_delay_steps == 8
    for bad in (-1, 10_000):
        with pytest.raises(ConfigError, match="rollout.engine.prefill_delay_steps"):
            EngineOptions(prefill_delay_steps=bad)


def test_attention_metadata_masks_and_slots():
    meta = build_metadata(
        query_lens=[3, 1], context_lens=[3, 6], block_tables=[[2], [0, 5]], block_size=4, device="cpu"
    )
    assert meta.slot_mapping_T.tolist() == [8, 9, 10, 21]  # seq 2's 6th token: block 5, offset 1
    assert meta.last_token_index.tolist() == [2, 3]
    mask = meta.attn_mask_B1QL[:, 0]
    assert mask[0, :3, :3].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert mask[1, 0].tolist() == [True] * 6  # decode sees its whole context
    assert meta.gather_slots_BL[1].tolist() == [0, 1, 2, 3, 20, 21]


@pytest.fixture(scope="module")
def stops(smollm2_dir) -> StopChecker:
    return StopChecker(AutoTokenizer.from_pretrained(smollm2_dir), eos_ids={2})


def test_stop_string_token_id_eos_and_length(stops):
    tokenizer = stops.tokenizer
    s = seq("s", 2, max_new=50, stop=["</search>"])
    ids = tokenizer.encode("I will look it up <search> capital of France </search> and more")
    for token in ids:
        s.append(token, 0.0, 0)
        reason = stops.check(s)
        if reason:
            break
    assert reason == {"type": "stop", "matched": "</search>"}
    assert tokenizer.decode(s.output_ids).endswith("</search>")
    s.finish_reason = reason
    assert stops.output_text(s) == "I will look it up <search> capital of France "

    s = seq("t", 2, stop_token_ids=[7])
    s.append(7, 0.0, 0)
    assert stops.check(s) == {"type": "stop", "matched": 7}
    s = seq("e", 2)
    s.append(2, 0.0, 0)
    assert stops.check(s) == {"type": "stop", "matched": 2}
    s = seq("i", 2, max_new=2, ignore_eos=True)
    s.append(2, 0.0, 0)
    assert stops.check(s) is None
    s.append(5, 0.0, 0)
    assert stops.check(s) == {"type": "length", "length": 2}


def _naive_stop(stops: StopChecker, s) -> dict | None:
    """The check without the prefilter: decode the tail after every token."""
    longest = max(len(x) for x in s.params.stop)
    tail = stops.tokenizer.decode(s.output_ids[-(longest + 1) :])
    return next(({"type": "stop", "matched": x} for x in s.params.stop if x in tail), None)


@pytest.mark.parametrize(
    "stop_strings",
    [["</search>", "</answer>"], ["é!", "ü"], ["\n\n"], ["ab", "😀"], ["日本"]],
)
def test_stop_prefilter_matches_the_full_tail_decode(stops, stop_strings):
    """The prefilter decodes the tail only for tokens that may complete a stop string; on text that holds
    the stops (ASCII, accents, emoji split over byte tokens, CJK) and on random token ids it stops at the
    same token as decoding the tail after every token, and it skips most decodes."""
    import random

    tokenizer = stops.tokenizer
    rng = random.Random(7)
    pieces = [
        "plain words ",
        "<search> q </search>",
        " 日本語 ",
        "😀 ",
        "ab",
        "é!",
        "ü",
        "\n\n",
        "x</answer>",
    ]
    sequences = [tokenizer.encode("".join(rng.choice(pieces) for _ in range(12))) for _ in range(40)]
    sequences += [[rng.randrange(len(tokenizer)) for _ in range(60)] for _ in range(40)]
    num_checks, decodes_before = 0, stops.num_tail_decodes
    for ids in sequences:
        fast = seq("f", 2, max_new=10_000, stop=stop_strings, ignore_eos=True)
        expected_at = next(
            (i for i in range(len(ids)) if _naive_stop(stops, _prefix_seq(ids[: i + 1], stop_strings))), None
        )
        found_at = None
        for i, token in enumerate(ids):
            fast.append(token, 0.0, 0)
            num_checks += 1
            if stops.check(fast) is not None:
                found_at = i
                break
        assert found_at == expected_at, (stop_strings, ids)
    assert stops.num_tail_decodes - decodes_before < num_checks / 2


def _prefix_seq(ids, stop_strings):
    s = seq("n", 2, max_new=10_000, stop=stop_strings, ignore_eos=True)
    for token in ids:
        s.append(token, 0.0, 0)
    return s
