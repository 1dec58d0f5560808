"""Hostile-input probe of the user's paths of issue 42, items 6-8: every case runs in a real `tandem`
process (or a process whose `main()` is tandem's), so it measures whatever `tandemrl` is on PYTHONPATH,
an older tree included:

    python -m benchmarks.robustness.user_paths [--out benchmarks/results/robustness/hostile_user_paths.json]

- files the user names (item 7), by class: a run's `metrics.jsonl` (truncated, not JSON, not an object,
  fields missing or of the wrong type, not UTF-8, deeply nested, huge numbers, a line of 2 MiB, empty),
  what stands where a file should be (a directory, a FIFO, `/dev/zero`, a link loop, a missing path), a
  run's `config.yaml` (not YAML, wrong types), and question files through `tandem eval` and `tandem config
  show --check` (what `train` reads: the same classes plus Search-R1's layout of the wrong shape, a JSON
  array of non-objects, a parquet file that is not one, an unsupported suffix);
- keys that mean nothing or run away (items 6 and 8): `runner.weights_check_tokens` beyond its bound,
  `cluster.colocated_policy=time_share` and `rollout_buffer.max_head_offpolicyness` with the sync runner,
  `runner.profile_steps` past `runner.max_steps`, `cluster.mps=true` on a machine without MPS;
- Ctrl-C (item 6): a `tandem train` stuck after its last step on a thread that never ends (a fake run,
  inside a real process) gets SIGINT twice.

Classification (as in pickles_indexes_and_limits.py): exit 2 with one line naming the expected file / key (and
the line where there is one) is clear; a traceback, a signal death or another exit code is a crash; no
answer in time is a hang; exit 0 on bad input is a silent accept; a file of the run changed by the
command is a loss. The incomplete last line of a run still writing must be skipped and said (exit 0).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import write_json

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples/searchr1/config"
ASYNC, SYNC = CONFIGS / "embedded_cpu_async.yaml", CONFIGS / "embedded_cpu_sync.yaml"
OUTCOMES = ("clear", "unclear", "accepted", "loss", "hang", "crash")  # worst last
cases: dict[str, tuple[str, str]] = {}


def record(name: str, outcome: str, detail: str = "") -> None:
    previous = cases.get(name)
    if previous is None or OUTCOMES.index(outcome) > OUTCOMES.index(previous[0]):
        cases[name] = (outcome, " ".join(detail.split())[:200])


def run(argv: list[str], timeout: float = 60, mem_gb: float = 3.0, script: str | None = None):
    """(exit code or None on timeout, stderr + stdout) of `tandem ARGV` in a process of its own."""

    def cap():
        limit = int(mem_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))}
    command = (
        [sys.executable, "-c", script, *argv] if script else [sys.executable, "-m", "tandemrl.cli", *argv]
    )
    try:
        done = subprocess.run(
            command, capture_output=True, timeout=timeout, env=env, preexec_fn=cap, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        return None, ""
    return done.returncode, (done.stderr + done.stdout).decode(errors="replace")


def classify(name: str, code: int | None, text: str, needles: list[str]) -> None:
    if code is None:
        record(name, "hang")
    elif "Traceback" in text or code < 0 or code not in (0, 2):
        record(name, "crash", text.strip().splitlines()[-1] if text.strip() else f"exit {code}")
    elif code == 0:
        record(name, "accepted")
    elif all(n.lower() in text.lower() for n in needles) and len(text.strip().splitlines()) == 1:
        record(name, "clear")
    else:
        record(name, "unclear", text)


def digest(folder: Path) -> dict[str, str]:
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink():
            out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


# ---- item 7: metrics.jsonl and the run directory ------------------------------------------------------

GOOD_ROW = b'{"step": 1, "time/step": 1.0, "train/actor/num_updates": 4.0}\n'
METRICS = {  # name -> (bytes, needles besides the file name)
    "truncated middle line": (GOOD_ROW + b'{"step": 2, "time\n' + GOOD_ROW, ["line 2"]),
    "not JSON": (b"step,time\n1,2\n", ["line 1"]),
    "CSV after good rows": (GOOD_ROW * 3 + b"4,5\n", ["line 4"]),
    "JSON array line": (b"[1, 2]\n", ["line 1"]),
    "JSON string line": (b'"step"\n', ["line 1"]),
    "JSON null line": (b"null\n", ["line 1"]),
    "no step": (b'{"time/step": 1.0}\n', ["line 1", "step"]),
    "step string": (b'{"step": "1"}\n', ["line 1", "step"]),
    "step float": (b'{"step": 1.5}\n', ["line 1", "step"]),
    "step negative": (b'{"step": -3}\n', ["line 1", "step"]),
    "step bool": (b'{"step": false}\n', ["line 1", "step"]),
    "step object": (b'{"step": {"n": 1}}\n', ["line 1", "step"]),
    "value string": (b'{"step": 1, "time/step": "x"}\n', ["line 1", "time/step"]),
    "value object": (b'{"step": 1, "time/step": {"a": 1}}\n', ["line 1", "time/step"]),
    "value null": (b'{"step": 1, "rollout/reward/mean": null}\n', ["line 1"]),
    "not UTF-8": (GOOD_ROW + b"\xff\xfe\xfa\n", ["line 2"]),
    "UTF-16 file": ('{"step": 1}\n'.encode("utf-16"), ["line 1"]),
    "100000 brackets": (b"[" * 100_000 + b"\n", ["line 1"]),
    "100000 nested objects": (b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"\n", ["line 1"]),
    "integer of 5000 digits": (b'{"step": ' + b"7" * 5000 + b"}\n", ["line 1"]),
    "2 MiB line": (b'{"step": 1, "x": "' + b"a" * (2 << 20) + b'"}\n', ["line 1"]),
    "NUL bytes": (b"\x00" * 4096 + b"\n", ["line 1"]),
    "binary garbage": (bytes(range(256)) * 64, ["line"]),
}


def plot_case(tmp: Path, name: str, prepare, needles: list[str]) -> None:
    run_dir = tmp / "plot" / name.replace(" ", "_")
    run_dir.mkdir(parents=True)
    prepare(run_dir)
    before = digest(run_dir)
    code, text = run(["plot", str(run_dir), "--out", str(tmp / "plots" / run_dir.name)])
    if digest(run_dir) != before:
        record(f"plot: {name}", "loss", "the run directory changed")
    classify(f"plot: {name}", code, text, needles)


def plot_probe(tmp: Path) -> None:
    for name, (data, needles) in METRICS.items():
        plot_case(
            tmp,
            name,
            lambda d, data=data: (d / "metrics.jsonl").write_bytes(data),
            ["metrics.jsonl", *needles],
        )

    def kind(make):
        return lambda d: make(d / "metrics.jsonl")

    layouts = {
        "empty metrics.jsonl": (kind(lambda p: p.write_bytes(b"")), ["metrics.jsonl"]),
        "blank lines only": (kind(lambda p: p.write_bytes(b"\n\n  \n")), ["metrics.jsonl"]),
        "metrics.jsonl a directory": (kind(lambda p: p.mkdir()), ["metrics.jsonl", "directory"]),
        "metrics.jsonl a FIFO": (kind(lambda p: os.mkfifo(p)), ["metrics.jsonl", "regular file"]),
        "metrics.jsonl -> /dev/zero": (kind(lambda p: p.symlink_to("/dev/zero")), ["metrics.jsonl"]),
        "metrics.jsonl -> /dev/urandom": (kind(lambda p: p.symlink_to("/dev/urandom")), ["metrics.jsonl"]),
        "metrics.jsonl a link loop": (kind(lambda p: p.symlink_to(p)), ["metrics.jsonl", "loop"]),
        "config.yaml not YAML": (
            lambda d: (
                (d / "metrics.jsonl").write_bytes(b'{"step": 1, "time/step": 1.0}\n'),
                (d / "config.yaml").write_text("algorithm: [\n"),
            ),
            ["config.yaml"],
        ),
        "config.yaml a FIFO": (
            lambda d: (
                (d / "metrics.jsonl").write_bytes(b'{"step": 1, "time/step": 1.0}\n'),
                os.mkfifo(d / "config.yaml"),
            ),
            ["config.yaml"],
        ),
        "config.yaml n_minibatches a list": (
            lambda d: (
                (d / "metrics.jsonl").write_bytes(b'{"step": 1, "time/step": 1.0}\n'),
                (d / "config.yaml").write_text("algorithm:\n  n_minibatches: [1, 2]\n"),
            ),
            ["config.yaml", "n_minibatches"],
        ),
        "config.yaml an alias bomb": (
            lambda d: (
                (d / "metrics.jsonl").write_bytes(b'{"step": 1, "time/step": 1.0}\n'),
                (d / "config.yaml").write_text(_alias_bomb()),
            ),
            ["config.yaml"],
        ),
        "TensorBoard events a FIFO": (lambda d: os.mkfifo(d / "events.out.tfevents.1.x"), ["run directory"]),
        "TensorBoard events garbage": (
            lambda d: (d / "events.out.tfevents.1.x").write_bytes(bytes(range(256)) * 16),
            ["run directory"],
        ),
    }
    for name, (prepare, needles) in layouts.items():
        plot_case(tmp, name, prepare, needles)
    code, text = run(["plot", str(tmp / ("r" * 300)), "--out", str(tmp / "plots" / "z")])
    classify("plot: a run name too long", code, text, ["run directory", "too long"])
    code, text = run(["plot", str(tmp / "no-such-run"), "--out", str(tmp / "plots" / "x")])
    classify("plot: missing run directory", code, text, ["no-such-run", "does not exist"])
    (tmp / "a-file").write_text("x")
    code, text = run(["plot", str(tmp / "a-file"), "--out", str(tmp / "plots" / "y")])
    classify("plot: the run is a file", code, text, ["a-file", "not a directory"])
    # --out where plots cannot go: a file must not be replaced
    good = tmp / "plot" / "good"
    good.mkdir(parents=True)
    (good / "metrics.jsonl").write_bytes(GOOD_ROW)
    blocker = tmp / "out-is-a-file"
    blocker.write_text("keep me")
    code, text = run(["plot", str(good), "--out", str(blocker)])
    if blocker.read_text() != "keep me":
        record("plot: --out an existing file", "loss", "the file was replaced")
    classify("plot: --out an existing file", code, text, ["out-is-a-file"])
    # a run still writing: its incomplete last line is skipped, and said
    live = tmp / "plot" / "live"
    live.mkdir()
    (live / "metrics.jsonl").write_bytes(GOOD_ROW + b'{"step": 2, "time/st')
    code, text = run(["plot", str(live), "--out", str(tmp / "plots" / "live")])
    if code == 0 and "incomplete last line skipped" in text and "Traceback" not in text:
        record("plot: incomplete last line of a run still writing", "clear")
    elif code is None:
        record("plot: incomplete last line of a run still writing", "hang")
    elif code == 0:
        record("plot: incomplete last line of a run still writing", "accepted", "skipped without saying so")
    else:
        record(
            "plot: incomplete last line of a run still writing",
            "crash" if "Traceback" in text else "unclear",
            text,
        )


def _alias_bomb() -> str:
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    return "\n".join(lines) + "\nalgorithm: *a8\n"


# ---- item 7: question files (eval, and what train checks) ---------------------------------------------

Q = b'{"question": "who?", "golden_answers": ["x"]}\n'
QUESTIONS = {  # name -> (file name, bytes, needles besides the file name)
    "truncated line": ("q.jsonl", Q + b'{"question": "wh\n', ["line 2"]),
    "truncated last line": ("q.jsonl", Q + b'{"question": "wh', ["line 2"]),
    "not JSON": ("q.jsonl", b"question\twho\n", ["line 1"]),
    "array line": ("q.jsonl", b'["who?", ["x"]]\n', ["line 1"]),
    "no question": ("q.jsonl", b'{"golden_answers": ["x"]}\n', ["line 1", "question"]),
    "blank question": ("q.jsonl", b'{"question": "  ", "golden_answers": ["x"]}\n', ["line 1", "question"]),
    "question a number": ("q.jsonl", b'{"question": 3, "golden_answers": ["x"]}\n', ["line 1", "question"]),
    "question a list": ("q.jsonl", b'{"question": ["a"], "golden_answers": ["x"]}\n', ["line 1", "question"]),
    "no answers": ("q.jsonl", b'{"question": "who?"}\n', ["line 1", "golden_answers"]),
    "answers empty": (
        "q.jsonl",
        b'{"question": "who?", "golden_answers": []}\n',
        ["line 1", "golden_answers"],
    ),
    "answers a dict": ("q.jsonl", b'{"question": "who?", "golden_answers": {"x": 1}}\n', ["line 1"]),
    "answers nested lists": ("q.jsonl", b'{"question": "who?", "golden_answers": [["x"]]}\n', ["line 1"]),
    "answers null items": ("q.jsonl", b'{"question": "who?", "golden_answers": [null]}\n', ["line 1"]),
    "id an object": (
        "q.jsonl",
        b'{"id": {}, "question": "who?", "golden_answers": ["x"]}\n',
        ["line 1", "id"],
    ),
    "data_source a list": (
        "q.jsonl",
        b'{"question": "who?", "golden_answers": ["x"], "data_source": [1]}\n',
        ["line 1", "data_source"],
    ),
    "Search-R1 prompt a number": ("q.jsonl", b'{"prompt": 5, "golden_answers": ["x"]}\n', ["line 1"]),
    "Search-R1 ground_truth a list": (
        "q.jsonl",
        b'{"prompt": "Question: who?", "reward_model": {"ground_truth": ["x"]}}\n',
        ["line 1"],
    ),
    "duplicate ids": (
        "q.jsonl",
        b'{"id": 1, "question": "a?", "golden_answers": ["x"]}\n' * 2,
        ["duplicate"],
    ),
    "empty file": ("q.jsonl", b"", ["no records"]),
    "not UTF-8": ("q.jsonl", b"\xff\xfe\n", ["line 1"]),
    "100000 brackets": ("q.jsonl", b"[" * 100_000 + b"\n", ["line 1"]),
    "2 MiB line": ("q.jsonl", b'{"question": "' + b"a" * (2 << 20) + b'"}\n', ["line 1"]),
    "JSON array of numbers": ("q.json", b"[1, 2, 3]", ["row 1"]),
    "JSON array truncated": ("q.json", b'[{"question": "a?", ', ["line 1"]),
    "parquet that is not": ("q.parquet", b"PAR1garbagePAR1", ["parquet"]),
    "unsupported suffix": ("q.tsv", b"who\tx\n", ["suffix"]),
}


def question_probe(tmp: Path) -> None:
    (tmp / "model").mkdir()
    (tmp / "index").mkdir()
    base = [f"rollout.model.model_path={tmp / 'model'}", f"retrieval.index_dir={tmp / 'index'}"]

    def both(name: str, path: Path, needles: list[str]) -> None:
        code, text = run(["eval", str(ASYNC), f"data.val_data_paths=[{path}]", "--split", "val"])
        classify(f"eval: {name}", code, text, [str(path), *needles])
        code, text = run(["config", "show", "--check", str(ASYNC), *base, f"data.train_data_paths=[{path}]"])
        classify(f"train checks: {name}", code, text, ["data.train_data_paths", str(path), *needles])

    for name, (filename, data, needles) in QUESTIONS.items():
        path = tmp / "q" / name.replace(" ", "_") / filename
        path.parent.mkdir(parents=True)
        path.write_bytes(data)
        both(name, path, needles)
    special = tmp / "q" / "special"
    special.mkdir()
    os.mkfifo(special / "fifo.jsonl")
    (special / "zero.jsonl").symlink_to("/dev/zero")
    (special / "loop.jsonl").symlink_to(special / "loop.jsonl")
    (special / "dir.jsonl").mkdir()
    for name, path, needles in (
        ("a FIFO", special / "fifo.jsonl", ["regular file"]),
        ("/dev/zero", special / "zero.jsonl", ["regular file"]),
        ("a link loop", special / "loop.jsonl", ["loop"]),
        ("a directory", special / "dir.jsonl", ["directory"]),
        ("missing", special / "missing.jsonl", ["does not exist"]),
        ("a name too long", special / ("q" * 300 + ".jsonl"), ["too long"]),
    ):
        both(name, path, needles)


# ---- items 6 and 8: keys ------------------------------------------------------------------------------

KEYS = [  # (config, overrides, needles)
    (ASYNC, ["runner.weights_check_tokens=5000"], ["runner.weights_check_tokens"]),
    (ASYNC, ["runner.weights_check_tokens=1000000000"], ["runner.weights_check_tokens"]),
    (ASYNC, ["runner.weights_check_tokens=257"], ["runner.weights_check_tokens"]),
    (ASYNC, ["runner.weights_check_tokens=-1"], ["runner.weights_check_tokens"]),
    (
        ASYNC,
        [
            "runner.weights_check_tokens=200",
            "rollout.max_context_len=240",
            "agentloop.max_response_tokens=200",
            "agentloop.max_new_tokens_per_turn=100",
        ],
        ["runner.weights_check_tokens", "max_context_len"],
    ),
    (SYNC, ["cluster.colocated_policy=time_share"], ["cluster.colocated_policy"]),
    (SYNC, ["rollout_buffer.max_head_offpolicyness=0"], ["rollout_buffer.max_head_offpolicyness"]),
    (SYNC, ["rollout_buffer.max_head_offpolicyness=3"], ["rollout_buffer.max_head_offpolicyness"]),
    (ASYNC, ["runner.max_steps=4", "runner.profile_steps=[5]"], ["runner.profile_steps"]),
    (ASYNC, ["runner.max_steps=4", "runner.profile_steps=[1,2,1000000]"], ["runner.profile_steps"]),
    (ASYNC, ["cluster.mps=true"], ["cluster.mps"]),
    (ASYNC, ["cluster.mps=true", "actor.device=cuda", "rollout.device=cuda"], ["cluster.mps"]),
    (SYNC, ["cluster.mps=true", "cluster.use_ray=false"], ["cluster.mps"]),
]


def key_probe() -> None:
    for config, overrides, needles in KEYS:
        code, text = run(["config", "show", str(config), *overrides])
        classify(f"config show: {' '.join(overrides)} ({config.stem})", code, text, needles)


# ---- item 6: Ctrl-C twice on a run stuck on a thread ---------------------------------------------------

STUCK = """
import sys, threading
from tandemrl.commands import train as launch

def fake_train(config, started_s=None):
    '''Fake of a run stuck after its last step: a thread that never ends, a teardown that waits for it.'''
    never = threading.Event()
    stuck = threading.Thread(target=never.wait)
    stuck.start()
    try:
        print("blocked", flush=True)
        never.wait()  # as the run waits for the decode
    finally:
        print("tearing down", flush=True)
        never.wait()

launch.train = fake_train
import tandemrl.cluster.reaper
tandemrl.cluster.reaper.start_reaper = lambda: None
from tandemrl.cli import main
sys.argv = ["tandem", "train", sys.argv[1], "runner.output_dir=" + sys.argv[2]]
sys.exit(main())
"""


def ctrl_c_probe(tmp: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))}
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK, str(ASYNC), str(tmp / "stuck")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    name = "train: SIGINT twice while stuck on a thread"
    try:
        assert proc.stdout.readline().strip() == "blocked"
        proc.send_signal(signal.SIGINT)
        proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        record(name, "hang", "still running 60 s after the second SIGINT")
        return
    finally:
        proc.kill()
        proc.wait()
    if proc.returncode == 130 and "stopped by SIGINT" in err and "Traceback" not in err:
        record(name, "clear")
    else:
        record(name, "crash", f"exit {proc.returncode}: {err[-200:]}")


def summary() -> dict:
    report = {"inputs_tried": len(cases), "clear": sum(o == "clear" for o, _ in cases.values())}
    names = {
        "accepted": "silent_accepts",
        "loss": "losses",
        "hang": "hangs",
        "crash": "crashes",
        "unclear": "unclear",
    }
    for outcome, key in names.items():
        found = [f"{n}: {d}" if d else n for n, (o, d) in cases.items() if o == outcome]
        report[key] = len(found)
        report[f"{key}_cases"] = found
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/robustness/hostile_user_paths.json")
    parser.add_argument("--label", default=None, help="what tree was measured (default: its PYTHONPATH)")
    args = parser.parse_args()
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        ctrl_c_probe(tmp)
        key_probe()
        plot_probe(tmp)
        question_probe(tmp)
    report = summary()
    report["seconds"] = round(time.monotonic() - start, 1)
    report["tandemrl"] = args.label or os.environ.get("PYTHONPATH", str(ROOT))
    print(json.dumps(report, indent=1))
    write_json(args.out, report, indent=1)


if __name__ == "__main__":
    main()
