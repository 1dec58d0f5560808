"""Our SGLang client and weight sender against a FAKE SGLang server process (tests/fake_sglang.py, which
stands in for a real SGLang at the process boundary and enforces what SGLang's own code does).

What SGLang expects, read in its source: the sglang 0.5.15 wheel (the `sglang` extra's pin) and
sgl-project/sglang on GitHub (python/sglang/srt/managers/io_struct.py @ 001067fffe33427bee0ed2f007fb7551a1d76b44,
python/sglang/srt/managers/scheduler_update_weights_mixin.py @ 018c9109680f6f5b0654114b9159101256e1e18b, and in
0.5.15 managers/tp_worker.py, model_executor/model_runner.py, managers/scheduler.py,
managers/scheduler_components/weight_updater.py, managers/tokenizer_manager.py, entrypoints/http_server.py):

- every body holds only fields of SGLang's request structs, and answers have SGLang's shapes;
- a server of `tp_size` T joins the weight group with T ranks, `rank_offset + tp_rank`
  (ModelRunner.init_weights_update_group), so the world is 1 + the sum of the servers' TP sizes and
  server i's offset is 1 + the TP sizes before it; each TP rank opens its own entry of
  update_weights_from_tensor's `serialized_named_tensors` (TpModelWorker: `[self.tp_rank]`);
- `flush_cache` works only with no request queued or running (Scheduler.is_fully_idle), an update sent
  with `flush_cache: true` otherwise fails an assert and kills the scheduler, and SGLang's own retract
  pause leaves the retracted requests queued: so `retract` (done by our client with SGLang's abort mode)
  must flush after the push, and `in_place` must never ask for a flush;
- /get_weight_version is gone in 0.5.15 (404); the version is in /model_info.
"""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
import subprocess
import sys
import time

import aiohttp
import pytest
import torch

from tandemrl.config.errors import ConfigError
from tandemrl.host.child_server import free_port
from tandemrl.rollout.backends import make_weight_sender
from tandemrl.rollout.client import EngineClient, EngineError
from tandemrl.rollout.weight_sync import DiskWeightSender, WeightSender, ipc_payload, rank_offsets
from tests.integration.engine_helpers import record_streams, wait_for

TENSORS = {"a.weight": torch.randn(64, 8), "b.bias": torch.arange(10, dtype=torch.float32)}


async def is_healthy(url: str) -> bool:
    client = EngineClient(url)
    try:
        return await client.health()
    finally:
        await client.close()


def start_fake(tp_size: int = 1, *extra_args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "tests.fake_sglang", "--port", str(port), "--tp-size", str(tp_size)]
    command += extra_args
    proc = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while not asyncio.run(is_healthy(url)):
        assert proc.poll() is None and time.monotonic() < deadline, "fake SGLang did not start"
        time.sleep(0.2)
    return proc, url


@pytest.fixture(scope="module")
def fake_sglang():
    proc, url = start_fake()
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def fresh_fakes():
    """Fakes of the given TP sizes, started for one test (their state is that test's alone)."""
    procs = []

    def start(*tp_sizes: int, extra_args: tuple[str, ...] = ()) -> list[str]:
        started = [start_fake(tp, *extra_args) for tp in tp_sizes]
        procs.extend(proc for proc, _ in started)
        return [url for _, url in started]

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=30)


async def raw_post(url: str, body: dict) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        return resp.status, await resp.text()


async def fake_state(url: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(url + "/fake/state") as resp:
        return await resp.json()


async def wait_for_progress(url: str, rids: list[str], num_tokens: int) -> None:
    """Until every request has generated `num_tokens` (a hang guard only)."""
    deadline = time.monotonic() + 60
    while True:
        progress = (await fake_state(url))["progress"]
        if all(progress.get(rid, 0) >= num_tokens for rid in rids):
            return
        assert time.monotonic() < deadline, f"requests did not reach {num_tokens} tokens: {progress}"
        await asyncio.sleep(0.02)


def test_the_fake_rejects_fields_sglang_does_not_define(fake_sglang):
    status, text = asyncio.run(raw_post(fake_sglang + "/generate", {"input_ids": [1], "task_name": "x"}))
    assert status == 400 and "task_name" in text and '"object": "error"' in text
    status, text = asyncio.run(raw_post(fake_sglang + "/pause_generation", {"mode": "drain"}))
    assert status == 400 and "Invalid mode" in text


def test_the_key_from_the_config_file_guards_every_endpoint_but_health(fresh_fakes, tmp_path):
    """tandem hands SGLang its key in a `--config` YAML (rollout/sglang_process.py); SGLang merges the file's
    keys as flags and then asks `Authorization: Bearer <key>` of every path but /health* and /metrics*
    (utils/auth.py): a client without the key, or with another scheme, gets 401."""
    config = tmp_path / "args.yaml"
    config.write_text('api-key: "k3y"\n')
    (url,) = fresh_fakes(1, extra_args=("--config", str(config)))

    async def run():
        async with aiohttp.ClientSession() as session:
            answers = {}
            for name, headers in {
                "none": {},
                "basic": {"Authorization": "Basic k3y"},
                "wrong": {"Authorization": "Bearer other"},
                "lower": {"Authorization": "bearer k3y"},
            }.items():
                async with session.get(url + "/get_model_info", headers=headers) as resp:
                    answers[name] = (resp.status, await resp.text())
            async with session.get(url + "/health") as resp:
                answers["health"] = (resp.status, "")
        keyed = EngineClient(url, kind="sglang", api_key="k3y")
        try:
            answers["client"] = (200, str(await keyed.get_model_info()))
        finally:
            await keyed.close()
        return answers

    answers = asyncio.run(run())
    for name in ("none", "basic", "wrong"):
        assert answers[name][0] == 401 and "Unauthorized" in answers[name][1], (name, answers[name])
    assert answers["lower"][0] == 200 and answers["health"][0] == 200
    assert "weight_version" in answers["client"][1]


def test_the_fake_takes_the_launch_command_line_and_refuses_what_sglang_would():
    from tests.fake_sglang import merge_config, parse_args

    args = parse_args(["--model-path", "/m", "--tp-size", "2", "--port", "30001", "--random-seed", "3"])
    assert (args.tp_size, args.port, args.random_seed, args.api_key) == (2, 30001, 3, None)
    with pytest.raises(SystemExit):  # argparse: a flag SGLang does not have
        parse_args(["--port", "1", "--no-such-flag", "x"])
    with pytest.raises(ValueError, match="YAML"):
        merge_config(["--port", "1", "--config", "args.json"])
    with pytest.raises(ValueError, match="Multiple config files"):
        merge_config(["--config", "a.yaml", "--config", "b.yaml"])


def test_a_launched_servers_key_reads_back_as_a_value(tmp_path, monkeypatch):
    """SGLang turns the `--config` file into `--api-key VALUE` for argparse, which takes a value beginning
    with "-" for a flag and exits (the fake parses as SGLang does): tandem's keys begin with a letter,
    even for the 1-in-64 draw of token_urlsafe that begins with "-"."""
    import secrets

    from tandemrl.config.loader import load_config
    from tandemrl.host.http_guard import new_api_key
    from tandemrl.rollout.sglang_process import SglangServerProcess
    from tests.fake_sglang import parse_args

    monkeypatch.setattr(secrets, "token_urlsafe", lambda nbytes=None: "-" + "x" * 42)
    rollout = load_config(None, ["rollout.backend=sglang", "cluster.use_ray=true"]).rollout
    for key, is_read in ((new_api_key(), True), (secrets.token_urlsafe(32), False)):
        server = SglangServerProcess(rollout, tmp_path, "127.0.0.1", free_port(), 0, api_key=key)
        try:
            server._write_config()
            if is_read:
                assert parse_args(server.server_args()).api_key == key
            else:
                with pytest.raises(SystemExit):  # "expected one argument", as SGLang's own parser says
                    parse_args(server.server_args())
        finally:
            server.stop()


def test_the_log_tail_an_error_quotes_hides_the_key_sglang_logged(tmp_path):
    """SGLang logs `server_args=ServerArgs(..., api_key='...')` at start-up; a failed start quotes the log's
    tail, with the key hidden."""
    from tandemrl.config.loader import load_config
    from tandemrl.rollout.sglang_process import SglangServerProcess

    rollout = load_config(None, ["rollout.backend=sglang", "cluster.use_ray=true"]).rollout
    log = tmp_path / "sglang.log"
    server = SglangServerProcess(rollout, tmp_path, "127.0.0.1", 1, 0, log_path=log, api_key="kSecret_1")
    log.write_text(
        "[2026-12-07] server_args=ServerArgs(model_path='/m', api_key='kSecret_1', port=1)\nready\n"
    )
    tail = server.log_tail()
    assert "kSecret_1" not in tail and "api_key='<api key>'" in tail and "ready" in tail


def test_health_is_a_generation_that_a_paused_scheduler_holds(fresh_fakes, monkeypatch):
    """SGLang's /health (http_server.py `health_generate`) sends a one-token request through the scheduler
    and waits at least a second; while generation is paused its request waits at the tokenizer, and the
    probe answers 503 after SGLANG_HEALTH_CHECK_TIMEOUT. /model_info, what the watchdog asks SGLang
    (`EngineClient.is_alive`), answers all along."""
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "2")  # the fake reads SGLang's variable
    (url,) = fresh_fakes(1)

    async def run():
        client = EngineClient(url, kind="sglang")
        try:
            started = time.monotonic()
            answers = {"health": await client.health(), "health_s": time.monotonic() - started}
            await client.pause_generation("in_place")
            answers["paused_health"] = await client.health()
            answers["paused_alive"] = await client.is_alive()
            await client.continue_generation()
            started = time.monotonic()
            answers["resumed_health"] = await client.health()
            answers["resumed_health_s"] = time.monotonic() - started
            return answers
        finally:
            await client.close()

    answers = asyncio.run(run())
    assert answers["health"] and answers["health_s"] >= 1.0, answers
    assert answers["paused_health"] is False and answers["paused_alive"] is True, answers
    assert answers["resumed_health"] and answers["resumed_health_s"] >= 1.0, answers


def test_the_watchdog_keeps_a_healthy_external_sglang_and_notices_it_gone():
    """An external SGLang (rollout.server_addrs) under the run's watchdog, checked every second: asked
    /health, SGLang's one-second generation probe would time out every check and stop the run after
    three; asked /model_info it stays alive through a paused scheduler, and its death is caught."""
    from tandemrl.config.loader import load_config
    from tandemrl.runner.services import EngineDiedError, Services

    proc, url = start_fake()
    config = load_config(
        None,
        [
            "rollout.backend=sglang",
            f"rollout.server_addrs=[{url}]",
            "retrieval.launch=false",
            "runner.engine_health_interval_s=1.0",
        ],
    )
    services = Services(config)
    client = EngineClient(url, kind="sglang")

    async def run():
        try:
            watchdog = asyncio.create_task(services.watchdog([client]))
            await asyncio.sleep(4)  # the old /health checks failed three times by then
            await client.pause_generation("in_place")
            await asyncio.sleep(4)
            alive_through = not watchdog.done()
            await client.continue_generation()
            proc.kill()
            with pytest.raises(EngineDiedError, match="rollout engine 0 .* failed 3 health checks in a row"):
                await asyncio.wait_for(watchdog, timeout=60)
            return alive_through
        finally:
            await client.close()

    try:
        assert asyncio.run(run())
    finally:
        proc.kill()
        proc.wait(timeout=30)


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


async def raw_stream(url: str, body: dict) -> list[dict]:
    """The chunks of one streamed /generate, as the server sent them."""
    chunks = []
    async with aiohttp.ClientSession() as session, session.post(url + "/generate", json=body) as resp:
        async for line in resp.content:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks.append(json.loads(line[len(b"data: ") :]))
    return chunks


def test_a_request_past_the_context_is_cut_to_fit_as_the_embedded_engine_stops_it(fresh_fakes):
    """SGLang refuses an input whose max_new_tokens would pass `--context-length` (the fake as SGLang);
    tandem's client, which knows rollout.max_context_len, asks for what fits, and the request ends there
    with finish_reason length, as the embedded engine ends it; an input that fills the context is refused."""
    (url,) = fresh_fakes(1, extra_args=("--context-length", "64"))
    prompt, params = list(range(1, 41)), {"max_new_tokens": 100}

    async def run():
        bare = EngineClient(url, kind="sglang")
        with pytest.raises(
            EngineError, match="Requested token count exceeds the model's maximum context length"
        ):
            await bare.generate(prompt, params, rid="bare")
        await bare.close()
        fitted = EngineClient(url, kind="sglang", max_context_len=64)
        result = await fitted.generate(prompt, params, rid="fitted")
        with pytest.raises(EngineError, match="prompt has 64 tokens but the context is 64"):
            await fitted.generate(list(range(1, 65)), params, rid="full")
        await fitted.close()
        return result

    result = asyncio.run(run())
    assert len(result.output_ids) == 64 - 40 and result.finish_reason == "length"


def test_incremental_streaming_gives_the_client_the_same_tokens(fresh_fakes):
    """tandem launches SGLang with --incremental-streaming-output (rollout/sglang_process.py): each chunk
    then holds only its new ids and logprobs, completion_tokens still counting all; the client assembles
    what it assembles from SGLang's default cumulative chunks."""
    cumulative_url, incremental_url = fresh_fakes(1) + fresh_fakes(
        1, extra_args=("--incremental-streaming-output",)
    )
    body = {
        "input_ids": [4, 5],
        "sampling_params": {"max_new_tokens": 5},
        "return_logprob": True,
        "stream": True,
    }

    async def run():
        chunks = {url: await raw_stream(url, body) for url in (cumulative_url, incremental_url)}
        results = []
        for url in (cumulative_url, incremental_url):
            client = EngineClient(url, kind="sglang", weight_version=2)
            results.append(await client.generate([4, 5], {"max_new_tokens": 5}, rid=f"inc-{len(results)}"))
            await client.close()
        return chunks, results

    chunks, (from_cumulative, from_incremental) = asyncio.run(run())
    expected = [(9 + 7 * i) % 1000 for i in range(5)]
    assert [c["output_ids"] for c in chunks[cumulative_url]] == [expected[: i + 1] for i in range(5)]
    assert [c["output_ids"] for c in chunks[incremental_url]] == [[t] for t in expected]
    assert [len(c["meta_info"]["output_token_logprobs"]) for c in chunks[incremental_url]] == [1] * 5
    assert [c["meta_info"]["completion_tokens"] for c in chunks[incremental_url]] == [1, 2, 3, 4, 5]
    assert from_incremental.output_ids == from_cumulative.output_ids == expected
    assert from_incremental.output_logprobs == from_cumulative.output_logprobs == [-0.5] * 5
    assert from_incremental.weight_versions == [2] * 5 and from_incremental.finish_reason == "length"


def test_control_routes(fake_sglang):
    async def run():
        deprecated_before = len((await fake_state(fake_sglang))["deprecated_calls"])
        client = EngineClient(fake_sglang, kind="sglang")
        for mode in ("abort", "retract", "in_place"):
            await client.pause_generation(mode)
            await client.continue_generation()
        task = asyncio.create_task(client.generate([5], {"max_new_tokens": 500}, rid="long"))
        await wait_for_progress(fake_sglang, ["long"], 2)
        await client.abort_request("long")
        aborted = await task
        task = asyncio.create_task(client.generate([5], {"max_new_tokens": 500}, rid="long2"))
        await wait_for_progress(fake_sglang, ["long2"], 2)
        await client.abort_request(abort_all=True)
        aborted_all = await task
        await client.flush_cache()
        info = await client.get_model_info()
        version = await client.get_weight_version()
        assert await client.num_tp_ranks() == 1 and "tp_size" in await client.server_info()
        await client.close()
        # none of it through a name SGLang logs a deprecation warning for at every call
        assert len((await fake_state(fake_sglang))["deprecated_calls"]) == deprecated_before
        return aborted, aborted_all, info, version

    aborted, aborted_all, info, version = asyncio.run(run())
    # the caller's aborts end the requests even though a retract pause happened since the client began
    assert aborted.finish_reason == "abort" and 0 < len(aborted.output_ids) < 500
    assert aborted_all.finish_reason == "abort" and 0 < len(aborted_all.output_ids) < 500
    assert {"model_path", "is_generation", "weight_version", "architectures"} <= set(info)
    assert version == info["weight_version"]  # read from /model_info: /get_weight_version is a 404


def test_broadcast_sync_joins_the_group_as_sglang_does(fake_sglang):
    async def run():
        client = EngineClient(fake_sglang, kind="sglang")
        sender = WeightSender([client], backend="gloo", bucket_mb=1, engine_kind="sglang", group_name="wug")
        await asyncio.wait_for(sender.connect(), timeout=60)  # a wrong store key layout hangs here
        await sender.push(TENSORS.items(), weight_version=7)
        version = await client.get_weight_version()
        await client.close()
        return version, await fake_state(fake_sglang)

    version, state = asyncio.run(run())
    assert version == "7"
    for name, tensor in TENSORS.items():
        assert state["received"][name] == pytest.approx(float(tensor.double().sum()), rel=1e-6)
    assert state["update_flush_flags"] and not any(state["update_flush_flags"])  # never inside an update


def test_rank_offsets_count_every_tensor_parallel_rank():
    assert rank_offsets([1]) == ([1], 2)
    assert rank_offsets([4, 4]) == ([1, 5], 9)  # the seed's recipe: two TP-4 servers
    assert rank_offsets([2, 1, 3]) == ([1, 3, 4], 7)
    with pytest.raises(ValueError, match="tensor-parallel ranks"):
        rank_offsets([0])


def test_tensor_parallel_servers_join_with_a_rank_per_tp_rank(fresh_fakes):
    """Two servers, TP 2 and TP 1: the group is the trainer plus three ranks (1, 2 | 3), and every TP rank
    receives every tensor. The sizing tandem used before (1 + number of servers, offsets 1, 2, ...) is
    refused by the TP-2 server, as SGLang's rank 2 cannot be in a world of 2."""
    tp2, tp1 = fresh_fakes(2, 1)

    async def run():
        old = EngineClient(tp2, kind="sglang")
        with pytest.raises(EngineError, match="rank 2 .* not in a world of 2"):
            await old.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "old", "gloo")
        await old.close()
        clients = [EngineClient(url, kind="sglang") for url in (tp2, tp1)]
        sender = WeightSender(clients, backend="gloo", bucket_mb=1, engine_kind="sglang")
        await asyncio.wait_for(sender.connect(), timeout=120)
        await sender.push(TENSORS.items(), weight_version=1)
        for client in clients:
            await client.close()
        return sender.tp_sizes, await fake_state(tp2), await fake_state(tp1)

    tp_sizes, state2, state1 = asyncio.run(run())
    assert tp_sizes == [2, 1]  # read from each server's /server_info tp_size
    assert state2["ranks"] == [{"rank": 1, "world_size": 4}, {"rank": 2, "world_size": 4}]
    assert state1["ranks"] == [{"rank": 3, "world_size": 4}]
    for received in state2["rank_received"] + state1["rank_received"]:
        for name, tensor in TENSORS.items():
            assert received[name] == pytest.approx(float(tensor.double().sum()), rel=1e-6)


def test_update_from_tensor_carries_one_entry_per_tp_rank(fresh_fakes):
    (tp2,) = fresh_fakes(2)

    async def run():
        client = EngineClient(tp2, kind="sglang")
        sender = WeightSender([client], backend="cuda_ipc", engine_kind="sglang")
        await sender.connect()  # no group for CUDA IPC, but the TP sizes are read
        payload = "gASVAAAAAAAAAAAu"
        with pytest.raises(EngineError, match=r"serialized_named_tensors\[1\] is out of range"):
            await client.update_weights_from_tensor([payload], weight_version=1)  # what TP 1 would send
        answer = await client.update_weights_from_tensor(sender.ipc_entries(0, payload), weight_version=2)
        await client.close()
        return sender.ipc_entries(0, payload), answer, await fake_state(tp2)

    entries, answer, state = asyncio.run(run())
    assert len(entries) == 2 and answer["success"] is True
    assert state["tensor_entries_read"] == [[0, 1]] and state["weight_version"] == "2"


def test_update_from_tensor_entries_pass_sglangs_safe_unpickler(fresh_fakes):
    """tandem's own entry (a CPU tensor's reduction standing in for the CUDA one: the same torch module)
    loads under SGLang's allowlist; a pickle of one of tandem's classes kills the scheduler, as in SGLang.
    A field of the wrong type is refused first, as SGLang's schema does."""
    (url,) = fresh_fakes(1)
    ours = ipc_payload([("w", torch.arange(4.0).half())], "sglang")
    foreign = base64.b64encode(pickle.dumps([("w", ConfigError("not a tensor"))])).decode()

    async def run():
        # the schema's types too: a version is a string (pydantic turns no number into one)
        status, text = await raw_post(
            url + "/update_weights_from_tensor", {"serialized_named_tensors": [ours], "weight_version": 1}
        )
        assert status == 400 and "weight_version: Input should be a valid str" in text, text
        client = EngineClient(url, kind="sglang")
        answer = await client.update_weights_from_tensor([ours], weight_version=1)
        with pytest.raises(
            EngineError, match=r"Blocked unsafe class loading \(tandemrl\.config\.errors\.ConfigError\)"
        ):
            await client.update_weights_from_tensor([foreign], weight_version=2)
        await client.close()
        return answer, await fake_state(url)

    answer, state = asyncio.run(run())
    assert answer["success"] is True and state["weight_version"] == "1" and state["crashed"]


def test_retract_recomputes_every_kv_under_the_new_weights(fresh_fakes):
    """rollout.pause_mode=retract on SGLang: in-flight requests come back, the push is followed by a flush
    (SGLang is idle), and they resume with their tokens as prompt: no prefill reuses KV cached under the
    old weights, and each keeps every token it generated."""
    (url,) = fresh_fakes(1)

    async def run():
        client = EngineClient(url, kind="sglang", weight_version=0)
        sender = make_weight_sender("sglang", "gloo", [url], 1, pause_mode="retract")
        await asyncio.wait_for(sender.connect(), timeout=60)
        params = {"max_new_tokens": 40}
        rids = ["g0", "g1", "g2"]
        tasks = [asyncio.create_task(client.generate([9, i], params, rid=rid)) for i, rid in enumerate(rids)]
        await wait_for_progress(url, rids, 3)
        await client.pause_generation("retract")
        await sender.push(TENSORS.items(), weight_version=1)
        client.mark_weight_version(1)
        await client.continue_generation()
        results = await asyncio.gather(*tasks)
        for c in [client, *sender.clients]:
            await c.close()
        return results, await fake_state(url)

    results, state = asyncio.run(run())
    assert state["stale_prefills"] == [] and state["num_flushes"] == 1 and not state["crashed"]
    assert state["weight_version"] == "1" and not any(state["update_flush_flags"])
    for result in results:
        num_old = result.weight_versions.count(0)
        assert 0 < num_old < 40 and result.weight_versions == [0] * num_old + [1] * (40 - num_old)
        assert len(result.output_ids) == 40 and result.finish_reason == "length"
        assert result.prompt_tokens == 2


def test_a_retracted_request_outlives_the_abort_sglang_sends_after_its_first_stream(fresh_fakes):
    """SGLang aborts a streamed request's rid 2 s after its stream ended (`create_abort_task`): a retracted
    request sent again under the same rid within that time would be cut there. It goes again under a rid
    of its own and runs to its limit; the caller's abort still reaches it, under whichever rid it has now,
    and one the caller aborts while it waits for `continue` is not sent again."""
    from tests.fake_sglang import STREAM_ABORT_S, TOKEN_S

    (url,) = fresh_fakes(1)
    long = int(3 * STREAM_ABORT_S / TOKEN_S)  # still generating well after the first stream's abort fires

    async def run():
        client = EngineClient(url, kind="sglang")
        params = {"max_new_tokens": long}
        tasks = {
            rid: asyncio.create_task(client.generate([5, i], params, rid=rid)) for i, rid in enumerate("abc")
        }
        await wait_for_progress(url, list(tasks), 3)
        await client.pause_generation("retract")
        await client.abort_request("b")  # while it waits at the client for continue
        await client.continue_generation()
        await wait_for_progress(url, ["retry1-c"], 1)
        await client.abort_request("c")  # the caller's rid reaches the request it was sent again as
        results = {rid: await task for rid, task in tasks.items()}
        await client.close()
        return results

    results = asyncio.run(run())
    assert results["a"].finish_reason == "length" and len(results["a"].output_ids) == long
    assert results["b"].finish_reason == "abort" and len(results["b"].output_ids) < long
    assert results["c"].finish_reason == "abort" and len(results["c"].output_ids) < long


def test_sglangs_own_retract_mode_would_reuse_old_kv(fresh_fakes):
    """Why retract is not SGLang's `retract` mode: after an update without a flush (the only update
    SGLang accepts while retracted requests are queued) they re-prefill on the old weights' KV."""
    (url,) = fresh_fakes(1)

    async def run():
        client = EngineClient(url, kind="sglang")
        sender = make_weight_sender("sglang", "gloo", [url], 1, pause_mode="in_place")  # no flush
        await asyncio.wait_for(sender.connect(), timeout=60)
        task = asyncio.create_task(client.generate([4, 2], {"max_new_tokens": 30}, rid="r"))
        await wait_for_progress(url, ["r"], 3)
        status, _ = await raw_post(url + "/pause_generation", {"mode": "retract"})
        await sender.push(TENSORS.items(), weight_version=1)
        with pytest.raises(EngineError, match="400"):
            await client.flush_cache()  # the retracted request is queued: SGLang refuses
        await client.continue_generation()
        await task
        for c in [client, *sender.clients]:
            await c.close()
        return status, await fake_state(url)

    status, state = asyncio.run(run())
    assert status == 200 and state["stale_prefills"] == ["r"]


def test_in_place_never_asks_sglang_for_a_flush_while_requests_run(fresh_fakes):
    """in_place keeps running requests frozen with their KV: the push never carries `flush_cache: true`
    (SGLang's scheduler would die on the failed flush, as the second fake shows)."""
    url, victim = fresh_fakes(1, 1)

    async def run():
        client = EngineClient(url, kind="sglang", weight_version=0)
        sender = make_weight_sender("sglang", "gloo", [url], 1, pause_mode="in_place")
        await asyncio.wait_for(sender.connect(), timeout=60)
        task = asyncio.create_task(client.generate([3], {"max_new_tokens": 30}, rid="frozen"))
        await wait_for_progress(url, ["frozen"], 3)
        await client.pause_generation("in_place")
        await sender.push(TENSORS.items(), weight_version=1)
        client.mark_weight_version(1)
        await client.continue_generation()
        result = await task
        naive = EngineClient(victim, kind="sglang")
        naive_task = asyncio.create_task(naive.generate([3], {"max_new_tokens": 300}, rid="frozen"))
        await wait_for_progress(victim, ["frozen"], 2)
        await naive.pause_generation("in_place")
        body = {"serialized_named_tensors": ["gASVAAAAAAAAAAAu"], "flush_cache": True}
        status, _ = await raw_post(victim + "/update_weights_from_tensor", body)
        naive_task.cancel()
        for c in [client, naive, *sender.clients]:
            await c.close()
        return result, await fake_state(url), status, await fake_state(victim)

    result, state, status, victim_state = asyncio.run(run())
    assert not state["crashed"] and state["num_flushes"] == 0 and not any(state["update_flush_flags"])
    num_old = result.weight_versions.count(0)
    assert 0 < num_old < 30 and result.weight_versions == [0] * num_old + [1] * (30 - num_old)
    assert status == 500 and victim_state["crashed"]  # the flush an update asked for found a request


def test_drain_flushes_after_the_push(fresh_fakes):
    (url,) = fresh_fakes(1)

    async def run():
        client = EngineClient(url, kind="sglang")
        await client.generate([1, 2], {"max_new_tokens": 3})  # leaves the prompt in the cache
        sender = make_weight_sender("sglang", "gloo", [url], 1, pause_mode="drain")
        await asyncio.wait_for(sender.connect(), timeout=60)
        await sender.push(TENSORS.items(), weight_version=5)
        await client.generate([1, 2], {"max_new_tokens": 3})
        for c in [client, *sender.clients]:
            await c.close()
        return await fake_state(url)

    state = asyncio.run(run())
    assert state["num_flushes"] == 1 and state["stale_prefills"] == [] and state["weight_version"] == "5"


def test_tensor_and_disk_routes(fake_sglang, tmp_path):
    tensors = {"c.weight": torch.full((4, 4), 0.25)}

    async def run():
        client = EngineClient(fake_sglang, kind="sglang")
        answer = await client.update_weights_from_tensor(["gASVAAAAAAAAAAAu"], weight_version=8)
        sender = DiskWeightSender([client], tmp_path / "sync", flush_cache=False)
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
        await wait_for_progress(fake_sglang, ["timeline"], 3)
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


def test_speculation_counts_add_up_over_requests_and_retracted_pieces(fresh_fakes):
    """SGLang that speculates (`--speculative-num-draft-tokens 5`: 4 drafts a verify step) reports each
    finished request's counts in its meta_info; the client sums them (`EngineClient.counters`) into the
    embedded engine's counter names: every returned token once, retracted requests included (each piece
    is a request of its own), the rows the tokens less the accepted drafts, 4 drafts a verify step."""
    (url,) = fresh_fakes(1, extra_args=("--speculative-num-draft-tokens", "5"))

    async def run():
        client = EngineClient(url, kind="sglang")
        short = await asyncio.gather(*(client.generate([3, n], {"max_new_tokens": n}) for n in (1, 9, 10)))
        after_short = await client.counters()
        rids = ["s0", "s1"]
        tasks = [
            asyncio.create_task(client.generate([5, i], {"max_new_tokens": 40}, rid=r))
            for i, r in enumerate(rids)
        ]
        await wait_for_progress(url, rids, 3)
        await client.pause_generation("retract")
        await client.continue_generation()
        long = await asyncio.gather(*tasks)
        totals = await client.counters()
        await client.close()
        return short, after_short, long, totals

    short, after_short, long, totals = asyncio.run(run())
    assert [len(r.output_ids) for r in short] == [1, 9, 10]
    # 1 token: never verified, so no counts; 9 tokens: 4 verify steps accepting 4 drafts of 16; 10: 5, 4 of 20
    assert after_short == {
        "num_decode_emitted_tokens": 19.0,
        "num_decode_rows": 11.0,
        "num_spec_draft_tokens": 36.0,
        "num_spec_accepted_tokens": 8.0,
    }
    assert [len(r.output_ids) for r in long] == [40, 40]
    window = {key: totals[key] - after_short[key] for key in totals}
    assert window["num_decode_emitted_tokens"] == 80.0  # each token once, over both pieces of each request
    assert window["num_decode_rows"] + window["num_spec_accepted_tokens"] == 80.0
    # two pieces a request verify more often than one request of 40 tokens (20 steps, 19 accepted)
    assert window["num_spec_accepted_tokens"] < 2 * 19
    assert window["num_spec_draft_tokens"] == 4 * (
        window["num_decode_rows"] - 4
    )  # rows = verify steps + firsts
