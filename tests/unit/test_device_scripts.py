"""benchmarks/device/{job,start,poll}.sh, the way GPU jobs run on the lent machine (benchmarks/device/README.md),
here on CPU: staged parts of a tar of wheels are joined and installed once, the command runs with them on
its path, a background job is started once and polled to its end, and a poll packs what came back."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEVICE = ROOT / "benchmarks" / "device"


def wheel(name: str, body: str) -> tuple[str, bytes]:
    """A minimal pure-Python wheel holding module `name`, as pip installs it."""
    dist_info = f"{name}-1.0.dist-info"
    files = {
        f"{name}.py": body.encode(),
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    files[f"{dist_info}/RECORD"] = ("\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return f"{name}-1.0-py3-none-any.whl", buffer.getvalue()


def stage(stage_dir: Path, num_parts: int) -> None:
    """What ../shared/device/stage.sh makes and the copies put on the machine: a tar of wheels, in parts."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in [wheel("staged_mod", "VALUE = 42\n")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    data = buffer.getvalue()
    stage_dir.mkdir(parents=True)
    size = -(-len(data) // num_parts)
    for k in range(num_parts):
        (stage_dir / f"p{k:02d}").write_bytes(data[k * size : (k + 1) * size])


def env_for(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    bin_dir = tmp_path / "bin"  # the machine's python3 is the one that runs the job
    bin_dir.mkdir(exist_ok=True)
    link = bin_dir / "python3"
    if not link.exists():
        link.symlink_to(sys.executable)
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        STAGE_DIR=str(tmp_path / "stage"),
        SITE_DIR=str(tmp_path / "site"),
        JOB_DIR=str(tmp_path / "job"),
        TANDEM_HOME=str(tmp_path / "home"),
        **extra,
    )
    return env


def script(name: str, *args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(DEVICE / name), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_job_installs_the_staged_wheels_once_and_runs_the_command_with_them(tmp_path):
    stage(tmp_path / "stage", num_parts=3)
    out = tmp_path / "out"
    env = env_for(tmp_path, OUT=str(out), EXPECT_PARTS="3")
    probe = "import os, staged_mod; print('value', staged_mod.VALUE, os.environ['TANDEM_HOME'])"
    first = script("job.sh", "python3", "-c", probe, env=env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == ["value", "42", str(tmp_path / "home")]
    assert (tmp_path / "site" / "staged_mod.py").is_file() and (tmp_path / "site" / ".installed").is_file()
    recorded = (out / "gpu.txt").read_text()
    assert "command: python3 -c" in recorded and "commit: " in recorded
    (tmp_path / "site" / "staged_mod.py").write_text("VALUE = 7\n")  # installed once: a second job keeps it
    again = script("job.sh", "python3", "-c", probe, env=env)
    assert again.returncode == 0 and again.stdout.split()[:2] == ["value", "7"], again.stderr
    failed = script("job.sh", "python3", "-c", "raise SystemExit(5)", env=env)
    assert failed.returncode == 5


def test_job_refuses_a_missing_part_by_count(tmp_path):
    stage(tmp_path / "stage", num_parts=3)
    (tmp_path / "stage" / "p01").unlink()
    result = script("job.sh", "true", env=env_for(tmp_path, OUT=str(tmp_path / "out"), EXPECT_PARTS="3"))
    assert result.returncode == 2
    assert "2 parts in" in result.stderr and "expected 3" in result.stderr
    assert not (tmp_path / "site").exists()


def test_start_runs_the_job_once_in_the_background_and_poll_brings_back_its_output(tmp_path):
    stage(tmp_path / "stage", num_parts=2)
    go = tmp_path / "go"  # the job waits for it, so the first poll finds it running
    env = env_for(tmp_path, OUT=str(tmp_path / "call1"), GO=str(go))
    job = (
        'echo \'{"steps": 3}\' > "$OUT/result.json"; head -c 5000000 /dev/zero > "$OUT/big.bin"; '
        'until [ -e "$GO" ]; do sleep 0.1; done; echo done'
    )
    started = script("start.sh", "0", "bash", "-c", job, env=env)
    assert started.returncode == 0, started.stderr
    assert "still running" in started.stdout
    go.touch()
    # a second start on the same machine only waits for the first job
    second = "echo second > $OUT/second.txt"
    again = script("start.sh", "60", "bash", "-c", second, env=env_for(tmp_path, OUT=str(tmp_path / "call2")))
    assert again.returncode == 0, again.stderr
    assert "waiting for it instead" in again.stdout and "ended with status 0" in again.stdout
    back = tmp_path / "call2"
    assert (back / "job.rc").read_text().strip() == "0" and "done" in (back / "job.log").read_text()
    with tarfile.open(back / "out.tgz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"result.json", "gpu.txt"} <= names and "big.bin" not in names and "second.txt" not in names
    assert "big.bin" in (back / "skipped.txt").read_text()


def test_poll_says_when_the_machine_has_no_job(tmp_path):
    result = script("poll.sh", "0", env=env_for(tmp_path, OUT=str(tmp_path / "out")))
    assert result.returncode == 3 and "given back" in result.stderr


def test_poll_returns_the_jobs_failure(tmp_path):
    stage(tmp_path / "stage", num_parts=1)
    env = env_for(tmp_path, OUT=str(tmp_path / "out"))
    result = script("start.sh", "60", "bash", "-c", "echo broke >&2; exit 4", env=env)
    assert result.returncode == 4 and "ended with status 4" in result.stdout
    assert "broke" in (tmp_path / "out" / "job.log").read_text()
