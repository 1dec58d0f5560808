"""tandem launches SGLang and vLLM servers from the config: the command line, the run's API key (never on
the command line), the interpreter and PYTHONPATH of the engine's own environment, and the launch
path itself (spawn, /health, watchdog, stop) through `Services` with a FAKE vLLM: a package named
`vllm` put on the server's PYTHONPATH only, standing in for vLLM at the process boundary (it serves
/health and reports the command line and environment it was started with)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import urllib.request

import pytest

from tandemrl.cluster.server_supervisor import build_server
from tandemrl.config.loader import load_config
from tandemrl.runner.services import EngineDiedError, Services

FAKE_VLLM = '''"""FAKE vLLM API server (tests/integration/test_engine_launch.py): /health, and what it was started with."""
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
keys = ("VLLM_API_KEY", "VLLM_SERVER_DEV_MODE", "VLLM_CPU_KVCACHE_SPACE", "PYTHONPATH")
report = json.dumps({"argv": args, "env": {k: os.environ.get(k) for k in keys}}).encode()


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = report if self.path == "/fake/started_with" else b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def write_fake_vllm(root) -> None:
    package = root / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for directory in (root / "vllm", root / "vllm" / "entrypoints", package):
        (directory / "__init__.py").write_text("")
    (package / "api_server.py").write_text(FAKE_VLLM)


def engine_config(tmp_path, backend: str, *overrides: str):
    (tmp_path / "model").mkdir(exist_ok=True)
    return load_config(
        None,
        [
            f"rollout.backend={backend}",
            f"rollout.model.model_path={tmp_path / 'model'}",
            "rollout.max_context_len=3072",
            "rollout.max_running_requests=48",
            "retrieval.launch=false",
            *overrides,
        ],
    )


def test_sglang_command_line_and_key_file(tmp_path):
    config = engine_config(
        tmp_path,
        "sglang",
        "cluster.use_ray=true",
        "rollout.device=cuda",
        "rollout.tensor_parallel_size=2",
        "rollout.sglang.python=/opt/sglang-env/bin/python",
        "rollout.sglang.pythonpath=[/opt/eng_site]",
        "rollout.sglang.extra_args=[--attention-backend,fa3]",
    )
    services = Services(config)
    _, remote = services._specs()  # SGLang servers are Ray actors: specs only, nothing started here
    ((_, spec, _),) = remote
    assert spec.api_key == services.engine_api_key and spec.api_key  # a fresh key of the run
    server = build_server(spec, "127.0.0.1")
    command = server.command()
    assert command[:3] == ["/opt/sglang-env/bin/python", "-m", "sglang.launch_server"]
    switch = "--incremental-streaming-output"  # each streamed chunk holds only its new tokens
    assert command.count(switch) == 1
    pairs = [arg for arg in command[3:] if arg != switch]
    flags = dict(zip(pairs[::2], pairs[1::2], strict=False))
    assert flags["--tp-size"] == "2" and flags["--context-length"] == "3072"
    assert flags["--max-running-requests"] == "48" and flags["--port"] == "30000"
    assert command[-2:] == ["--attention-backend", "fa3"]
    assert spec.api_key not in " ".join(command)
    assert server.env["PYTHONPATH"].split(os.pathsep)[0] == "/opt/eng_site"
    server._write_config()  # what launch() writes before spawning SGLang
    path = server.config_path
    assert flags["--config"] == str(path) and path.suffix == ".yaml"  # SGLang takes YAML only
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.read_text() == f'api-key: "{spec.api_key}"\n'  # SGLang turns it into --api-key
    server.stop()
    assert not path.exists()


def test_vllm_compile_cache_lives_in_the_tandem_home_unless_the_caller_names_one(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    cpu = engine_config(tmp_path, "vllm", "cluster.use_ray=false", "rollout.device=cpu")
    ((_, spec, _),) = Services(cpu)._specs()[0]
    assert build_server(spec, "127.0.0.1").env["VLLM_CACHE_ROOT"] == str(tmp_path / "home" / "cache" / "vllm")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "mine"))
    assert build_server(spec, "127.0.0.1").env["VLLM_CACHE_ROOT"] == str(tmp_path / "mine")


def test_vllm_command_lines_on_cpu_and_gpu(tmp_path):
    cpu = engine_config(tmp_path, "vllm", "cluster.use_ray=false", "rollout.device=cpu")
    services = Services(cpu)
    local, remote = services._specs()
    assert remote == []  # without Ray the server is the runner's own child
    ((_, spec, _),) = local
    server = build_server(spec, "127.0.0.1")
    command = server.command()
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(command[3::2], command[4::2], strict=False))
    assert flags["--max-model-len"] == "3072" and flags["--max-num-seqs"] == "48"
    assert flags["--dtype"] == "float32" and "--enforce-eager" in command
    assert flags["--worker-extension-cls"] == "tandemrl.rollout.vllm_worker.WeightLoader"
    assert server.env["VLLM_API_KEY"] == services.engine_api_key and services.engine_api_key not in command
    assert server.env["VLLM_SERVER_DEV_MODE"] == "1" and server.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    gpu = engine_config(
        tmp_path,
        "vllm",
        "cluster.use_ray=false",
        "rollout.device=cuda",
        "rollout.tensor_parallel_size=2",
        "rollout.vllm.gpu_memory_utilization=0.4",
        "rollout.vllm.port=8100",
    )
    ((_, gpu_spec, _),) = Services(gpu)._specs()[0]
    gpu_command = build_server(gpu_spec, "127.0.0.1").command()
    gpu_flags = dict(zip(gpu_command[3::2], gpu_command[4::2], strict=False))
    assert gpu_flags["--gpu-memory-utilization"] == "0.4" and gpu_flags["--tensor-parallel-size"] == "2"
    assert gpu_flags["--dtype"] == "bfloat16" and gpu_flags["--port"] == "8100"
    assert "--enforce-eager" not in gpu_command


def test_tandem_launches_watches_and_stops_a_vllm_server(tmp_path):
    """The real launch path (Services, supervisor, /health, the watchdog's liveness check, stop) with the
    FAKE vLLM package on the server's PYTHONPATH only; a server that dies is named by the watchdog."""
    write_fake_vllm(tmp_path / "engine_site")
    config = engine_config(
        tmp_path,
        "vllm",
        "cluster.use_ray=false",
        "rollout.device=cpu",
        "rollout.startup_timeout_s=60",
        f"rollout.vllm.pythonpath=[{tmp_path / 'engine_site'}]",
    )
    services = Services(config).start()
    try:
        (url,) = services.engine_urls
        (handle,) = services.engine_handles
        process = handle.supervisor.server.proc
        with urllib.request.urlopen(url + "/fake/started_with", timeout=10) as response:
            seen = json.loads(response.read())
        assert seen["env"]["VLLM_API_KEY"] == services.engine_api_key
        assert seen["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "engine_site")
        assert "--worker-extension-cls" in seen["argv"] and services.engine_api_key not in seen["argv"]
        asyncio.run(services.check())  # alive: no error
        process.kill()
        process.wait(timeout=30)
        with pytest.raises(EngineDiedError, match="rollout engine 0 at .* died"):
            asyncio.run(services.check())
    finally:
        services.stop()
    assert process.poll() is not None
