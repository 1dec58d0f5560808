"""Chunked prefill on the CPU reference runner: a prefill step forwards at most `max_prefill_tokens`
tokens, a longer prompt goes on in later steps, and decode steps alternate with its chunks. Greedy tokens
equal (logprobs to fp32 rounding) an engine whose budget fits every prompt in one step, with and without
overlapped steps, through retraction, aborts and prefix reuse."""

from __future__ import annotations

import math

import pytest
import torch

from tandemrl.engine.engine import Engine, EngineConfig
from tandemrl.engine.kv_cache import BlockManager
from tandemrl.engine.scheduler import Scheduler
from tandemrl.engine.sequence import SamplingParams, Sequence, Status
from tests.unit import engine_helpers
from tests.unit.engine_helpers import Work

BUDGET = 16
UNCHUNKED = 4096  # every prompt here fits in one prefill step


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def make_engine(model_dir, budget: int = BUDGET, overlap: bool = False, **overrides) -> Engine:
    config = dict(
        max_running_requests=8, max_context_len=256, max_prefill_tokens=budget, overlap_steps=overlap
    )
    return Engine(EngineConfig(str(model_dir), **(config | overrides)))


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(max_new_tokens: int = 8, **params) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True, **params)


def step(engine: Engine, trace: list[tuple[str, int]]) -> list[Sequence]:
    """One engine step, recording its kind and number of tokens in `trace`; checks that the engine's
    counters count exactly the tokens the model was given."""
    num_prefill, num_decode = engine.num_prefill_tokens, engine.num_decode_tokens
    forwarded: list[int] = []
    hook = engine.model.register_forward_pre_hook(lambda model, args: forwarded.append(len(args[0])))
    try:
        finished = engine.step()
    finally:
        hook.remove()
    num_prefill, num_decode = engine.num_prefill_tokens - num_prefill, engine.num_decode_tokens - num_decode
    assert len(forwarded) <= 1 and sum(forwarded) == num_prefill + num_decode
    if num_prefill:
        trace.append(("prefill", num_prefill))
    elif num_decode:
        trace.append(("decode", num_decode))
    return finished


def serve(engine: Engine, work: Work) -> tuple[dict[str, Sequence], list[tuple[str, int]]]:
    """`engine_helpers.serve`, stepping through `step`: the finished sequences and the steps' trace."""
    trace: list[tuple[str, int]] = []
    return engine_helpers.serve(engine, work, step=lambda engine: step(engine, trace)), trace


def assert_same(got: dict[str, Sequence], want: dict[str, Sequence]) -> None:
    assert sorted(got) == sorted(want)
    for rid, seq in want.items():
        assert got[rid].output_ids == seq.output_ids, rid
        assert got[rid].finish_reason == seq.finish_reason, rid
        assert got[rid].output_logprobs == pytest.approx(seq.output_logprobs, abs=1e-5), rid


def test_a_long_prompt_takes_ceil_len_over_budget_prefill_steps(tiny_llama_dir):
    chunked, unchunked = make_engine(tiny_llama_dir), make_engine(tiny_llama_dir, budget=UNCHUNKED)
    for length in (BUDGET + 1, 6 * BUDGET, 100):  # a one-token last chunk, an exact multiple, a ragged one
        work = {f"p{length}": (prompt(length, seed=length), greedy())}
        done, trace = serve(chunked, work)
        prefills = [n for kind, n in trace if kind == "prefill"]
        assert len(prefills) == math.ceil(length / BUDGET) and sum(prefills) == length
        assert all(n == BUDGET for n in prefills[:-1])
        assert_same(done, serve(unchunked, work)[0])


def test_requests_over_the_budget_are_split_across_steps(tiny_llama_dir):
    lengths = [10, 40, 7, 25, 33, 12]
    work = {str(i): (prompt(n, seed=i), greedy()) for i, n in enumerate(lengths)}
    work["empty"] = (prompt(120, seed=99), greedy(max_new_tokens=0))  # answered without a forward
    done, trace = serve(make_engine(tiny_llama_dir), work)
    prefills = [n for kind, n in trace if kind == "prefill"]
    assert max(prefills) == BUDGET and sum(prefills) == sum(lengths)  # packed to the budget, never over
    assert done["empty"].output_ids == [] and done["empty"].finish_reason["type"] == "length"
    assert_same(done, serve(make_engine(tiny_llama_dir, budget=UNCHUNKED), work)[0])


def test_decode_steps_alternate_with_the_chunks_of_a_long_prompt(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    running = engine.add_request("running", prompt(8, seed=1), greedy(max_new_tokens=40))
    trace: list[tuple[str, int]] = []
    step(engine, trace)
    long = engine.add_request("long", prompt(100, seed=2), greedy())
    num_outputs = []
    while not long.output_ids:
        step(engine, trace)
        num_outputs.append(len(running.output_ids))
    chunks = [("prefill", BUDGET), ("decode", 1)] * 6 + [("prefill", 100 - 6 * BUDGET)]
    assert trace == [("prefill", 8), *chunks]
    assert num_outputs == [1 + i // 2 for i in range(1, 14)]  # one more token after every decode step
    while engine.has_work():
        engine.step()
    alone = serve(
        make_engine(tiny_llama_dir, budget=UNCHUNKED), {"running": (running.prompt_ids, greedy(40))}
    )
    assert running.output_ids == alone[0]["running"].output_ids


@pytest.mark.parametrize("kv_cache_gb", [None, 1e-6])  # 1e-6: the smallest cache, retracts mid-run
def test_overlapped_steps_equal_serial_steps_with_chunks(tiny_llama_dir, kv_cache_gb, monkeypatch):
    partial_retracted_by: list[Scheduler] = []  # the scheduler of each retraction of a partial request
    to_waiting = Scheduler._to_waiting

    def spied_to_waiting(self, seq):
        if seq is self.prefilling:
            partial_retracted_by.append(self)
        to_waiting(self, seq)

    monkeypatch.setattr(Scheduler, "_to_waiting", spied_to_waiting)
    lengths = [30, 45, 12, 60, 25, 50, 18, 40]
    work = {str(i): (prompt(n, seed=10 + i), greedy(30 + i)) for i, n in enumerate(lengths)}
    serial_engine = make_engine(tiny_llama_dir, kv_cache_gb=kv_cache_gb, block_size=4)
    overlapped_engine = make_engine(tiny_llama_dir, overlap=True, kv_cache_gb=kv_cache_gb, block_size=4)
    serial, serial_trace = serve(serial_engine, work)
    overlapped, overlapped_trace = serve(overlapped_engine, work)
    assert_same(overlapped, serial)
    assert_same(serial, serve(make_engine(tiny_llama_dir, budget=UNCHUNKED), work)[0])
    assert max(n for kind, n in serial_trace + overlapped_trace if kind == "prefill") == BUDGET
    if kv_cache_gb:
        for engine in (serial_engine, overlapped_engine):
            assert engine.scheduler.num_preemptions > 0 and engine.scheduler in partial_retracted_by


def test_decode_under_kv_pressure_retracts_a_partial_request_to_zero_cached_tokens():
    scheduler = Scheduler(BlockManager(6, 4), max_running_requests=4, max_prefill_tokens=8)
    short = Sequence("short", [5, 6, 7, 8], greedy(), 4096)
    long = Sequence("long", list(range(3, 23)), greedy(), 4096)
    scheduler.add(short)
    scheduler.add(long)
    batch, is_prefill = scheduler.schedule()
    assert is_prefill and batch == [short, long] and long.chunk_end == 4  # 4 tokens + a chunk of 4
    assert scheduler.blocks.num_free_blocks == 0  # long holds the blocks of all its 20 tokens
    for seq in batch:  # what the runner and the engine do with the launched step
        seq.num_cached_tokens, seq.chunk_end = seq.step_end, None
    short.append(99, -1.0, 0)  # short's next token opens a block, and none is free
    batch, is_prefill = scheduler.schedule()
    assert not is_prefill and batch == [short] and scheduler.num_preemptions == 1
    assert list(scheduler.waiting) == [long] and long.status is Status.WAITING
    assert long.num_cached_tokens == 0 and long.block_table == [] and scheduler.prefilling is None
    scheduler.finish(short, {"type": "stop"})
    batch, is_prefill = scheduler.schedule()
    assert is_prefill and batch == [long] and long.chunk_end == 8  # from its first token again


@pytest.mark.parametrize("overlap", [False, True])
def test_retract_all_restarts_a_partial_request_from_its_first_token(tiny_llama_dir, overlap):
    engine = make_engine(tiny_llama_dir, overlap=overlap, enable_prefix_caching=False)
    work = {"short": (prompt(8, seed=3), greedy(12)), "long": (prompt(70, seed=4), greedy())}
    for rid, (ids, params) in work.items():
        engine.add_request(rid, ids, params)
    long = engine.requests["long"]
    for _ in range(3):  # short's 8 tokens + a chunk of 8, a decode, a chunk of 16
        engine.step()
    assert engine.scheduler.prefilling is long and long.num_cached_tokens == 24
    engine.retract_all()
    assert long.status is Status.WAITING and long.num_cached_tokens == 0 and long.block_table == []
    assert engine.scheduler.prefilling is None
    num_prefill, num_short = engine.num_prefill_tokens, engine.requests["short"].num_tokens
    done = {}
    while engine.has_work():
        done |= {seq.rid: seq for seq in engine.step()}
    assert engine.num_prefill_tokens - num_prefill == num_short + 70  # all of long again
    assert_same(done, serve(make_engine(tiny_llama_dir, budget=UNCHUNKED), work)[0])
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize("overlap", [False, True])
def test_an_aborted_partial_request_leaves_its_computed_blocks_cached(tiny_llama_dir, overlap):
    engine = make_engine(tiny_llama_dir, overlap=overlap, block_size=4)
    short_work = {"short": (prompt(8, seed=5), greedy(12))}
    long_ids = prompt(100, seed=6)
    engine.add_request("short", *short_work["short"])
    long = engine.add_request("long", long_ids, greedy())
    for _ in range(3):  # short's 8 tokens + a chunk of 8, a decode, a chunk of 16
        engine.step()
    aborted = engine.abort("long")
    assert aborted is long and long.finish_reason["type"] == "abort" and not long.output_ids
    assert engine.scheduler.prefilling is None and long.num_cached_tokens == 24
    done = {}
    while engine.has_work():
        done |= {seq.rid: seq for seq in engine.step()}
    assert_same(done, serve(make_engine(tiny_llama_dir, budget=UNCHUNKED), short_work)[0])
    # The 24 tokens computed before the abort (6 full blocks) serve a resend of the same prompt.
    num_hit = engine.scheduler.num_prefix_hit_tokens
    resent, trace = serve(engine, {"again": (long_ids, greedy())})
    assert engine.scheduler.num_prefix_hit_tokens - num_hit == 24
    prefills = [n for kind, n in trace if kind == "prefill"]
    assert prefills == [BUDGET] * 4 + [76 - 4 * BUDGET] and len(trace) == 5 + 7  # 7 decodes: 8 tokens
    unchunked = serve(make_engine(tiny_llama_dir, budget=UNCHUNKED), {"again": (long_ids, greedy())})[0]
    assert_same(resent, unchunked)


def test_prefix_reuse_with_chunks(tiny_llama_dir):
    """A resent context: its cached prefix is matched at admission, the rest is prefilled in chunks."""
    chunked = make_engine(tiny_llama_dir, block_size=4)
    unchunked = make_engine(tiny_llama_dir, budget=UNCHUNKED, block_size=4)
    contexts = {"a": prompt(50, seed=7), "b": prompt(90, seed=8)}
    for turn in range(3):
        work = {f"{rid}{turn}": (ids, greedy()) for rid, ids in contexts.items()}
        done, trace = serve(chunked, work)
        assert_same(done, serve(unchunked, work)[0])
        assert max(n for kind, n in trace if kind == "prefill") == BUDGET
        for rid in contexts:
            contexts[rid] = contexts[rid] + done[f"{rid}{turn}"].output_ids + prompt(30, seed=turn)
    assert chunked.scheduler.num_prefix_hit_tokens == unchunked.scheduler.num_prefix_hit_tokens > 0
    assert chunked.num_prefill_tokens == unchunked.num_prefill_tokens


def test_the_prefill_budget_must_be_positive(tiny_llama_dir):
    with pytest.raises(ValueError, match="rollout.engine.max_prefill_tokens=0: must be a finite number > 0"):
        EngineConfig(str(tiny_llama_dir), max_prefill_tokens=0)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_prefill_delay_batches_arrivals_and_changes_no_token(tiny_llama_dir, overlap):
    """Requests arriving one every two steps beside long decodes: held for up to 6 decode steps, they
    share prefill steps (fewer of them), and every request's greedy tokens are those of the undelayed
    engine."""
    runs = {}
    for delay in (0, 6):
        engine = make_engine(tiny_llama_dir, UNCHUNKED, overlap, prefill_delay_steps=delay)
        engine.add_request("long", prompt(12, 99), greedy(40))
        arrivals = {2 * i + 1: (f"r{i}", prompt(5 + i, i)) for i in range(8)}
        done: dict[str, Sequence] = {}
        trace: list[tuple[str, int]] = []
        num_steps = 0
        while engine.has_work() or any(n > num_steps for n in arrivals):
            if num_steps in arrivals:
                rid, ids = arrivals[num_steps]
                engine.add_request(rid, ids, greedy(6))
            done |= {seq.rid: seq for seq in step(engine, trace)}
            num_steps += 1
        assert len(done) == 9 and engine.blocks.num_free_blocks == engine.blocks.num_blocks
        runs[delay] = (done, sum(kind == "prefill" for kind, _ in trace))
    assert_same(runs[6][0], runs[0][0])
    assert runs[0][1] == 9  # undelayed: every arrival gets its own prefill step
    assert runs[6][1] <= 4, runs[6][1]  # held for 6 decode steps, arrivals every 2 share a step
