"""Whether the interpreter a launched vLLM or SGLang server will run can import its engine.

`tandem config show` and `tandem train` ask before anything starts (commands/preflight.py): the
interpreter `rollout.<backend>.python` (None: tandem's own) with `rollout.<backend>.pythonpath` first on
its PYTHONPATH, exactly the environment the launch gives the server (rollout/sglang_process.py
`engine_env`), runs `import <engine>` in a child process. A failure names the interpreter, what the
import said, and the two keys that change it. The import is real (not a spec lookup), so a broken install
(a wheel built against another torch) is found here and not after the run has started its actor.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tandemrl.rollout.sglang_process import engine_env

IMPORT_TIMEOUT_S = 300.0  # vLLM's import reads a few thousand modules; a cold disk takes a while


def import_error(module: str, python: str | None, pythonpath: list[str]) -> str | None:
    """None when `python -c "import <module>"` succeeds under the launch's environment, else what it said
    (its last line of output, or why it could not run)."""
    interpreter = python or sys.executable
    env = {**os.environ, **engine_env(pythonpath)}
    try:
        result = subprocess.run(
            [interpreter, "-c", f"import {module}"],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=IMPORT_TIMEOUT_S,
        )
    except OSError as error:
        return f"it cannot run ({error.strerror or error})"
    except subprocess.TimeoutExpired:
        return f"`import {module}` did not finish in {IMPORT_TIMEOUT_S:.0f} s"
    if result.returncode == 0:
        return None
    lines = [line.strip() for line in (result.stderr or result.stdout).splitlines() if line.strip()]
    return lines[-1][:300] if lines else f"exit status {result.returncode}"


def engine_import_message(backend: str, python: str | None, pythonpath: list[str], said: str) -> str:
    interpreter = python or f"{sys.executable} (tandem's own)"
    where = f" with PYTHONPATH {os.pathsep.join(pythonpath)} first" if pythonpath else ""
    return (
        f"rollout.backend={backend} without rollout.server_addrs: tandem launches {backend} servers with "
        f"{interpreter}{where}, and `import {backend}` there failed: {said}. Point rollout.{backend}.python at "
        f"an interpreter that has {backend} (or rollout.{backend}.pythonpath at where it is installed), or "
        f"start the servers yourself and list them in rollout.server_addrs."
    )
