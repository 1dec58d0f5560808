"""Nothing secret or bulky is left behind (issue 42, item 10): the API key file of a launched SGLang
server is removed by the run's reaper after a kill -9 of `tandem train`'s process (and by any later
reaper once its run has no process left); a run's server logs live under its output directory; a
server given no log path logs in a temp directory that its clean stop removes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tandemrl.cluster.reaper import remove_key_dirs
from tandemrl.cluster.server_supervisor import ServerSpec, ServerSupervisor
from tandemrl.config.loader import load_config
from tandemrl.host.child_server import ChildServer

# `tandem train`'s process, cut down to what matters here: its reaper, and an SGLang server launched
# with the run's key. The server is a FAKE `sglang.launch_server` (a module that sleeps), standing in
# for SGLang at the process boundary: the key file is written before SGLang would read it.
DRIVER = """
import sys, time
from tandemrl.cluster.reaper import start_reaper
from tandemrl.config.loader import load_config
from tandemrl.rollout.sglang_process import SglangServerProcess

start_reaper()
config = load_config(None, ["rollout.backend=sglang", "rollout.sglang.pythonpath=[{fake}]"])
server = SglangServerProcess(config.rollout, "/no/model", "127.0.0.1", 1, seed=0, api_key="k" * 43)
server.launch()
print(server.config_path, flush=True)
time.sleep(600)
"""


def _fake_sglang(root: Path) -> Path:
    (root / "sglang").mkdir(parents=True)
    (root / "sglang" / "__init__.py").write_text("")
    (root / "sglang" / "launch_server.py").write_text("import time\ntime.sleep(600)\n")
    return root


def test_the_reaper_removes_the_key_file_of_a_killed_run(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    script = DRIVER.replace("{fake}", str(_fake_sglang(tmp_path / "fake")))
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": os.getcwd()}
    env.pop("TANDEM_RUN_ID", None)
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    key_file = Path(driver.stdout.readline().strip())
    assert key_file.parent.parent == temp and key_file.is_file(), key_file
    assert "k" * 43 in key_file.read_text() and (key_file.stat().st_mode & 0o077) == 0
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    driver.stdout.close()
    deadline = time.monotonic() + 60  # the reaper's grace period for the server, then the sweep
    while key_file.parent.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not key_file.parent.exists(), list(temp.iterdir())


def test_a_later_reaper_sweeps_the_key_dirs_of_owners_with_no_process_left(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    dirs = {
        "a run with no process": tmp_path / "tandem-sglang-key-0123abcd-x1",
        "a dead process": tmp_path / f"tandem-sglang-key-pid{int(dead_pid.stdout)}-x2",
        "this process": tmp_path / f"tandem-sglang-key-pid{os.getpid()}-x3",
    }
    for path in dirs.values():
        path.mkdir()
        (path / "args.yaml").write_text('api-key: "secret"\n')
    removed = remove_key_dirs()
    assert set(removed) == {dirs["a run with no process"], dirs["a dead process"]}
    assert dirs["this process"].is_dir() and not dirs["a dead process"].exists()


def test_a_runs_server_logs_under_its_output_dir_and_nothing_lands_in_temp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    config = load_config(None, [f"runner.output_dir={tmp_path / 'run'}"])
    supervisor = ServerSupervisor(
        ServerSpec("retrieval", 0, config, index_dir=str(tmp_path)), multi_node=False
    )
    assert supervisor.server.log_path == tmp_path / "run" / "logs" / "retrieval_server.log"
    assert list((tmp_path / "tmp").iterdir()) == []


class Sleeper(ChildServer):
    """A real child process that never answers /health: enough to launch and stop."""

    name = "sleeper"

    def command(self) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(600)"]


@pytest.mark.parametrize("ends", ["stopped", "died by itself"])
def test_a_temp_log_goes_at_a_clean_stop_and_stays_after_a_death(ends, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    server = Sleeper(None, "127.0.0.1", 30.0, None)
    assert list(tmp_path.iterdir()) == []  # nothing made until it is used
    server.launch()
    log_dir = server.log_path.parent
    assert log_dir.parent == tmp_path and log_dir.name.startswith("tandem-sleeper-")
    if ends == "died by itself":
        server.proc.kill()
        server.proc.wait()
    server.stop()
    assert log_dir.exists() == (ends == "died by itself")


class Healthy(ChildServer):
    """A real child process that answers /health on its port."""

    name = "healthy"

    def command(self) -> list[str]:
        serve = (
            "import http.server, sys\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        self.send_response(200); self.end_headers(); self.wfile.write(b'{}')\n"
            "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
        )
        return [sys.executable, "-c", serve, str(self.port)]


def test_a_server_waited_for_after_its_deadline_is_still_found_healthy():
    """The driver waits for its servers one after another: the retrieval server's wait came after a
    247 s vLLM start, past its own 180 s, and it was declared dead while it answered (H100, 2026-12-06)."""
    server = Healthy(None, "127.0.0.1", 0.5, None)
    server.launch()
    try:
        while server.health() is None:  # up, whatever the time it took
            assert server.is_alive(), server.log_tail()
            time.sleep(0.05)
        while time.monotonic() < server._launched_s + server.startup_timeout_s:
            time.sleep(0.05)
        assert server.wait_healthy() is server
    finally:
        server.stop()


def test_a_server_that_never_answers_times_out_naming_itself():
    server = Sleeper(None, "127.0.0.1", 0.3, None)
    server.launch()
    with pytest.raises(TimeoutError, match=r"sleeper at http://127\.0\.0\.1:\d+ not healthy after 0 s"):
        server.wait_healthy()
    assert not server.is_alive()
