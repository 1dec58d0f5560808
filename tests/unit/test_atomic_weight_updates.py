"""An in_place push that lands between two engine steps needs no pause (`runner/step.py`, `sync_weights`):
CUDA IPC to the embedded engine sends one bucket (`rollout/weight_sync.py`), which the engine's loop
thread loads as one command. Every other route and mode keeps the pause and the continue around the push.
The engine clients, the actor group and the driver are fakes named as such: what is checked is which calls
the runner makes, in what order."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from tandemrl.rollout.backends import make_weight_sender, pushes_atomically
from tandemrl.rollout.weight_sync import WeightSender
from tandemrl.runner.step import sync_weights


def test_only_cuda_ipc_to_the_embedded_engine_is_atomic():
    assert pushes_atomically("embedded", "cuda_ipc")
    for kind, route in [
        ("embedded", "gloo"),
        ("embedded", "nccl"),
        ("embedded", "disk"),
        ("sglang", "cuda_ipc"),
        ("vllm", "cuda_ipc"),
    ]:
        assert not pushes_atomically(kind, route), (kind, route)


class FakeEngineClient:
    def __init__(self, calls: list[str]):
        self.calls = calls

    async def pause_generation(self, mode: str) -> dict:
        self.calls.append(f"pause {mode}")
        return {"pause_queued_s": 0.001, "pause_drain_s": 0.002}

    async def continue_generation(self) -> None:
        self.calls.append("continue")

    def mark_weight_version(self, version: int) -> None:
        self.calls.append(f"mark {version}")


class FakeActorGroup:
    def __init__(self, calls: list[str]):
        self.calls = calls

    async def call(self, method: str, *args):
        self.calls.append(f"{method} {args[0]}")
        return {"sync_weights/bytes": 8.0}


class FakeDriver:
    is_paused = False

    def __init__(self):
        self.versions: list[int] = []

    def set_weight_version(self, version: int) -> None:
        self.versions.append(version)


def _context(mode: str, atomic: bool, calls: list[str]) -> SimpleNamespace:
    config = SimpleNamespace(rollout=SimpleNamespace(pause_mode=mode))
    return SimpleNamespace(
        config=config,
        engines=[FakeEngineClient(calls), FakeEngineClient(calls)],
        actor=FakeActorGroup(calls),
        driver=FakeDriver(),
        atomic_weight_updates=atomic,
        weight_version=2,
        is_first_step_done=True,
        start_step=0,
    )


@pytest.mark.parametrize(
    ("mode", "atomic", "expected"),
    [
        ("in_place", True, ["push_weights 3", "mark 3", "mark 3"]),
        (
            "in_place",
            False,
            ["pause in_place"] * 2 + ["push_weights 3", "mark 3", "mark 3"] + ["continue"] * 2,
        ),
        ("retract", True, ["pause retract"] * 2 + ["push_weights 3", "mark 3", "mark 3"] + ["continue"] * 2),
    ],
)
def test_the_pause_is_left_out_only_for_an_atomic_in_place_push(mode, atomic, expected):
    calls: list[str] = []
    ctx = _context(mode, atomic, calls)
    metrics = asyncio.run(sync_weights(ctx, 3))
    assert calls == expected
    assert ctx.weight_version == 3 and ctx.driver.versions == [3]
    if expected[0].startswith("pause"):
        assert metrics["rollout/engine_pause_drain_ms"] == pytest.approx(2.0)
    else:  # no pause asked: none reported, and the parts add up to the whole
        assert "rollout/engine_pause_drain_ms" not in metrics
    parts = sum(metrics[f"time/sync_weights/{p}"] for p in ("pause", "push", "continue"))
    assert parts == pytest.approx(metrics["time/sync_weights"])


def test_a_stood_down_engine_is_continued_even_when_the_push_is_atomic():
    """time_share paused the engines for the train step (`stand_down`); the push must wake them."""
    calls: list[str] = []
    asyncio.run(sync_weights(_context("in_place", True, calls), 3, is_stood_down=True))
    assert calls == ["push_weights 3", "mark 3", "mark 3", "continue", "continue"]


class FakeIpcSender(WeightSender):
    """A WeightSender whose CUDA IPC send only records the buckets (no GPU here)."""

    def __init__(self, is_one_bucket: bool):
        super().__init__([], backend="cuda_ipc", bucket_mb=1, is_one_bucket=is_one_bucket)
        self.buckets: list[list[str]] = []

    def _prepare(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    async def _send_ipc(self, bucket, weight_version: int) -> None:
        self.buckets.append([name for name, _ in bucket])


@pytest.mark.parametrize(("engine_kind", "is_one_bucket"), [("embedded", True), ("sglang", False)])
def test_the_sender_for_cuda_ipc_to_the_embedded_engine_sends_one_bucket(engine_kind, is_one_bucket):
    sender = make_weight_sender(engine_kind, "cuda_ipc", ["http://127.0.0.1:9"], bucket_mb=1)
    assert sender.is_one_bucket is is_one_bucket
    assert make_weight_sender(engine_kind, "nccl", ["http://127.0.0.1:9"], bucket_mb=1).is_one_bucket is False


@pytest.mark.parametrize(("is_one_bucket", "num_buckets"), [(True, 1), (False, 3)])
def test_one_bucket_holds_every_tensor(is_one_bucket, num_buckets):
    named = [(f"w{i}", torch.zeros(2**17)) for i in range(6)]  # 0.5 MiB each; bucket_mb=1
    sender = FakeIpcSender(is_one_bucket)
    result = asyncio.run(sender.push(iter(named), weight_version=1))
    assert len(sender.buckets) == num_buckets == result["num_buckets"]
    assert [n for bucket in sender.buckets for n in bucket] == [n for n, _ in named]
