"""The start-up timeline's marks (host/startup.py): appended by any process that has the run's file,
read back in time order relative to the run's origin, harmless without a file or with a broken one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tandemrl.host import startup


@pytest.fixture
def marks_file(tmp_path, monkeypatch):
    path = tmp_path / "marks.jsonl"
    monkeypatch.setenv(startup.STARTUP_LOG_ENV, str(path))
    monkeypatch.setenv(startup.STARTUP_NAME_ENV, "tester")
    return path


def test_marks_are_read_back_in_time_order_relative_to_the_origin(marks_file):
    origin = time.time()
    startup.mark("second", at=origin + 2.0)
    startup.mark("first", at=origin + 1.0)
    startup.mark("other process", process="engine", at=origin + 1.5)
    rows = startup.timeline(startup.read_marks(marks_file), origin)
    assert [(r["process"], r["phase"], r["s"]) for r in rows] == [
        ("tester", "first", 1.0),
        ("engine", "other process", 1.5),
        ("tester", "second", 2.0),
    ]
    lines = startup.format_timeline(rows)
    assert len(lines) == 3 and lines[0].split() == ["1.00", "s", "tester", "first"]


def test_once_marks_only_the_first_call_of_each_run(marks_file):
    for _ in range(3):
        startup.mark("first request sent", once=True)
    assert [m["phase"] for m in startup.read_marks(marks_file)] == ["first request sent"]
    startup.begin(marks_file, "tester")  # a second run in this process: its file starts empty
    startup.mark("first request sent", once=True)
    assert [m["phase"] for m in startup.read_marks(marks_file)] == ["first request sent"]


def test_a_child_process_marks_into_the_same_file_under_its_name(marks_file):
    """The variables reach a child (as they reach the servers a run launches), which marks its own start."""
    code = (
        "from tandemrl.host.startup import mark, mark_process_started; mark_process_started(); mark('ready')"
    )
    before = time.time()
    env = {**os.environ, startup.STARTUP_NAME_ENV: "child"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    marks = {m["phase"]: m for m in startup.read_marks(marks_file)}
    assert marks["ready"]["process"] == "child"
    # the process start is known to a clock tick, and precedes its own later mark
    assert before - 0.05 <= marks["process started"]["t"] <= marks["ready"]["t"] <= time.time()


def test_without_a_file_or_with_an_unwritable_one_marking_is_a_no_op(tmp_path, monkeypatch):
    monkeypatch.delenv(startup.STARTUP_LOG_ENV, raising=False)
    startup.mark("nowhere")  # no variable: nothing happens
    monkeypatch.setenv(startup.STARTUP_LOG_ENV, str(tmp_path / "missing-dir" / "marks.jsonl"))
    startup.mark("unwritable")  # no such directory: no error either
    assert not (tmp_path / "missing-dir").exists()


def test_unparseable_lines_are_skipped_and_the_report_is_written(marks_file, tmp_path):
    origin = time.time()
    startup.mark("good", at=origin + 0.5)
    with marks_file.open("a") as f:
        f.write(
            "not json\n" + json.dumps({"t": "soon", "process": "x", "phase": "bad time"}) + '\n{"t": 1}\n'
        )
    startup.mark("also good", at=origin + 0.25)
    startup.report(marks_file, tmp_path, origin, "process start", {"time_to_first_step_s": 3.0})
    report = json.loads((tmp_path / startup.STARTUP_FILE).read_text())
    assert report["origin"] == "process start" and report["time_to_first_step_s"] == 3.0
    assert [row["phase"] for row in report["phases"]] == ["also good", "good"]


def test_process_start_epoch_is_this_process_start(marks_file):
    started = startup.process_start_epoch()
    # pytest has run for a while, but this process cannot be older than the machine's uptime
    assert started is not None and started < time.time()
    uptime_s = float(open("/proc/uptime").read().split()[0])
    assert started > time.time() - uptime_s - 1.0
