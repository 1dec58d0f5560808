"""Bad files on the user's paths (host/files.py): `tandem plot` on a run's `metrics.jsonl` and
`config.yaml`, `tandem eval` and `tandem config show --check` (what `train` checks before it starts a
service) on question files. Every case is one line on stderr naming the file, the line where there is
one, and what is wrong, exit 2; never a traceback, a hang or memory run out. The pipe and `/dev/zero`
cases run in a real process, with a memory limit, so that a regression fails instead of hanging."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tandemrl.cli import main

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples/searchr1/config/embedded_cpu_async.yaml"
ROW = {"step": 1, "time/step": 2.0, "rollout/reward/mean": 0.5, "train/actor/num_updates": 4.0}

# name -> (metrics.jsonl bytes, the line the message must name, a word of what is wrong)
BAD_METRICS = {
    "a truncated middle line": (b'{"step": 1}\n{"step": 2, "a\n{"step": 3}\n', 2, "not valid JSON"),
    "a line that is not JSON": (b'{"step": 1}\nhello\n', 2, "not valid JSON"),
    "an array line": (b"[1, 2]\n", 1, "not an object"),
    "a row without step": (b'{"time/step": 1.0}\n', 1, "no `step`"),
    "step a string": (b'{"step": "3"}\n', 1, "`step`"),
    "step negative": (b'{"step": -1}\n', 1, "`step`"),
    "step a float": (b'{"step": 1.5}\n', 1, "`step`"),
    "step a boolean": (b'{"step": true}\n', 1, "`step`"),
    "a value that is a string": (b'{"step": 1, "time/step": "fast"}\n', 1, "not a number"),
    "a value that is a list": (b'{"step": 1, "time/step": [1]}\n', 1, "not a number"),
    "a value that is null": (b'{"step": 1, "time/step": null}\n', 1, "not a number"),
    "bytes that are not UTF-8": (b'{"step": 1}\n\xff\xfe\n', 2, "not UTF-8"),
    "100000 brackets": (b"[" * 100_000 + b"\n", 1, "nests too deeply"),
    "an integer of 5000 digits": (b'{"step": ' + b"9" * 5000 + b"}\n", 1, "cannot be read as JSON"),
    "a 2 MiB line": (b'{"step": 1, "x": "' + b"a" * (2 << 20) + b'"}\n', 1, "longer than"),
}


def _tandem(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, err


def _assert_one_line(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("name", list(BAD_METRICS))
def test_plot_refuses_a_bad_metrics_line_naming_file_and_line(tmp_path, capsys, name):
    data, line, what = BAD_METRICS[name]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(data)
    code, err = _tandem(capsys, "plot", str(run), "--out", str(tmp_path / "plots"))
    _assert_one_line(code, err, str(run / "metrics.jsonl"), f"line {line}", what)


def test_plot_skips_the_incomplete_last_line_of_a_run_still_writing(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    rows = [dict(ROW, step=step) for step in (1, 2)]
    text = "".join(json.dumps(row) + "\n" for row in rows) + '{"step": 3, "time/st'
    (run / "metrics.jsonl").write_text(text)
    code = main(["plot", str(run), "--out", str(tmp_path / "plots")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "line 3: incomplete last line skipped" in captured.err and "Traceback" not in captured.err
    assert (tmp_path / "plots" / "step_time.png").is_file()


def _bad_run_layouts(tmp_path: Path) -> dict[str, tuple[Path, list[str]]]:
    """Run directories whose files are wrong in kind, not in content: name -> (run dir, needles)."""
    layouts = {}
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    layouts["an empty metrics.jsonl"] = (empty, ["metrics.jsonl' holds no rows"])
    as_dir = tmp_path / "as_dir"
    (as_dir / "metrics.jsonl").mkdir(parents=True)
    layouts["metrics.jsonl a directory"] = (as_dir, ["metrics.jsonl", "is a directory"])
    loop = tmp_path / "loop"
    loop.mkdir()
    (loop / "metrics.jsonl").symlink_to(loop / "metrics.jsonl")
    layouts["metrics.jsonl a link loop"] = (loop, ["metrics.jsonl", "link loop"])
    not_dir = tmp_path / "not_a_dir"
    not_dir.write_text("x")
    layouts["the run a file"] = (not_dir, ["not_a_dir", "is not a directory"])
    layouts["the run missing"] = (tmp_path / "missing", ["missing", "does not exist"])
    for name, content in (
        ("config.yaml not YAML", "algorithm: [unclosed\n"),
        ("n_minibatches a string", "algorithm:\n  n_minibatches: many\n"),
    ):
        run = tmp_path / name.replace(" ", "_")
        run.mkdir()
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "time/step": 1.0}) + "\n")
        (run / "config.yaml").write_text(content)
        layouts[name] = (run, ["config.yaml"])
    return layouts


def test_plot_refuses_runs_whose_files_are_wrong_in_kind(tmp_path, capsys):
    for name, (run, needles) in _bad_run_layouts(tmp_path).items():
        code, err = _tandem(capsys, "plot", str(run), "--out", str(tmp_path / "plots"))
        try:
            _assert_one_line(code, err, *needles)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None


# question files: name -> (file name, bytes, needles besides the path)
BAD_QUESTIONS = {
    "a truncated line": (
        "q.jsonl",
        b'{"question": "a?", "golden_answers": ["b"]}\n{"question": "c\n',
        ["line 2"],
    ),
    "a line that is not JSON": ("q.jsonl", b"question,answer\n", ["line 1", "not valid JSON"]),
    "a line that is a list": ("q.jsonl", b'["a?", ["b"]]\n', ["line 1", "not an object"]),
    "no question": ("q.jsonl", b'{"golden_answers": ["b"]}\n', ["line 1", "no `question`"]),
    "a question that is a number": ("q.jsonl", b'{"question": 7, "golden_answers": ["b"]}\n', ["line 1"]),
    "answers that are a dict": ("q.jsonl", b'{"question": "a?", "golden_answers": {"b": 1}}\n', ["line 1"]),
    "answers that are empty": ("q.jsonl", b'{"question": "a?", "golden_answers": []}\n', ["line 1"]),
    "answers that are lists": ("q.jsonl", b'{"question": "a?", "golden_answers": [["b"]]}\n', ["line 1"]),
    "an answer that is NaN": ("q.jsonl", b'{"question": "a?", "golden_answers": [NaN]}\n', ["line 1", "nan"]),
    "an id that is a list": (
        "q.jsonl",
        b'{"id": [1], "question": "a?", "golden_answers": ["b"]}\n',
        ["`id`"],
    ),
    "a Search-R1 target of the wrong shape": (
        "q.jsonl",
        b'{"prompt": [{"role": "user", "content": "Question: a?"}], "reward_model": {"ground_truth": [1]}}\n',
        ["line 1"],
    ),
    "an empty file": ("q.jsonl", b"", ["holds no records"]),
    "bytes that are not UTF-8": ("q.jsonl", b"\xff\xfe\x00\n", ["line 1", "not UTF-8"]),
    "a JSON array of non-objects": ("q.json", b"[1, 2]", ["row 1"]),
    "a parquet file that is not parquet": ("q.parquet", b"PAR1 not really", ["parquet"]),
    "an unsupported suffix": ("q.csv", b"a,b\n", ["unsupported suffix"]),
}


def _question_path(tmp_path: Path, name: str) -> Path:
    filename, data, _ = BAD_QUESTIONS[name]
    path = tmp_path / name.replace(" ", "_") / filename
    path.parent.mkdir()
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("name", list(BAD_QUESTIONS))
def test_eval_refuses_a_bad_question_file_naming_file_and_line(tmp_path, capsys, name):
    path = _question_path(tmp_path, name)
    code, err = _tandem(capsys, "eval", str(CONFIG), f"data.val_data_paths=[{path}]", "--split", "val")
    _assert_one_line(code, err, str(path), *BAD_QUESTIONS[name][2])


def test_train_checks_refuse_bad_question_files_and_directories(tmp_path, capsys):
    """`tandem config show --check` runs what `train` checks before it starts a service (the driver reads
    the question files only after the services are up)."""
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "index.json").write_text("{}")  # what makes a directory an index
    model = tmp_path / "model"
    model.mkdir()
    base = [str(CONFIG), f"retrieval.index_dir={tmp_path / 'index'}", f"rollout.model.model_path={model}"]
    for name in ("a truncated line", "answers that are a dict", "an empty file"):
        path = _question_path(tmp_path, name)
        code, err = _tandem(capsys, "config", "show", "--check", *base, f"data.train_data_paths=[{path}]")
        _assert_one_line(code, err, "data.train_data_paths", str(path), *BAD_QUESTIONS[name][2])
    code, err = _tandem(capsys, "config", "show", "--check", *base, f"data.train_data_paths=[{tmp_path}]")
    _assert_one_line(code, err, "data.train_data_paths", "is a directory")


SPECIAL_FILES_SCRIPT = """
import os, sys
from tandemrl.cli import main
kind, tmp = sys.argv[1], sys.argv[2]
run = os.path.join(tmp, "run")
os.makedirs(run)
if kind == "fifo":
    os.mkfifo(os.path.join(run, "metrics.jsonl"))
    questions = os.path.join(tmp, "q.jsonl")
    os.mkfifo(questions)
else:
    os.symlink("/dev/zero", os.path.join(run, "metrics.jsonl"))
    questions = os.path.join(tmp, "q.jsonl")
    os.symlink("/dev/zero", questions)
codes = [main(["plot", run, "--out", os.path.join(tmp, "plots")])]
codes.append(main(["eval", sys.argv[3], "data.val_data_paths=[" + questions + "]", "--split", "val"]))
print(codes)
"""


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # /dev/zero read whole ends here, not the box


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_pipes_and_devices_are_refused_in_a_real_process(tmp_path, kind):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", SPECIAL_FILES_SCRIPT, kind, str(tmp_path), str(CONFIG)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,  # a hang detector: a FIFO blocked the open before
        preexec_fn=_limit_memory,
    )
    assert result.stdout.strip() == "[2, 2]", result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in result.stderr, result.stderr
    assert "metrics.jsonl" in lines[0] and "not a regular file" in lines[0]
    assert "q.jsonl" in lines[1] and "not a regular file" in lines[1]


def test_a_corpus_line_without_end_is_refused_before_it_is_held(tmp_path):
    """`tandem index build`'s corpus reader holds at most 16 MiB of one line (a file of one huge line, or
    one that never ends, would otherwise fill memory)."""
    from tandemrl.retrieval.corpus import read_corpus

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(
        b'{"id": "a", "contents": "ok"}\n{"id": "b", "contents": "' + b"w " * (9 << 20) + b'"}\n'
    )
    with pytest.raises(ValueError, match=r"corpus.jsonl:2: a line longer than 16 MiB"):
        list(read_corpus(corpus))


def test_sft_inputs_and_index_descriptions_are_read_bounded_and_line_numbered(tmp_path):
    """`tandem sft`'s demonstrations and `actor.sft.rendered_path`, and an index's `index.json`, get the
    same treatment as the other files the user names."""
    from tandemrl.data.demos import load_demos
    from tandemrl.host.files import InputFileError
    from tandemrl.retrieval.retriever import IndexMeta
    from tandemrl.trainer.sft import read_rendered

    demos = tmp_path / "demos.jsonl"
    demos.write_text('{"question": "a?"}\n{"question": \n')
    with pytest.raises(InputFileError, match=r"demonstrations file .*demos.jsonl' line 2 is not valid JSON"):
        load_demos(demos)
    rendered = tmp_path / "rendered.jsonl"
    rendered.write_text(
        '{"input_ids": [1, 2], "loss_mask": [0, 1]}\n{"input_ids": [1, 2], "loss_mask": [1]}\n'
    )
    with pytest.raises(InputFileError, match=r"rendered.jsonl' line 2: needs `input_ids` and `loss_mask`"):
        read_rendered(rendered)
    index = tmp_path / "index"
    index.mkdir()
    os.mkfifo(index / "index.json")  # is_file() is False for a FIFO: refused before any open
    with pytest.raises(FileNotFoundError, match="not a built index"):
        IndexMeta.load(index)
    (index / "index.json").unlink()
    (index / "index.json").write_bytes(b" " * (2 << 20))
    with pytest.raises(ValueError, match="more than the 1 MiB"):
        IndexMeta.load(index)


def test_names_the_system_refuses_are_one_line(tmp_path, capsys):
    """A component longer than the file system allows (ENAMETOOLONG) where a run, a metrics file or a
    question file should be."""
    long_name = tmp_path / ("a" * 300)
    code, err = _tandem(capsys, "plot", str(long_name), "--out", str(tmp_path / "plots"))
    _assert_one_line(code, err, "run directory", "File name too long")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(long_name)
    code, err = _tandem(capsys, "plot", str(run), "--out", str(tmp_path / "plots"))
    _assert_one_line(code, err, "metrics.jsonl", "File name too long")
    code, err = _tandem(
        capsys, "eval", str(CONFIG), f"data.val_data_paths=[{long_name}.jsonl]", "--split", "val"
    )
    _assert_one_line(code, err, "data file", "File name too long")


def test_eval_refuses_an_out_path_it_could_not_write_before_it_starts(tmp_path, capsys):
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question": "a?", "golden_answers": ["b"]}\n')
    base = ["eval", str(CONFIG), f"data.val_data_paths=[{questions}]", "--split", "val"]
    code, err = _tandem(capsys, *base, "--out", str(tmp_path))
    _assert_one_line(code, err, "--out", "is a directory")
    code, err = _tandem(capsys, *base, "--limit", "0")
    _assert_one_line(code, err, "--limit 0")
