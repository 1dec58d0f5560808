"""Our SGLang client against a FAKE SGLang server process (tests/fake_sglang.py, which stands in for a
real SGLang at the process boundary): every body must hold only fields of SGLang's request dataclasses
and every answer is in SGLang's shape. Also: the weight group is joined as SGLang's
`init_custom_process_group` joins it (a real gloo broadcast through it), and per-token weight versions
come from the pause/update timeline."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import aiohttp
import pytest
import torch

from tandemrl.cluster.child_server import free_port
from tandemrl.rollout.client import EngineClient, EngineError
from tandemrl.rollout.weight_sync import DiskWeightSender, WeightSender
from tests.integration.engine_helpers import record_streams, wait_for


@pytest.fixture(scope="module")
def fake_sglang():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.fake_sglang", "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not asyncio.run(EngineClient(url).health()):
        assert proc.poll() is None and time.monotonic() < deadline, "fake SGLang did not start"
        time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


async def raw_post(url: str, body: dict) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        return resp.status, await resp.text()


async def fake_state(url: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(url + "/fake/state") as resp:
        return await resp.json()


async def until_generated(url: str, rid: str) -> None:
    """Wait until the fake has generated a token of request `rid`."""

    async def generated():
        return (await fake_state(url))["progress"].get(rid)

    await wait_for(generated)


def test_the_fake_rejects_fields_sglang_does_not_define(fake_sglang):
    status, text = asyncio.run(raw_post(fake_sglang + "/generate", {"input_ids": [1], "task_name": "x"}))
    assert status == 400 and "task_name" in text and '"object": "error"' in text
    status, text = asyncio.run(raw_post(fake_sglang + "/pause_generation", {"mode": "drain"}))
    assert status == 400 and "Invalid mode" in text


def test_generate_plain_and_streamed(fake_sglang):
    async def run():
        client = EngineClient(fake_sglang, kind="sglang", weight_version=3)
        params = {"max_new_tokens": 6, "temperature": 0.0, "stop": ["</answer>"], "stop_token_ids": [2]}
        streamed = await client.generate([1, 2, 3], params, rid="s1", extra={"task_name": "searchr1"})
        plain = EngineClient(fake_sglang, kind="embedded")  # no streaming; sends our extension fields
        with pytest.raises(EngineError, match="task_name"):
            await plain.generate([1, 2, 3], params, extra={"task_name": "searchr1"})
        plain_result = await plain.generate([1, 2, 3], params)
        await client.close()
        await plain.close()
        return streamed, plain_result

    streamed, plain = asyncio.run(run())
    expected = [(6 + 7 * i) % 1000 for i in range(6)]
    assert streamed.output_ids == expected == plain.output_ids
    assert streamed.output_logprobs == [-0.5] * 6 and streamed.finish_reason == "length"
    assert streamed.weight_versions == [3] * 6 and plain.weight_versions is None
    assert streamed.prompt_tokens == 3


def test_control_routes(fake_sglang):
    async def run():
        client = EngineClient(fake_sglang, kind="sglang")
        for mode in ("abort", "retract", "in_place"):
            await client.pause_generation(mode)
            await client.continue_generation()
        task = asyncio.create_task(client.generate([5], {"max_new_tokens": 500}, rid="long"))
        await until_generated(fake_sglang, "long")
        await client.abort_request("long")
        aborted = await task
        task = asyncio.create_task(client.generate([5], {"max_new_tokens": 500}, rid="long2"))
        await until_generated(fake_sglang, "long2")
        await client.abort_request(abort_all=True)
        aborted_all = await task
        await client.flush_cache()
        info = await client.get_model_info()
        await client.close()
        return aborted, aborted_all, info

    aborted, aborted_all, info = asyncio.run(run())
    assert aborted.finish_reason == "abort" and 0 < len(aborted.output_ids) < 500
    assert aborted_all.finish_reason == "abort" and 0 < len(aborted_all.output_ids) < 500
    assert set(info) == {
        "model_path",
        "tokenizer_path",
        "is_generation",
        "preferred_sampling_params",
        "weight_version",
    }


def test_broadcast_sync_joins_the_group_as_sglang_does(fake_sglang):
    tensors = {"a.weight": torch.randn(64, 8), "b.bias": torch.arange(10, dtype=torch.float32)}

    async def run():
        client = EngineClient(fake_sglang, kind="sglang")
        sender = WeightSender([client], backend="gloo", bucket_mb=1, engine_kind="sglang", group_name="wug")
        await asyncio.wait_for(sender.connect(), timeout=60)  # a wrong store key layout hangs here
        await sender.push(tensors.items(), weight_version=7)
        version = await client.get_weight_version()
        await client.close()
        return version, await fake_state(fake_sglang)

    version, state = asyncio.run(run())
    assert version == "7"
    for name, tensor in tensors.items():
        assert state["received"][name] == pytest.approx(float(tensor.double().sum()), rel=1e-6)


def test_tensor_and_disk_routes(fake_sglang, tmp_path):
    tensors = {"c.weight": torch.full((4, 4), 0.25)}

    async def run():
        client = EngineClient(fake_sglang, kind="sglang")
        answer = await client.update_weights_from_tensor(["gASVAAAAAAAAAAAu"], weight_version=8)
        sender = DiskWeightSender([client], tmp_path / "sync")
        await sender.connect()
        await sender.push(tensors.items(), weight_version=9)
        await client.close()
        return answer, await fake_state(fake_sglang)

    answer, state = asyncio.run(run())
    assert answer["success"] is True and "Weight version updated to 8" in answer["message"]
    assert state["weight_version"] == "9" and state["received"]["c.weight"] == 4.0
    assert state["paths"][-1] == str(tmp_path / "sync" / "v9")
    assert [p.name for p in (tmp_path / "sync").iterdir()] == ["v9"]


def test_per_token_versions_follow_the_update_timeline(fake_sglang):
    async def run():
        client = EngineClient(fake_sglang, kind="sglang", weight_version=0)
        streams = record_streams(client)
        task = asyncio.create_task(client.generate([9], {"max_new_tokens": 40}, rid="timeline"))
        await until_generated(fake_sglang, "timeline")
        await client.pause_generation("in_place")
        num_at_pause = (await fake_state(fake_sglang))["tokens_at_pause"]["timeline"]

        async def received_all():  # what was generated before the pause has reached the client
            return streams and streams[0] and len(streams[0][-1]["output_ids"]) == num_at_pause

        await wait_for(received_all)
        client.mark_weight_version(1)  # the update boundary
        await client.continue_generation()
        result = await task
        await client.close()
        return result, await fake_state(fake_sglang)

    result, state = asyncio.run(run())
    num_old = state["tokens_at_pause"]["timeline"]
    assert 0 < num_old < 40 and len(result.output_ids) == 40
    assert result.weight_versions == [0] * num_old + [1] * (40 - num_old)
