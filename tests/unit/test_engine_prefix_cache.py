"""Prefix reuse (issue 9) on CPU: block bookkeeping, multi-turn prefill savings, identical greedy outputs,
and reuse of K/V computed under older weights only within `prefix_cache_max_age` weight updates."""

from __future__ import annotations

import random

import pytest
import torch

from tandemrl.engine.engine import Engine, EngineConfig
from tandemrl.engine.prefix_cache import PrefixCachingBlockManager, PrefixCachingScheduler
from tandemrl.engine.sequence import SamplingParams, Sequence

BLOCK = 4


def _seq(ids: list[int]) -> Sequence:
    return Sequence(rid="r", prompt_ids=list(ids), params=SamplingParams(), max_total_len=1000)


def _computed(blocks: PrefixCachingBlockManager, seq: Sequence) -> None:
    """As a step does: all of `seq`'s tokens get K/V, then its full blocks are registered."""
    blocks.allocate(seq.block_table, seq.num_tokens)
    seq.num_cached_tokens = seq.num_tokens
    blocks.register(seq)


def _run_across_an_update(max_age: int) -> PrefixCachingBlockManager:
    """A request admitted and prefilled, a weight update (in_place: it keeps its K/V), then 7 decode steps
    to its finish; returns the block manager it ran on (8 blocks)."""
    blocks = PrefixCachingBlockManager(num_blocks=8, block_size=BLOCK, max_age=max_age)
    scheduler = PrefixCachingScheduler(blocks, max_running_requests=4, max_prefill_tokens=64)
    seq = _seq(list(range(3)))
    scheduler.add(seq)
    scheduler.schedule()
    seq.num_cached_tokens = seq.num_tokens
    blocks.next_epoch()  # in_place update while `seq` runs
    for token in range(3, 10):
        seq.append(token, 0.0, 1)
        blocks.allocate(seq.block_table, seq.num_tokens)
        seq.num_cached_tokens = seq.num_tokens
        scheduler.after_step([seq])
    scheduler.finish(seq, {"type": "length"})
    return blocks


def test_blocks_are_matched_shared_and_evicted_lru():
    blocks = PrefixCachingBlockManager(num_blocks=6, block_size=BLOCK)
    first = _seq(list(range(10)))
    _computed(blocks, first)  # 3 blocks, the last one partial
    blocks.free(first.block_table)
    assert blocks.num_cached_blocks == 2 and blocks.num_free_blocks == 6
    second = _seq(list(range(9)) + [99])
    assert blocks.match_prefix(second) == 8  # both full blocks
    third = _seq(list(range(8)))  # fully cached prompt: the last block is recomputed, not shared
    assert blocks.match_prefix(third) == 4
    assert blocks.ref_counts[second.block_table[0]] == 2
    other = _seq([50, 51, 52, 53, 54])
    assert blocks.match_prefix(other) == 0
    blocks.allocate(other.block_table, 16)  # every unreferenced block; the shared cached ones stay
    assert blocks.num_free_blocks == 0 and blocks.num_cached_blocks == 2
    blocks.free(other.block_table)
    blocks.free(third.block_table)
    blocks.free(second.block_table)
    taken: list[int] = []
    blocks.allocate(taken, 6 * BLOCK)  # now the cached blocks are evicted
    assert blocks.num_cached_blocks == 0 and sorted(taken) == list(range(6))


def test_at_age_0_an_update_never_registers_blocks_of_older_weights():
    blocks = PrefixCachingBlockManager(num_blocks=8, block_size=BLOCK, max_age=0)
    running = _seq(list(range(12)))
    blocks.match_prefix(running)
    blocks.allocate(running.block_table, 12)
    blocks.next_epoch()  # a weight update while `running` holds its KV (in_place)
    running.num_cached_tokens = 12
    blocks.register(running)
    blocks.free(running.block_table)
    assert blocks.num_cached_blocks == 0 and blocks.num_free_blocks == 8
    assert blocks.match_prefix(_seq(list(range(12)))) == 0


def test_full_blocks_are_shared_while_their_request_runs_and_hashed_once():
    blocks = PrefixCachingBlockManager(num_blocks=8, block_size=BLOCK)
    running = _seq(list(range(6)))
    _computed(blocks, running)  # one full block, one partial
    assert blocks.num_cached_blocks == 1 and running.block_hashes and len(running.block_hashes) == 1
    for token in (6, 7, 8):  # decode: the second block fills once token 7 is known and computed
        running.append(token, 0.0, 0)
        blocks.allocate(running.block_table, running.num_tokens)
        running.num_cached_tokens = running.num_tokens
        blocks.register(running)
    assert blocks.num_cached_blocks == 2 and len(running.block_hashes) == 2
    first_hash = running.block_hashes[0]
    follower = _seq(list(range(9)) + [50])
    assert blocks.match_prefix(follower) == 8  # shares the running request's two full blocks
    assert follower.block_table == running.block_table[:2]
    assert blocks.ref_counts[running.block_table[0]] == 2
    assert running.block_hashes[0] == first_hash and follower.block_hashes[:2] == running.block_hashes[:2]


def test_a_pending_token_is_not_hashed_until_known():
    blocks = PrefixCachingBlockManager(num_blocks=8, block_size=BLOCK)
    seq = _seq(list(range(7)))
    _computed(blocks, seq)
    seq.num_pending = 1  # the 8th token's K/V is being computed, its id is not read yet
    blocks.allocate(seq.block_table, seq.num_tokens)
    seq.num_cached_tokens = seq.num_tokens
    blocks.register(seq)
    assert blocks.num_cached_blocks == 1
    seq.num_pending = 0
    seq.append(7, 0.0, 0)
    blocks.register(seq)
    assert blocks.num_cached_blocks == 2


def test_a_table_held_across_a_weight_update_is_never_cached_again():
    """At age 0, blocks allocated after the update attend to the old weights' K/V: none may be matched."""
    blocks = _run_across_an_update(max_age=0)
    assert blocks.num_cached_blocks == 0
    assert blocks.match_prefix(_seq(list(range(10)))) == 0


def test_a_waiting_request_matches_only_when_admitted():
    """Regression: matching every admissible request before admitting any let a later request's match pin
    the cached blocks the head of the queue needed, and with nothing running the engine stalled."""
    blocks = PrefixCachingBlockManager(num_blocks=6, block_size=BLOCK)
    scheduler = PrefixCachingScheduler(blocks, max_running_requests=4, max_prefill_tokens=64)
    done = _seq(list(range(16)))
    _computed(blocks, done)
    blocks.free(done.block_table)  # 4 cached blocks, 2 free
    head = Sequence(rid="head", prompt_ids=list(range(100, 120)), params=SamplingParams(), max_total_len=99)
    behind = Sequence(
        rid="behind", prompt_ids=list(range(16)) + [99], params=SamplingParams(), max_total_len=99
    )
    scheduler.add(head)  # needs 5 blocks: the 2 free ones and 3 evicted from the cache
    scheduler.add(behind)  # would match all 4 cached blocks
    batch, is_prefill = scheduler.schedule()
    assert is_prefill and batch == [head]
    assert behind.block_table == [] and behind.num_cached_tokens == 0  # waiting requests hold no blocks


def _run(engine: Engine, prompts: dict[str, list[int]], max_new_tokens: int) -> dict[str, list[int]]:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    outputs = {}
    while engine.has_work():
        for seq in engine.step():
            outputs[seq.rid] = seq.output_ids
    return outputs


def _multi_turn(engine: Engine, num_trajectories: int = 4, num_turns: int = 3) -> dict[str, list[int]]:
    """Agent-like turns: each turn resends the whole context plus an information block."""
    rng = random.Random(0)
    contexts = {
        f"t{i}": [rng.randrange(100, 5000) for _ in range(30 + 7 * i)] for i in range(num_trajectories)
    }
    for turn in range(num_turns):
        outputs = _run(engine, {f"{rid}-{turn}": ids for rid, ids in contexts.items()}, max_new_tokens=6)
        for rid in contexts:
            info = [rng.randrange(100, 5000) for _ in range(25)]
            contexts[rid] = contexts[rid] + outputs[f"{rid}-{turn}"] + info
    return contexts


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    def make(prefix: bool, max_age: int = 1) -> Engine:
        return Engine(
            EngineConfig(
                str(tiny_llama_dir),
                max_context_len=512,
                max_running_requests=8,
                block_size=BLOCK,
                enable_prefix_caching=prefix,
                prefix_cache_max_age=max_age,
            )
        )

    return make(True), make(False), make(True, max_age=0)


def test_multi_turn_reuse_cuts_prefill_and_keeps_greedy_outputs(engines):
    with_reuse, without, _ = engines

    def counters() -> tuple[int, int, int]:  # the module's engines also serve other tests: count from here
        return (
            with_reuse.num_prefill_tokens,
            without.num_prefill_tokens,
            with_reuse.scheduler.num_prefix_hit_tokens,
        )

    start = counters()
    contexts_reuse = _multi_turn(with_reuse)
    contexts_plain = _multi_turn(without)
    prefill_reuse, prefill_plain, hits = (now - then for now, then in zip(counters(), start, strict=True))
    assert contexts_reuse == contexts_plain  # every turn's greedy output identical
    assert prefill_reuse < 0.6 * prefill_plain
    assert hits == prefill_plain - prefill_reuse


def _update(engine: Engine, version: int | None = None) -> None:
    weights = [(name, p.detach().clone()) for name, p in engine.model.named_parameters()]
    with torch.no_grad():
        engine.load_weights(weights, version)


def _prefilled(engine: Engine, rid: str, prompt: list[int]) -> int:
    before = engine.num_prefill_tokens
    _run(engine, {rid: prompt}, max_new_tokens=2)
    return engine.num_prefill_tokens - before


def test_at_age_0_a_weight_update_drops_cached_prefixes(engines):
    engine = engines[2]
    prompt = list(range(200, 240))
    _run(engine, {"a": prompt}, max_new_tokens=2)
    assert _prefilled(engine, "b", prompt) < len(prompt)  # reused
    _update(engine)
    assert _prefilled(engine, "c", prompt) == len(prompt)  # recomputed under the new weights


def test_at_age_1_a_prefix_serves_across_one_update_not_two(engines):
    engine = engines[0]
    prompt = list(range(300, 340))
    _run(engine, {"a": prompt}, max_new_tokens=2)
    stale_before = engine.blocks.num_stale_hit_tokens
    _update(engine)
    assert _prefilled(engine, "b", prompt) < len(prompt)  # the previous weights' K/V served
    assert engine.blocks.num_stale_hit_tokens - stale_before == 36  # the 9 full blocks before the last token
    _update(engine)
    assert _prefilled(engine, "c", prompt) == len(prompt)  # two updates old: recomputed
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks  # nothing held, nothing lost
    engine.restart_version_order()  # a trainer resumed from an older checkpoint joins anew
    _update(engine, 0)  # the version goes back (a trainer resumed from an older checkpoint): nothing kept
    assert _prefilled(engine, "d", prompt) == len(prompt)


def test_a_chain_is_as_old_as_its_oldest_block():
    """A request that matched blocks of the previous weights caches its new blocks with their epoch: one
    more update and all of them are too old, and every block comes back free."""
    blocks = PrefixCachingBlockManager(num_blocks=12, block_size=BLOCK, max_age=1)
    first = _seq(list(range(9)))
    blocks.match_prefix(first)
    _computed(blocks, first)  # 2 full blocks at epoch 0
    blocks.free(first.block_table)
    blocks.next_epoch()
    second = _seq(list(range(17)))
    assert blocks.match_prefix(second) == 8 and second.kv_epoch == 0
    _computed(blocks, second)  # its blocks 3 and 4 attend to epoch-0 K/V
    blocks.free(second.block_table)
    assert blocks.num_cached_blocks == 4 and set(blocks.block_epoch.values()) == {0}
    fresh = _seq([90 + i for i in range(9)])
    blocks.match_prefix(fresh)
    _computed(blocks, fresh)  # epoch 1
    blocks.free(fresh.block_table)
    blocks.next_epoch()  # epoch 2: the epoch-0 chain goes, the epoch-1 blocks stay
    assert blocks.match_prefix(_seq(list(range(17)))) == 0
    kept = _seq([90 + i for i in range(9)])
    assert blocks.match_prefix(kept) == 8
    blocks.free(kept.block_table)
    assert blocks.num_cached_blocks == 2 and blocks.num_free_blocks == 12


def test_a_table_held_across_an_update_keeps_caching_within_the_age():
    """in_place at age 1: a request running across one update caches its later blocks (old K/V, as in_place
    keeps), which serve until the next update."""
    blocks = _run_across_an_update(max_age=1)
    assert blocks.num_cached_blocks == 2
    probe = _seq(list(range(10)))
    assert blocks.match_prefix(probe) == 8
    blocks.free(probe.block_table)
    blocks.next_epoch()
    assert blocks.match_prefix(_seq(list(range(10)))) == 0
    assert blocks.num_free_blocks == 8
