"""The engine process over HTTP: SGLang shapes, bad input, the three pause modes each with a weight update
(over a real gloo group from this process) between pause and continue; every test runs on an engine
without and with n-gram speculative decoding (`serve-engine --speculative ngram`)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM

from tandemrl.config.engine import EngineOptions
from tandemrl.rollout.client import EngineClient, EngineError
from tandemrl.rollout.engine_process import EngineProcess
from tandemrl.rollout.weight_sync import DiskWeightSender, WeightSender
from tests.integration.engine_helpers import FORCED_TOKEN, forcing_state_dict, hf_state_dict, wait_for

MAX_NEW = 160
PROMPTS = [[1, 504, 3237, 28, 9], [1, 2817, 314, 1060, 47, 87, 17], [1, 7, 8, 9, 10, 11], [1, 2, 3]]
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=["none", "ngram"])
def engine(tiny_llama_dir, request):
    # exact prefixes (age 0): these tests check that KV of older weights never serves after a push
    # (the age-1 reuse across an update has its own tests in tests/unit/test_engine_prefix_cache.py)
    options = EngineOptions(speculative=request.param, prefix_cache_max_age=0)
    with EngineProcess(tiny_llama_dir, max_context_len=512, max_running_requests=32, options=options) as proc:
        yield proc


@pytest.fixture(scope="module")
def sender(engine):
    sender = WeightSender([EngineClient(engine.url)], backend="gloo", bucket_mb=4)
    asyncio.run(sender.connect())
    return sender


@pytest.fixture(scope="module")
def reference(engine) -> list[list[int]]:
    """Greedy outputs under the original weights, no pauses."""

    async def run():
        client = EngineClient(engine.url)
        results = await asyncio.gather(*(client.generate(p, GREEDY) for p in PROMPTS))
        await client.close()
        return [r.output_ids for r in results]

    return asyncio.run(run())


async def post_raw(url: str, path: str, body) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session:
        async with session.post(
            url + path,
            data=body if isinstance(body, str) else None,
            json=None if isinstance(body, str) else body,
        ) as resp:
            return resp.status, await resp.text()


@pytest.mark.parametrize(
    "body, reason",
    [
        ({"input_ids": [1, 2], "sampling_params": {}, "bogus": 1}, "unknown fields ['bogus']"),
        ({"input_ids": list(range(600)), "sampling_params": {}}, "max_context_len"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens must be"),
        ({"input_ids": [1, 2], "sampling_params": {"max_tokens": 3}}, "unknown sampling_params"),
        ({"input_ids": [[1, 2]]}, "one list of token ids"),
        ({"input_ids": [1, 10**9]}, "token ids in"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_input_is_400_with_reason(engine, body, reason):
    status, text = asyncio.run(post_raw(engine.url, "/generate", body))
    assert status == 400 and reason in text, text


def test_bad_pause_mode_and_unknown_group(engine):
    status, text = asyncio.run(post_raw(engine.url, "/pause_generation", {"mode": "drain"}))
    assert status == 400 and "mode must be one of" in text
    status, text = asyncio.run(
        post_raw(
            engine.url,
            "/update_weights_from_distributed",
            {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"},
        )
    )
    assert status == 400 and "init_weights_update_group" in text


def test_generate_shapes_and_task_name(engine, tiny_llama_dir, reference):
    async def run():
        client = EngineClient(engine.url)
        result = await client.generate(
            PROMPTS[0],
            {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
            rid="shape-1",
            extra={"task_name": "searchr1"},
        )
        status, text = await post_raw(
            engine.url,
            "/generate",
            {"input_ids": PROMPTS[0], "return_logprob": True, "sampling_params": {"max_new_tokens": 2}},
        )
        info = await client.server_info()
        await client.close()
        return result, status, text, info

    result, status, text, info = asyncio.run(run())
    assert result.output_ids == reference[0][:5] and result.finish_reason == "length"
    assert len(result.output_logprobs) == 5 and result.prompt_tokens == len(PROMPTS[0])
    assert result.weight_versions == [int(result.weight_version)] * 5
    assert status == 200 and '"output_token_logprobs"' in text and '"finish_reason"' in text
    assert info["http_loop_late_s"] >= 0 and info["http_loop_stalled_s"] >= 0  # its event loop is watched
    assert info["num_running"] == 0 and info["num_requests_added"] == info["num_requests_finished"]


async def start_and_pause(url: str, mode: str, min_tokens: int):
    """Start the PROMPTS, pause once each has ~min_tokens output tokens; returns (client, tasks, info)."""
    client = EngineClient(url)
    before = await client.server_info()
    tasks = [asyncio.create_task(client.generate(p, GREEDY)) for p in PROMPTS]

    async def progressed():
        info = await client.server_info()
        num_emitted = info["num_decode_emitted_tokens"] - before["num_decode_emitted_tokens"]
        return num_emitted >= min_tokens * len(PROMPTS)

    await wait_for(progressed)
    answer = await client.pause_generation(mode)
    # the engine says where its pause took time: queued behind its loop thread's step, then the drain
    assert answer["mode"] == mode and answer["pause_queued_s"] >= 0 and answer["pause_drain_s"] >= 0
    return client, tasks, await client.server_info()


def split_by_version(result, old_version: int, new_version: int) -> tuple[list[int], list[int]]:
    versions = result.weight_versions
    num_old = versions.count(old_version)
    assert versions == [old_version] * num_old + [new_version] * (len(versions) - num_old)
    return result.output_ids[:num_old], result.output_ids[num_old:]


def run_pause_with_update(engine, sender, tiny_llama_dir, mode):
    async def run():
        version = int(await EngineClient(engine.url).get_weight_version())
        client, tasks, paused_info = await start_and_pause(engine.url, mode, min_tokens=10)
        await asyncio.sleep(0.2)  # paused: nothing may move
        still = await client.server_info()
        assert still["num_decode_tokens"] == paused_info["num_decode_tokens"]
        await sender.push(forcing_state_dict(tiny_llama_dir).items(), weight_version=version + 1)
        assert await client.get_weight_version() == str(version + 1)
        await client.continue_generation()
        results = await asyncio.gather(*tasks)
        after = await client.generate(PROMPTS[0], {"max_new_tokens": 3, "temperature": 1.0})
        done_info = await client.server_info()
        await sender.push(hf_state_dict(tiny_llama_dir).items(), weight_version=version + 2)  # restore
        await client.close()
        return version, paused_info, done_info, results, after

    return asyncio.run(run())


def test_pause_retract_update_continue(engine, sender, tiny_llama_dir, reference):
    version, paused, done, results, _ = run_pause_with_update(engine, sender, tiny_llama_dir, "retract")
    assert paused["num_running"] == 0 and paused["num_waiting"] == len(PROMPTS)
    for result, expected in zip(results, reference, strict=True):
        old, new = split_by_version(result, version, version + 1)
        assert result.finish_reason == "length" and len(result.output_ids) == MAX_NEW  # no token lost
        assert old == expected[: len(old)] and len(old) >= 1
        assert new == [FORCED_TOKEN] * len(new) and len(new) >= 1
    # Retracted requests were re-prefilled over prompt + the tokens generated before the pause.
    reprefill = done["num_prefill_tokens"] - paused["num_prefill_tokens"]
    assert reprefill >= sum(len(p) + 10 for p in PROMPTS)


def test_pause_in_place_update_continue(engine, sender, tiny_llama_dir, reference):
    version, paused, done, results, after = run_pause_with_update(engine, sender, tiny_llama_dir, "in_place")
    assert paused["num_running"] == len(PROMPTS)
    for result, expected in zip(results, reference, strict=True):
        old, new = split_by_version(result, version, version + 1)
        assert result.finish_reason == "length" and len(result.output_ids) == MAX_NEW
        assert old == expected[: len(old)] and len(old) >= 10
        assert new == [FORCED_TOKEN] * len(new) and len(new) >= 1
    # No re-prefill: the only prefill after the pause is the one new request's prompt.
    assert done["num_prefill_tokens"] - paused["num_prefill_tokens"] == len(PROMPTS[0])
    assert after.output_ids == [FORCED_TOKEN] * 3


def test_pause_abort_returns_partial_outputs(engine, sender, tiny_llama_dir, reference):
    version, paused, done, results, after = run_pause_with_update(engine, sender, tiny_llama_dir, "abort")
    assert paused["num_running"] == 0 and paused["num_waiting"] == 0
    for result, expected in zip(results, reference, strict=True):
        assert result.finish_reason == "abort"
        assert (
            10 <= len(result.output_ids) < MAX_NEW and result.output_ids == expected[: len(result.output_ids)]
        )
        assert set(result.weight_versions) == {version}
    assert after.output_ids == [FORCED_TOKEN] * 3 and after.weight_versions == [version + 1] * 3
    assert after.output_logprobs == pytest.approx([0.0] * 3, abs=1e-4)


def test_abort_request_by_rid(engine):
    async def run():
        client = EngineClient(engine.url)
        task = asyncio.create_task(
            client.generate(PROMPTS[1], {"max_new_tokens": 400, "ignore_eos": True}, rid="to-abort")
        )
        await wait_for(lambda: _running(client))
        await client.abort_request("to-abort")
        result = await task
        await client.close()
        return result

    result = asyncio.run(run())
    assert result.finish_reason == "abort" and len(result.output_ids) < 400


async def _running(client: EngineClient) -> bool:
    return (await client.server_info())["num_running"] > 0


def test_weight_update_over_gloo_loads_another_model(engine, sender, tiny_model_factory, tiny_llama_dir):
    """Trainer process (here) -> engine process: after pushing seed-1 weights, greedy equals HF seed-1."""
    other_dir = tiny_model_factory("llama", seed=1)
    other = AutoModelForCausalLM.from_pretrained(other_dir, dtype=torch.float32).eval()
    prompt = PROMPTS[1]
    expected = other.generate(
        torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
    )[0, len(prompt) :].tolist()

    async def run():
        client = EngineClient(engine.url)
        stats = await sender.push(other.state_dict().items(), weight_version=77)
        result = await client.generate(prompt, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
        await sender.push(hf_state_dict(tiny_llama_dir).items(), weight_version=78)
        await client.close()
        return stats, result

    stats, result = asyncio.run(run())
    assert stats["num_buckets"] >= 2 and stats["bytes"] > 10 * 2**20
    assert result.output_ids == expected and result.weight_version == "77"
    assert result.weight_versions == [77] * 12


def test_client_errors_carry_the_reason(engine):
    async def run():
        client = EngineClient(engine.url)
        try:
            await client.generate([1, 2], {"max_new_tokens": -1})
        finally:
            await client.close()

    with pytest.raises(EngineError, match="max_new_tokens must be"):
        asyncio.run(run())


def test_engine_process_startup_failure_shows_stderr(tmp_path):
    with pytest.raises(RuntimeError, match="no config.json there"):
        EngineProcess(tmp_path / "missing-model", startup_timeout_s=60).start()


def test_busy_seconds_grow_only_while_requests_run(engine):
    async def run():
        client = EngineClient(engine.url)
        idle_before = (await client.server_info())["busy_s"]
        await asyncio.sleep(0.3)
        idle_after = (await client.server_info())["busy_s"]
        await client.generate(PROMPTS[1], {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True})
        info = await client.server_info()
        await client.close()
        return idle_before, idle_after, info

    idle_before, idle_after, info = asyncio.run(run())
    assert idle_after == idle_before  # nothing running: the counter stands still
    assert info["busy_s"] > idle_after
    assert info["busy_s"] <= info["uptime_s"]
    # the step counters behind rollout/engine_decode_batch_mean and the step times by kind
    assert 0 < info["num_prefill_steps"] < info["num_steps"]
    assert info["num_decode_rows"] >= info["num_steps"] - info["num_prefill_steps"]
    assert 0 < info["prefill_busy_s"] < info["busy_s"]
    # greedy, a random tied-embedding model repeats its last token: drafts of the repeat are accepted
    is_speculative = info["num_spec_draft_tokens"] > 0
    assert (info["num_spec_accepted_tokens"] > 0) == is_speculative
    assert (info["num_decode_emitted_tokens"] > info["num_decode_rows"]) == is_speculative


def test_sglang_bodies_disk_update_and_refused_pickles(engine, tiny_llama_dir, tmp_path, reference):
    """The embedded engine takes SGLang's bodies: a safetensors reload (update_weights_from_disk), SGLang's
    pause/continue answers and model info; an update_weights_from_tensor pickle is refused unopened."""
    import base64
    import pickle

    pickled = base64.b64encode(pickle.dumps([("x", torch.zeros(1))])).decode()

    async def run():
        client = EngineClient(engine.url)
        sender = DiskWeightSender([client], tmp_path / "sync")
        await sender.connect()
        version = int(await client.get_weight_version())
        await sender.push(forcing_state_dict(tiny_llama_dir).items(), weight_version=version + 1)
        forced = await client.generate(PROMPTS[0], {"max_new_tokens": 3, "temperature": 0})
        await sender.push(hf_state_dict(tiny_llama_dir).items(), weight_version=version + 2)
        restored = await client.generate(PROMPTS[0], GREEDY)
        sglang_client = EngineClient(engine.url, kind="sglang")  # streams, as to a real SGLang
        streamed = await sglang_client.generate(PROMPTS[0], GREEDY, extra={"task_name": "t"})
        assert await sglang_client.is_alive()  # /model_info, what a run's watchdog asks an SGLang-kind engine
        await sglang_client.close()
        paused = await client.post("/pause_generation", {"mode": "in_place"})
        resumed = await client.post("/continue_generation", {"torch_empty_cache": True})
        info = await client.get_model_info()
        refused = await post_raw(
            engine.url, "/update_weights_from_tensor", {"serialized_named_tensors": [pickled]}
        )
        await client.close()
        return version, forced, restored, streamed, paused, resumed, info, refused

    version, forced, restored, streamed, paused, resumed, info, refused = asyncio.run(run())
    assert forced.output_ids == [FORCED_TOKEN] * 3 and forced.weight_versions == [version + 1] * 3
    assert restored.weight_version == str(version + 2) and restored.output_ids == reference[0]
    assert streamed.output_ids == reference[0] and streamed.weight_versions == [version + 2] * MAX_NEW
    assert paused["status"] == resumed["status"] == "ok"
    assert {
        "model_path",
        "tokenizer_path",
        "is_generation",
        "preferred_sampling_params",
        "weight_version",
    } <= set(info)
    assert refused[0] == 400 and "unpickles nothing" in refused[1]
