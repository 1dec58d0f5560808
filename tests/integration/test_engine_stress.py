"""Stress: 200 concurrent requests against one engine process for 60 s while a controller pauses it
every 0.2 s (each mode once in every four pauses, in random order: abort, retract, in_place, or the
client-side drain) and pushes new weights
over gloo each time. Every request must return exactly once, with no token lost and versions in order.
Run once more, shorter, with n-gram speculative decoding (`serve-engine --speculative ngram`)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from tandemrl.config.engine import EngineOptions
from tandemrl.rollout.client import EngineClient
from tandemrl.rollout.engine_process import EngineProcess
from tandemrl.rollout.weight_sync import WeightSender
from tests.integration.engine_helpers import FORCED_TOKEN, forcing_state_dict, hf_state_dict

DURATION_S = 20.0  # the default suite's budget (make test under 25 min on CI): 20 s hold every pause mode many times over
NUM_WORKERS = 200
INTERVAL_S = 0.2


class Stress:
    def __init__(self, url: str, sender: WeightSender, weight_sets: list):
        self.client, self.sender, self.weight_sets = EngineClient(url, timeout_s=120), sender, weight_sets
        self.rng = random.Random(0)
        self.admitting = asyncio.Event()
        self.admitting.set()
        self.inflight = 0
        self.results: dict[str, object] = {}
        self.forced_versions: set[int] = set()  # versions whose weights force FORCED_TOKEN
        self.num_pauses = {"abort": 0, "retract": 0, "in_place": 0, "drain": 0}

    async def worker(self, index: int, deadline: float) -> None:
        count = 0
        while time.monotonic() < deadline:
            await self.admitting.wait()
            rid = f"w{index}-{count}"
            count += 1
            max_new = self.rng.randint(4, 48)
            prompt = [1] + [self.rng.randint(3, 40000) for _ in range(self.rng.randint(2, 30))]
            params = {
                "max_new_tokens": max_new,
                "temperature": self.rng.choice([0.0, 1.0]),
                "ignore_eos": True,
            }
            self.inflight += 1
            try:
                result = await self.client.generate(prompt, params, rid=rid)
            finally:
                self.inflight -= 1
            assert rid not in self.results, f"{rid} returned twice"
            self.results[rid] = (max_new, result)

    async def controller(self, deadline: float) -> None:
        version = int(await self.client.get_weight_version())
        modes: list[str] = []
        # every mode once in each block of four, in a seeded random order; past the deadline only until
        # each has run once (how many pauses fit in the time depends on the machine)
        while time.monotonic() < deadline or not all(self.num_pauses.values()):
            await asyncio.sleep(INTERVAL_S)
            if not modes:
                modes = self.rng.sample(list(self.num_pauses), k=len(self.num_pauses))
            mode = modes.pop()
            self.num_pauses[mode] += 1
            if mode == "drain":  # the client's mode: stop admitting, wait for in-flight requests
                self.admitting.clear()
                while self.inflight:
                    await asyncio.sleep(0.01)
            else:
                await self.client.pause_generation(mode)
            version += 1
            forced = version % 2 == 1
            await self.sender.push(self.weight_sets[forced].items(), weight_version=version)
            if forced:
                self.forced_versions.add(version)
            if mode == "drain":
                self.admitting.set()
            else:
                await self.client.continue_generation()

    def check(self) -> None:
        for rid, (max_new, result) in self.results.items():
            n = len(result.output_ids)
            assert len(result.output_logprobs) == n and len(result.weight_versions) == n, rid
            assert result.weight_versions == sorted(result.weight_versions), rid
            if result.finish_reason == "length":
                assert n == max_new, f"{rid}: {n} tokens for max_new_tokens={max_new} (lost or extra tokens)"
            else:
                assert result.finish_reason == "abort" and n <= max_new, rid
            for token, version in zip(result.output_ids, result.weight_versions, strict=True):
                if version in self.forced_versions:
                    assert token == FORCED_TOKEN, f"{rid}: token from forced version {version} is {token}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("speculative, duration_s", [("none", DURATION_S), ("ngram", 10.0)])
def test_stress_pauses_and_updates(tiny_llama_dir, speculative, duration_s):
    weight_sets = [hf_state_dict(tiny_llama_dir), forcing_state_dict(tiny_llama_dir)]
    options = EngineOptions(speculative=speculative)
    with EngineProcess(
        tiny_llama_dir, max_context_len=256, max_running_requests=64, options=options
    ) as engine:

        async def run():
            sender = WeightSender([EngineClient(engine.url)], backend="gloo", bucket_mb=16)
            await sender.connect()
            stress = Stress(engine.url, sender, weight_sets)
            deadline = time.monotonic() + duration_s
            workers = [asyncio.create_task(stress.worker(i, deadline)) for i in range(NUM_WORKERS)]
            await stress.controller(deadline)
            await stress.client.continue_generation()
            stress.admitting.set()
            await asyncio.wait_for(asyncio.gather(*workers), timeout=120)  # no deadlock
            info = await stress.client.server_info()
            await stress.client.close()
            return stress, info

        stress, info = asyncio.run(run())
        assert engine.is_alive()
    stress.check()
    finished = [r for _, r in stress.results.values()]
    reasons = {reason: sum(r.finish_reason == reason for r in finished) for reason in ("length", "abort")}
    print(
        f"stress: {len(finished)} requests {reasons}, pauses {stress.num_pauses}, "
        f"{len(stress.forced_versions)} forced versions, engine {info}"
    )
    assert info["num_requests_added"] == info["num_requests_finished"] == len(finished)
    assert info["num_running"] == 0 and info["num_waiting"] == 0
    assert info["num_free_blocks"] == info["num_blocks"]  # no KV block leaked (rejected drafts included)
    assert (info["num_spec_accepted_tokens"] > 0) == (speculative == "ngram")
    assert all(count > 0 for count in stress.num_pauses.values())
    assert reasons["length"] > 0 and reasons["abort"] > 0
    assert any(len(set(r.weight_versions)) > 1 for r in finished)  # some requests spanned an update
