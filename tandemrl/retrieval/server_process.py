"""Run the retrieval server as a child process (`python -m tandemrl.cli serve-retrieval ...`).

Used by the runner, `tandem eval`, the SFT renderer, the benchmark and the tests. Qdrant local mode
allows one process per index path, so this child owns the index and everyone else goes through HTTP.
Start/health/stop semantics are `ChildServer`'s.
"""

from __future__ import annotations

from pathlib import Path

from tandemrl.host.child_server import ChildServer


class RetrievalServerProcess(ChildServer):
    name = "retrieval server"

    def __init__(
        self,
        index_dir: str | Path,
        port: int | None = None,
        mode: str | None = "dense",
        host: str = "127.0.0.1",
        qdrant_url: str | None = None,
        startup_timeout_s: float = 180.0,
        log_path: str | Path | None = None,
        api_key: str | None = None,
        fusion: str | None = None,  # zscore | rrf; None: the server's default (zscore)
        num_threads: int = 0,  # its compute thread pools (retrieval.num_threads); 0: one thread per core
    ):
        from tandemrl.host.cpus import thread_env
        from tandemrl.host.http_guard import RETRIEVAL_KEY_ENV

        # the key travels in the environment, never on the command line; "" clears an inherited one;
        # the pools' sizes too, since numpy starts OpenBLAS's on import, before the flag is read
        env = {RETRIEVAL_KEY_ENV: api_key or "", **thread_env(num_threads)}
        super().__init__(port, host, startup_timeout_s, log_path, env)
        self.num_threads = num_threads
        self.api_key = api_key
        self.index_dir = Path(index_dir)
        self.mode = mode
        self.fusion = fusion
        self.qdrant_url = qdrant_url

    @property
    def addr(self) -> str:
        """`host:port`, the form of `tools.search.server_addr`."""
        return f"{self.host}:{self.port}"

    def server_args(self) -> list[str]:
        args = [
            "serve-retrieval",
            "--index",
            str(self.index_dir),
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]
        if self.mode:
            args += ["--mode", self.mode]
        if self.qdrant_url:
            args += ["--qdrant-url", self.qdrant_url]
        if self.fusion:
            args += ["--fusion", self.fusion]
        if self.num_threads:
            args += ["--num-threads", str(self.num_threads)]
        return args
