"""The engine process under faults and hostile input (docs/RELIABILITY.md lists what each test guards).

One engine with an API key, a 1 MiB body limit, a 3 s weight-update timeout and a 1 s /health stall
threshold; this process plays the trainer over a real gloo group. Every refused update must leave the
weights (greedy output) and the weight version exactly as they were.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import aiohttp
import pytest
import torch

from tandemrl.engine.weight_transport import broadcast, new_process_group
from tandemrl.host.child_server import free_port
from tandemrl.host.http_guard import PORT_IN_USE_EXIT
from tandemrl.rollout.client import EngineClient
from tandemrl.rollout.engine_process import EngineProcess
from tandemrl.rollout.weight_sync import WeightSender
from tests.integration.engine_helpers import hf_state_dict

KEY = "test-key-0123456789"
PROMPT = [1, 504, 3237, 28, 9]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
AUTH = {"Authorization": f"Bearer {KEY}"}


class _FaultEngine(EngineProcess):
    """The real engine process with the test's limits as extra serve-engine flags."""

    def server_args(self) -> list[str]:
        return super().server_args() + ["--max-request-mb", "1", "--health-stall-s", "1"]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    with _FaultEngine(tiny_llama_dir, max_context_len=256, api_key=KEY, weight_update_timeout_s=3) as proc:
        yield proc


async def request(url: str, method: str, path: str, body=None, headers=None) -> tuple[int, str]:
    async with aiohttp.ClientSession(headers=headers or {}) as session:
        data = body if isinstance(body, (str, bytes)) else None
        payload = None if isinstance(body, (str, bytes)) or body is None else body
        async with session.request(method, url + path, data=data, json=payload) as resp:
            return resp.status, await resp.text()


def call(engine, method, path, body=None, headers=AUTH) -> tuple[int, str]:
    return asyncio.run(request(engine.url, method, path, body, headers))


def state(engine) -> tuple[list[int], str]:
    """(greedy output of PROMPT, weight version): what a refused update must leave unchanged."""

    async def run():
        client = EngineClient(engine.url, api_key=KEY)
        try:
            result = await client.generate(PROMPT, GREEDY)
            return result.output_ids, await client.get_weight_version()
        finally:
            await client.close()

    return asyncio.run(run())


CONTROL = [
    ("POST", "/generate", {"input_ids": PROMPT}),
    ("POST", "/pause_generation", {"mode": "abort"}),
    ("POST", "/continue_generation", {}),
    ("POST", "/abort_request", {"abort_all": True}),
    ("POST", "/flush_cache", {}),
    ("GET", "/get_weight_version", None),
    ("GET", "/get_server_info", None),
    ("GET", "/get_model_info", None),
    ("GET", "/model_info", None),
    ("GET", "/server_info", None),
    (
        "POST",
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2},
    ),
    ("POST", "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}),
    ("POST", "/update_weights_from_tensor", {"named_tensors": []}),
]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_every_control_endpoint_refuses_a_request_without_the_key(engine, headers):
    for method, path, body in CONTROL:
        status, text = call(engine, method, path, body, headers)
        assert status == 401 and "API key" in text and KEY not in text, (path, status, text)
    assert call(engine, "GET", "/health", headers={})[0] == 200  # liveness stays open


def test_the_key_is_in_no_log_and_no_command_line(engine):
    assert state(engine)[0]  # the key works
    assert KEY not in engine.log_tail(10**6)
    with open(f"/proc/{engine.proc.pid}/cmdline", "rb") as f:
        assert KEY.encode() not in f.read()
    assert KEY not in " ".join(engine.command())


def test_a_run_launches_engines_with_a_fresh_key(tmp_path):
    from tandemrl.config.loader import load_config

    rollout = load_config(None, []).rollout
    first = EngineProcess.from_rollout(rollout, tmp_path, "cpu", "float32", 0)
    second = EngineProcess.from_rollout(rollout, tmp_path, "cpu", "float32", 0)
    assert first.api_key and second.api_key and first.api_key != second.api_key
    assert len(first.api_key) >= 32 and first.env["TANDEM_ENGINE_API_KEY"] == first.api_key


def _announce(names, shapes, dtypes=None, version=None, group="weight_update_group") -> dict:
    body = {
        "names": names,
        "shapes": shapes,
        "dtypes": dtypes or ["float32"] * len(names),
        "group_name": group,
    }
    if version is not None:
        body["weight_version"] = version
    return body


def _join(engine, group: str) -> object:
    """Form a gloo group with the engine (rank 0 here), as a trainer does."""
    port = free_port()
    result = {}
    thread = threading.Thread(
        target=lambda: result.setdefault(
            "group", new_process_group("127.0.0.1", port, 0, 2, group, "gloo", 10.0)
        )
    )
    thread.start()
    body = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": group,
    }
    status, text = call(engine, "POST", "/init_weights_update_group", body)
    thread.join()
    assert status == 200, text
    return result["group"]


def test_partial_update_leaves_the_old_weights(engine, tiny_llama_dir):
    """A valid tensor then an unknown name: refused before anything is received or copied."""
    _join(engine, "partial")
    before = state(engine)
    embed = hf_state_dict(tiny_llama_dir)["model.embed_tokens.weight"]
    cases = [
        _announce(
            ["model.embed_tokens.weight", "model.bogus.weight"], [list(embed.shape), [4]], group="partial"
        ),
        _announce(["model.embed_tokens.weight"], [[-1, 64]], group="partial"),  # negative shape
        _announce(["model.embed_tokens.weight"], [[10**12, 10**12]], group="partial"),  # absurd shape
        _announce(["model.embed_tokens.weight"], [list(embed.shape)], ["int64"], group="partial"),
        _announce(["model.embed_tokens.weight"], [list(embed.shape)], version=-5, group="partial"),
    ]
    reasons = ["model.bogus.weight", "shapes", "shapes", "dtypes", "weight_version"]
    for body, reason in zip(cases, reasons, strict=True):
        status, text = call(engine, "POST", "/update_weights_from_distributed", body)
        assert status == 400 and reason in text and "Traceback" not in text, text
    assert state(engine) == before


def test_nan_weights_and_old_versions_are_refused(engine, tiny_llama_dir):
    async def run():
        client = EngineClient(engine.url, api_key=KEY)
        sender = WeightSender([client], backend="gloo", bucket_mb=1000, group_name="nan")
        await sender.connect()
        weights = hf_state_dict(tiny_llama_dir)
        version = int(await client.get_weight_version())
        nan = torch.full_like(weights["model.norm.weight"], float("nan"))
        try:  # one bucket: every tensor is received, then the values are checked before any copy
            await sender.push(dict(weights, **{"model.norm.weight": nan}).items(), weight_version=version + 1)
            error = ""
        except Exception as raised:
            error = str(raised)
        await sender.push(weights.items(), weight_version=version + 1)  # the same weights, a newer version
        after = await client.get_weight_version()
        await client.close()
        return error, version, after

    before = state(engine)
    error, version, after = asyncio.run(run())
    assert "NaN or infinite" in error and "model.norm.weight" in error, error
    assert after == str(version + 1) and state(engine)[0] == before[0]
    norm = hf_state_dict(tiny_llama_dir)["model.norm.weight"]
    body = _announce(["model.norm.weight"], [list(norm.shape)], version=version, group="nan")
    status, text = call(engine, "POST", "/update_weights_from_distributed", body)  # older than version + 1
    assert status == 400 and "not larger than the current weight_version" in text, text
    assert state(engine) == (before[0], str(version + 1))


@pytest.mark.parametrize("num_sent", [0, 1], ids=["stalled", "sender-dies-mid-batch"])
def test_an_update_whose_tensors_stop_arriving_is_aborted(engine, tiny_llama_dir, num_sent):
    """Announced, then nothing (or one of three tensors) arrives: after the 3 s timeout the update is
    aborted, the old weights stay, /health reported the blocked loop meanwhile, and the engine serves."""
    group = _join(engine, f"stall{num_sent}")
    before = state(engine)
    weights = hf_state_dict(tiny_llama_dir)
    names = ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0.mlp.up_proj.weight"]
    body = _announce(names, [list(weights[n].shape) for n in names], group=f"stall{num_sent}")

    async def run():
        update = asyncio.create_task(
            request(engine.url, "POST", "/update_weights_from_distributed", body, AUTH)
        )
        for name in names[:num_sent]:
            await asyncio.to_thread(broadcast, group, torch.zeros_like(weights[name]), 0)
        health = []
        while not update.done():
            health.append(await request(engine.url, "GET", "/health"))
            await asyncio.sleep(0.3)
        return await update, health

    (status, text), health = asyncio.run(run())
    assert (
        status == 500
        and f"after receiving {num_sent} of 3 tensors" in text
        and "No weight was changed" in text
    )
    assert any(code == 503 and "blocked" in reason for code, reason in health), health
    assert call(engine, "GET", "/health", headers={})[0] == 200
    assert state(engine) == before


BAD_GENERATE = [
    ({"input_ids": PROMPT, "text": "hi"}, "either text or input_ids"),
    ('{"input_ids": [1, 2], "sampling_params": {"temperature": Infinity}}', "sampling_params.temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
    ({"input_ids": [1, True, 2]}, "input_ids"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"stop": 5}}, "sampling_params.stop"),
    ({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": 7}}, "sampling_params.stop_token_ids"),
    ({"input_ids": [1, 2], "sampling_params": {"ignore_eos": "yes"}}, "sampling_params.ignore_eos"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": True}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": [1]}, "sampling_params must be"),
    ({"input_ids": [1, 2], "return_logprob": "no"}, "return_logprob"),
    ({"input_ids": [1, 2], "rid": {"a": 1}}, "rid"),
    ({"text": ["a", "b"]}, "text must be"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
]


@pytest.mark.parametrize("body, field", BAD_GENERATE)
def test_bad_generate_is_400_naming_the_field(engine, body, field):
    status, text = call(engine, "POST", "/generate", body)
    assert status == 400 and field in text, text
    assert "Traceback" not in text and "object is not" not in text and "not supported between" not in text


def test_bad_weight_update_bodies_are_400(engine):
    _join(engine, "bodies")
    cases = [
        {"names": "x", "dtypes": [], "shapes": [], "group_name": "bodies"},
        {"names": [["a"]], "dtypes": ["float32"], "shapes": [[1]], "group_name": "bodies"},
        {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": ["64"], "group_name": "bodies"},
        {"names": ["model.norm.weight"], "dtypes": [{"x": 1}], "shapes": [[64]], "group_name": "bodies"},
        {"dtypes": [], "shapes": [], "group_name": "bodies"},
        '{"names": ' + "[" * 50_000 + "]" * 50_000 + "}",
    ]
    for body in cases:
        status, text = call(engine, "POST", "/update_weights_from_distributed", body)
        assert status == 400 and "Traceback" not in text, (
            body if isinstance(body, dict) else body[:40],
            text,
        )


def test_oversize_bodies_get_413_and_the_engine_keeps_serving(engine):
    big = json.dumps({"input_ids": [1] * 400_000})  # ~2.4 MB against the 1 MiB limit
    status, text = call(engine, "POST", "/generate", big)
    assert status == 413 and "too large" in text and "limit" in text, text

    async def chunked():  # no Content-Length: the limit is enforced while the body is read
        async def body():
            for _ in range(40):
                yield b" " * 65536

        async with aiohttp.ClientSession(headers=AUTH) as session:
            async with session.post(engine.url + "/generate", data=body()) as resp:
                return resp.status, await resp.text()

    status, text = asyncio.run(chunked())
    assert status == 413 and "too large" in text, text
    assert state(engine)[0]


def test_sigterm_stops_an_engine_with_a_group_join_pending(tiny_llama_dir):
    """A join to a rendezvous that accepts and never answers (600 s timeout): SIGTERM must still end the
    server. The signal goes once the engine has connected to it, so the join is pending for sure."""
    with (
        EngineProcess(tiny_llama_dir, max_context_len=128, api_key=KEY) as proc,
        socket.create_server(("127.0.0.1", 0)) as master,
    ):
        port = master.getsockname()[1]
        body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
        master.settimeout(120.0)  # a hang guard: the engine connects as soon as it gets the request

        async def join_then_term():
            join = asyncio.create_task(request(proc.url, "POST", "/init_weights_update_group", body, AUTH))
            peer, _ = await asyncio.to_thread(master.accept)  # the engine is in the rendezvous now
            assert not join.done()
            os.kill(proc.proc.pid, signal.SIGTERM)
            start = time.monotonic()
            while proc.proc.poll() is None and time.monotonic() - start < 60:
                await asyncio.sleep(0.2)
            join.cancel()
            peer.close()
            return proc.proc.poll()

        code = asyncio.run(join_then_term())
        if code is None:
            proc.proc.kill()
        assert code is not None, "serve-engine ignored SIGTERM while a group join was pending"


@pytest.mark.parametrize(
    "body, field",
    [
        ({"master_port": 1, "rank_offset": 1, "world_size": 2}, "master_address"),
        (
            {"master_address": "127.0.0.1", "master_port": "80", "rank_offset": 1, "world_size": 2},
            "master_port",
        ),
        (
            {"master_address": "127.0.0.1", "master_port": 70000, "rank_offset": 1, "world_size": 2},
            "master_port",
        ),
        (
            {"master_address": "127.0.0.1", "master_port": 80, "rank_offset": 0, "world_size": 2},
            "rank_offset",
        ),
        (
            {"master_address": "h", "master_port": 80, "rank_offset": 1, "world_size": 2, "group_name": [1]},
            "group_name",
        ),
        (
            {"master_address": "h", "master_port": 80, "rank_offset": 1, "world_size": 2, "backend": "mpi"},
            "backend",
        ),
    ],
)
def test_bad_group_joins_are_400_naming_the_field(engine, body, field):
    status, text = call(engine, "POST", "/init_weights_update_group", body)
    assert status == 400 and field in text and "Traceback" not in text, text


# ---- round two (docs/RELIABILITY.md rows 14-16): inputs that were accepted silently or crashed --------


def _raw_post(url: str, path: str, headers: dict[str, bytes], body: bytes = b"{}") -> tuple[int, str]:
    """POST with header values sent as raw bytes (aiohttp's client refuses non-ASCII values)."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        connection.putrequest("POST", path)
        for name, value in {**headers, "Content-Type": b"application/json"}.items():
            connection.putheader(name, value)
        connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, response.read().decode("utf-8", "replace")
    finally:
        connection.close()


@pytest.mark.parametrize("value", [b"Bearer \xff\xfe", b"\xff", b"Bearer " + KEY.encode() + b"\x80"])
def test_an_authorization_header_that_is_not_utf8_is_401(engine, value):
    status, text = _raw_post(
        engine.url, "/generate", {"Authorization": value}, json.dumps({"input_ids": PROMPT}).encode()
    )
    assert status == 401 and "API key" in text, (status, text)
    assert "Traceback" not in engine.log_tail(20_000) and state(engine)[0]


SILENT_GENERATE = [
    (
        {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [10**12]}},
        "sampling_params.stop_token_ids",
    ),
    (
        {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [2**31 - 2]}},
        "sampling_params.stop_token_ids",
    ),
    ({"input_ids": [1, 2], "sampling_params": {"top_k": 10**30}}, "sampling_params.top_k"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**30}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"stop": ["a"] * 1000}}, "sampling_params.stop"),
    ('{"text": "caf\\ud800"}', "text is not valid Unicode"),
    ('{"input_ids": [1, 2], "sampling_params": {"stop": ["\\udc00"]}}', "sampling_params.stop"),
    ({}, "send input_ids (a list of token ids) or text"),
    ({"sampling_params": {"max_new_tokens": 2}}, "send input_ids (a list of token ids) or text"),
]


@pytest.mark.parametrize("body, field", SILENT_GENERATE)
def test_generate_inputs_accepted_or_crashing_before_are_400_naming_the_field(engine, body, field):
    status, text = call(engine, "POST", "/generate", body)
    assert status == 400 and field in text, (status, text)
    assert "Traceback" not in text


def test_absurd_versions_rope_buffers_and_repeated_names_are_refused(engine, tiny_llama_dir):
    """Each was accepted before: 10**30 then refused every normal update, inv_freq was received and
    ignored, a repeated name let its second copy win. Refused before anything is received; a normal
    update still lands after them."""
    _join(engine, "silent")
    before = state(engine)
    norm = list(hf_state_dict(tiny_llama_dir)["model.norm.weight"].shape)
    version = int(before[1])
    rope = "model.layers.0.self_attn.rotary_emb.inv_freq"
    cases = [
        (_announce(["model.norm.weight"], [norm], version=10**30, group="silent"), "weight_version"),
        (_announce(["model.norm.weight"], [norm], version="9" * 40, group="silent"), "weight_version"),
        (_announce(["model.norm.weight"], [norm], version=2**31, group="silent"), "weight_version"),
        (_announce([rope], [[4]], group="silent"), "RoPE buffer"),
        (
            _announce(["model.norm.weight", "model.norm.weight"], [norm, norm], group="silent"),
            "appears twice",
        ),
    ]
    for body, reason in cases:
        status, text = call(engine, "POST", "/update_weights_from_distributed", body)
        assert status == 400 and reason in text, (reason, status, text)
    assert state(engine) == before

    async def push_normally():
        client = EngineClient(engine.url, api_key=KEY)
        sender = WeightSender([client], backend="gloo", bucket_mb=1000, group_name="silent-push")
        await sender.connect()
        await sender.push(hf_state_dict(tiny_llama_dir).items(), weight_version=version + 1)
        after = await client.get_weight_version()
        await client.close()
        return after

    assert asyncio.run(push_normally()) == str(version + 1)


def _serve_engine(model_dir, *flags: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TANDEM_ENGINE_API_KEY", "SGLANG_API_KEY")}
    env.update(env_extra or {})
    command = [
        sys.executable,
        "-m",
        "tandemrl.cli",
        "serve-engine",
        "--model",
        str(model_dir),
        "--device",
        "cpu",
    ]
    # timeout: a hang guard only (before the fix, both cases served until killed)
    return subprocess.run([*command, *flags], capture_output=True, text=True, env=env, timeout=180)


def test_serve_engine_beyond_loopback_needs_a_key(tiny_llama_dir):
    result = _serve_engine(tiny_llama_dir, "--host", "0.0.0.0", "--port", str(free_port()))
    assert result.returncode == 2 and "--api-key" in result.stderr and "0.0.0.0" in result.stderr, (
        result.stderr
    )
    assert "Traceback" not in result.stderr


def test_a_port_in_use_is_reported_before_the_model_loads(tiny_llama_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _serve_engine(tiny_llama_dir, "--host", "127.0.0.1", "--port", str(port))
    # its own exit status: a launcher that picked the port picks another (test below)
    assert result.returncode == PORT_IN_USE_EXIT
    assert f"127.0.0.1:{port} is already in use" in result.stderr, result.stderr
    assert (
        "Traceback" not in result.stderr and "serving" not in result.stderr and "loaded" not in result.stderr
    )


def test_a_port_taken_before_the_engine_binds_it_is_traded_for_another(tiny_llama_dir, monkeypatch):
    """The launcher picks a free port, then the child binds it: something may take it in between (an
    outgoing connection's source port). The launcher that picked it picks another and launches again;
    a port the user gave is never traded."""
    import tandemrl.host.child_server as child_server

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        picks = iter([taken])
        real_free_port = child_server.free_port
        monkeypatch.setattr(
            child_server, "free_port", lambda host="127.0.0.1": next(picks, None) or real_free_port(host)
        )
        with EngineProcess(tiny_llama_dir, max_context_len=128) as proc:
            assert proc.port != taken and proc.port_retries == 1
            assert proc.health() is not None
            assert "is already in use" in proc.log_tail()  # the first try's line stays in the log
        given = EngineProcess(tiny_llama_dir, max_context_len=128, port=taken)
        with pytest.raises(RuntimeError, match=f"(?s)exited with code {PORT_IN_USE_EXIT}.*already in use"):
            given.start()
        assert given.port == taken and given.port_retries == 0
