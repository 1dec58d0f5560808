"""Runs that cannot collide (issue 42, items 2 and 3): a run holds its output directory, and a local
index is opened by one retrieval server at a time. The holder is a real second process each time (a
run's lock and Qdrant's own lock); `tandem train` is the real CLI, in this process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tandemrl.cli import main
from tandemrl.config.loader import load_config
from tandemrl.runner.output_lock import hold_output_dir
from tandemrl.runner.services import check_index_free
from tests.integration.runner_helpers import small_kb_once, tiny_overrides

CONFIG = Path(__file__).resolve().parents[2] / "examples/searchr1/config/embedded_cpu_async.yaml"


@pytest.fixture(scope="module")
def small_kb(tmp_path_factory, minilm_dir):
    return small_kb_once(tmp_path_factory, minilm_dir)


class Holder:
    """A separate Python process that runs `setup`, prints `held`, then sleeps until killed."""

    def __init__(self, setup: str):
        code = f"import sys, time\n{setup}\nprint('held', flush=True)\ntime.sleep(600)\n"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        line = self.proc.stdout.readline()
        assert line.strip() == "held", self.proc.stderr.read()

    def kill_9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()


def _train_argv(model_dir: Path, small_kb, output_dir: Path) -> list[str]:
    kb_dir, index_dir = small_kb
    return ["train", str(CONFIG), *tiny_overrides(model_dir, kb_dir, index_dir, output_dir)]


def _nothing_started(output_dir: Path) -> None:
    started = {"startup_marks.jsonl", "config.yaml", "metrics.jsonl", "checkpoints"}
    assert not started & {p.name for p in output_dir.iterdir()}, list(output_dir.iterdir())


def test_a_second_run_on_a_held_output_dir_is_refused_and_a_killed_holder_blocks_nothing(
    tmp_path, tiny_llama_dir, small_kb, capsys
):
    output_dir = tmp_path / "run"
    holder = Holder(
        "from tandemrl.runner.output_lock import hold_output_dir\n"
        f"held = hold_output_dir({str(output_dir)!r})\n"
        "held.__enter__()"
    )
    try:
        code = main(_train_argv(tiny_llama_dir, small_kb, output_dir))
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"runner.output_dir='{output_dir}' is in use by another run (pid {holder.proc.pid}" in err, err
        _nothing_started(output_dir)
    finally:
        holder.kill_9()
    with hold_output_dir(output_dir):  # the kernel dropped the dead holder's lock; its file stays
        assert (output_dir / ".tandem.lock").is_file()


def test_one_process_holds_a_dir_once_and_gives_it_back(tmp_path):
    with hold_output_dir(tmp_path / "run"):
        with hold_output_dir(tmp_path / "run"):  # re-entrant: train() inside run_train
            pass
        holder = subprocess.run(
            [
                sys.executable,
                "-c",
                f"from tandemrl.runner.output_lock import hold_output_dir; hold_output_dir({str(tmp_path / 'run')!r}).__enter__()",
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        assert holder.returncode != 0 and "is in use by another run" in holder.stderr, holder.stderr
    with hold_output_dir(tmp_path / "run"):
        pass


def test_a_second_run_on_an_index_another_process_serves_is_refused_at_start_up(
    tmp_path, tiny_llama_dir, small_kb, capsys
):
    _, index_dir = small_kb
    holder = Holder(  # what a retrieval server does with the index: Qdrant local mode, which locks it
        f"from tandemrl.retrieval.store import QdrantStore\nstore = QdrantStore({str(index_dir)!r})"
    )
    output_dir = tmp_path / "run"
    try:
        code = main(_train_argv(tiny_llama_dir, small_kb, output_dir))
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"retrieval.index_dir='{index_dir}' is already open in another process" in err, err
        assert "retrieval.launch=false tools.search.server_addr=" in err, err
        _nothing_started(output_dir)
    finally:
        holder.kill_9()
    kb_dir, _ = small_kb
    config = load_config(CONFIG, tiny_overrides(tiny_llama_dir, kb_dir, index_dir, output_dir))
    check_index_free(config)  # free again once its holder is gone


@pytest.mark.parametrize("where", ["a file", "under a file", "a link loop"])
def test_an_output_dir_that_cannot_hold_a_run_is_refused_in_one_line(where, tmp_path):
    import tandemrl.runner.output_lock as output_lock
    from tandemrl.config.schema import ConfigError

    (tmp_path / "file").write_text("x")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    path = {
        "a file": tmp_path / "file",
        "under a file": tmp_path / "file" / "run",
        "a link loop": tmp_path / "loop",
    }
    with pytest.raises(ConfigError, match="runner.output_dir=.* cannot hold the run") as error:
        with output_lock.hold_output_dir(path[where]):
            pass
    assert "\n" not in str(error.value)
