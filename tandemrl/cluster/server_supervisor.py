"""One server of the run (an embedded engine, an SGLang or vLLM server, or the retrieval server), launched
and watched from the node it runs on.

`ServerSupervisor` is a plain class: on one machine without Ray it lives in the runner's process; with
Ray it is a Ray actor in the server's placement-group bundle, so the server it launches sees exactly
the GPUs Ray gave that bundle (`CUDA_VISIBLE_DEVICES` is inherited) and dies with the supervisor
(parent-death signal, see child_server.py). Ray runs a synchronous actor's calls on its main thread,
which lives as long as the actor: the thread the server's death signal is tied to.

Invariant: the URL it reports is one every node can reach: 127.0.0.1 on a one-node run, else the
node's own address.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tandemrl.host.startup import log_path as startup_log_path

if TYPE_CHECKING:
    from tandemrl.config.schema import TandemConfig
    from tandemrl.host.child_server import ChildServer

KINDS = ("embedded", "sglang", "vllm", "retrieval")


@dataclass
class ServerSpec:
    kind: str  # one of KINDS
    index: int  # the rollout instance (0 for the retrieval server)
    config: TandemConfig  # the run's TandemConfig
    model_path: str | None = None  # engines: the resolved weights directory
    index_dir: str | None = None  # retrieval: the resolved index directory
    port_offset: int = 0  # SGLang, vLLM: instances on one node count up from rollout.<backend>.port
    api_key: str | None = None  # the run's key for this server
    env: dict[str, str] = field(default_factory=dict)  # added to the server's environment (cluster/mps.py)
    cpus: tuple[int, ...] = ()  # the cores it keeps to (cluster/cpus.py); (): the run's shared cores
    # the run's start-up timeline file (host/startup.py), which a supervisor in a Ray actor joins
    startup_log: str | None = field(default_factory=startup_log_path)

    @property
    def name(self) -> str:
        return "retrieval server" if self.kind == "retrieval" else f"rollout engine {self.index}"


def node_address() -> str:
    """This node's address as other nodes see it (the interface of the default route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the interface
            return sock.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def server_log_path(spec: ServerSpec) -> Path:
    """A run's server logs under its output directory (`logs/rollout_engine_0.log`, ...), kept with
    the run: never in the temp directory, where they would pile up after every kill."""
    return Path(spec.config.runner.output_dir) / "logs" / f"{spec.name.replace(' ', '_')}.log"


def build_server(spec: ServerSpec, host: str) -> ChildServer:
    """The `ChildServer` for `spec`, bound to `host`."""
    from tandemrl.host.devices import resolve_device, resolve_dtype

    config = spec.config
    if spec.kind == "retrieval":
        from tandemrl.retrieval.server_process import RetrievalServerProcess

        return RetrievalServerProcess(
            spec.index_dir,
            mode=config.retrieval.mode,
            host=host,
            api_key=spec.api_key,
            num_threads=config.retrieval.num_threads,
        )
    rollout, seed = config.rollout, config.runner.seed + spec.index
    if spec.kind == "sglang":
        from tandemrl.rollout.sglang_process import SglangServerProcess

        host = rollout.sglang.host or host
        port = rollout.sglang.port + spec.port_offset
        return SglangServerProcess(rollout, spec.model_path, host, port, seed, api_key=spec.api_key)
    device = resolve_device(rollout.device)
    if spec.kind == "vllm":
        from tandemrl.rollout.vllm_server import VllmServer

        port = None if rollout.vllm.port is None else rollout.vllm.port + spec.port_offset
        dtype = resolve_dtype(rollout.dtype, device)
        host = rollout.vllm.host or host
        return VllmServer.from_rollout(
            rollout, spec.model_path, host, port, seed, device, dtype, spec.api_key
        )
    from tandemrl.rollout.engine_process import EngineProcess

    engine = EngineProcess.from_rollout(
        rollout, spec.model_path, device, resolve_dtype(rollout.dtype, device), seed, api_key=spec.api_key
    )
    engine.host = host
    return engine


class ServerSupervisor:
    """`remote`: it runs as a Ray actor (a process of its own), which joins the start-up timeline."""

    def __init__(self, spec: ServerSpec, multi_node: bool, remote: bool = False):
        from tandemrl.host.startup import adopt, mark, mark_process_started

        self.spec = spec
        if remote:
            adopt(spec.startup_log, f"{spec.name} supervisor")
            mark_process_started()
        self.server = build_server(spec, node_address() if multi_node else "127.0.0.1")
        if spec.config.runner.output_dir:
            self.server.log_path = server_log_path(spec)
        self.server.env = {**(self.server.env or {}), **spec.env}
        self.server.cpus = spec.cpus
        self.server.timeline_name = spec.name
        if remote:
            mark("supervisor ready")

    def launch(self) -> str:
        """Spawn the server; returns its URL (it is not healthy yet)."""
        self.server.launch()
        return self.server.url

    def wait_healthy(self) -> str:
        self.server.wait_healthy()
        return self.server.url

    def status(self) -> tuple[bool, int | None]:
        """(alive, exit code)."""
        proc = self.server.proc
        return (proc is not None and proc.poll() is None), (proc.returncode if proc is not None else None)

    def log_tail(self, num_chars: int = 2000) -> str:
        return self.server.log_tail(num_chars)

    def stop(self) -> None:
        self.server.stop()
