"""Overlapped steps (the CUDA runner's default) on the CPU reference runner: scheduling step n+1 before
step n is postprocessed changes nothing a client sees. Greedy outputs, logprobs, weight versions and
finish reasons equal the one-step-at-a-time engine's, through stop tokens, length limits, retraction
under KV pressure and prefix reuse; drains (abort, retract, weight load) lose and duplicate nothing."""

from __future__ import annotations

import pytest
import torch

from tandemrl.engine.engine import Engine, EngineConfig
from tandemrl.engine.kv_cache import BlockManager
from tandemrl.engine.scheduler import Scheduler
from tandemrl.engine.sequence import SamplingParams, Sequence, Status
from tests.unit.engine_helpers import serve

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def make_engine(model_dir, overlap: bool, kv_cache_gb: float | None = None, prefix: bool = True) -> Engine:
    return Engine(
        EngineConfig(
            str(model_dir),
            max_running_requests=8,
            max_context_len=160,
            kv_cache_gb=kv_cache_gb,
            max_prefill_tokens=96,
            enable_prefix_caching=prefix,
            overlap_steps=overlap,
        )
    )


def prompts(num: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 40, (num,), generator=generator)
    return [torch.randint(3, 49152, (int(n),), generator=generator).tolist() for n in lengths]


def assert_same(got: dict[str, Sequence], want: dict[str, Sequence]) -> None:
    """Same tokens, versions and finish reasons; logprobs to fp32 rounding (under KV pressure the two
    engines retract at different steps, so some rows are computed in batches of another shape)."""
    assert sorted(got) == sorted(want)
    for rid, seq in want.items():
        other = got[rid]
        assert other.output_ids == seq.output_ids, rid
        assert other.output_weight_versions == seq.output_weight_versions, rid
        assert other.finish_reason == seq.finish_reason, rid
        assert other.output_logprobs == pytest.approx(seq.output_logprobs, abs=1e-5), rid


def test_a_pending_last_token_is_not_scheduled_again():
    scheduler = Scheduler(BlockManager(16, 4), max_running_requests=4, max_prefill_tokens=100)
    seq = Sequence("a", [5, 6, 7], SamplingParams(max_new_tokens=2), 4096)
    scheduler.add(seq)
    scheduler.schedule()
    seq.num_cached_tokens, seq.num_pending = seq.num_tokens, 1  # launched: token 1 pending
    batch, _ = scheduler.schedule()
    assert batch == [seq]
    seq.num_cached_tokens, seq.num_pending = seq.num_tokens, 2  # token 2 pending: its last
    assert not seq.can_grow
    assert scheduler.schedule() == ([], False) and scheduler.running == [seq]


@pytest.mark.parametrize(
    "kv_cache_gb", [None, 1e-6]
)  # 1e-6: the smallest cache (one full context), retracts mid-run
def test_overlapped_steps_equal_serial_steps(tiny_llama_dir, kv_cache_gb):
    base = prompts(12, seed=4)
    first = serve(
        make_engine(tiny_llama_dir, overlap=False),
        {str(i): (ids, SamplingParams(max_new_tokens=24, temperature=0)) for i, ids in enumerate(base)},
    )
    # Stop tokens taken from the free-running outputs, so requests stop at different steps mid-run.
    work = {}
    for i, ids in enumerate(base):
        stop = [first[str(i)].output_ids[3 + i]] if i % 3 else []
        params = SamplingParams(max_new_tokens=12 + i, temperature=0, stop_token_ids=stop)
        work[str(i)] = (ids, params)
    serial_engine = make_engine(tiny_llama_dir, overlap=False, kv_cache_gb=kv_cache_gb)
    overlapped_engine = make_engine(tiny_llama_dir, overlap=True, kv_cache_gb=kv_cache_gb)
    serial, overlapped = serve(serial_engine, work), serve(overlapped_engine, work)
    assert_same(overlapped, serial)
    assert any(s.finish_reason["type"] == "stop" for s in serial.values())
    assert any(s.finish_reason["type"] == "length" for s in serial.values())
    if kv_cache_gb:
        assert overlapped_engine.scheduler.num_preemptions > 0
    # Resend every context: prefix reuse behind overlapped steps serves the same tokens.
    again = {rid: (ids + overlapped[rid].output_ids, p) for rid, (ids, p) in work.items()}
    assert_same(serve(overlapped_engine, again), serve(serial_engine, again))
    assert overlapped_engine.blocks.num_free_blocks == overlapped_engine.blocks.num_blocks


def test_drains_lose_and_duplicate_nothing(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, overlap=True)
    params = SamplingParams(max_new_tokens=30, temperature=0)
    for i, ids in enumerate(prompts(6, seed=5)):
        engine.add_request(str(i), ids, params)
    returned: dict[str, Sequence] = {}

    def collect(seqs: list[Sequence]) -> None:
        for seq in seqs:
            assert seq.rid not in returned
            returned[seq.rid] = seq

    for _ in range(4):
        collect(engine.step())
    assert engine.in_flight is not None
    in_flight = engine.in_flight.seqs
    engine.retract_all()  # drains first: the in-flight tokens are appended before the KV is dropped
    assert engine.in_flight is None and all(s.num_pending == 0 for s in in_flight)
    assert all(s.status is Status.WAITING for s in in_flight)
    for _ in range(3):
        collect(engine.step())
    engine.load_weights(list(engine.model.state_dict().items()))  # same values, version 1
    collect(engine.take_finished())
    seqs = list(engine.requests.values())
    num_old = {s.rid: len(s.output_ids) for s in seqs}  # drained: every old-weight token is appended
    for _ in range(3):
        collect(engine.step())
    aborted = engine.abort("2")
    assert aborted is not None and aborted.finish_reason["type"] == "abort"
    collect([aborted, *engine.take_finished()])
    while engine.has_work():
        collect(engine.step())
    assert set(returned) == {str(i) for i in range(6)}
    for seq in seqs:
        num = len(seq.output_ids)
        assert seq.output_weight_versions == [0] * num_old[seq.rid] + [1] * (num - num_old[seq.rid])
        assert len(seq.output_logprobs) == num and seq.num_pending == 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
