"""Ray workers import the driver's `tandemrl`, not a `tandemrl` folder in the directory `tandem train`
was started in (issue 42, item 11). A real local Ray is started by `init_ray` from a driver whose
working directory holds a decoy package, as `tandem` (a console script) would be: the driver itself
imports the installed package, and Ray hands its working directory to every worker's sys.path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import tandemrl

DRIVER = """
import json, sys
import ray
from tandemrl.cluster.ray_nodes import init_ray, shutdown_ray
from tandemrl.cluster.reaper import tagged_pids  # a class of tandemrl, shipped by reference below
from tandemrl.config.loader import load_config

init_ray(load_config(None, ["cluster.use_ray=true"]))

@ray.remote
class Probe:  # defined here, shipped by value: it imports tandemrl in the worker
    def where(self):
        import tandemrl
        return tandemrl.__file__

by_reference = ray.remote(tagged_pids)  # deserialized in the worker by importing tandemrl.cluster.reaper
plain = Probe.remote()
with_env = Probe.options(runtime_env={"env_vars": {"X_TANDEM_PROBE": "1"}}).remote()  # as actor_group does
found = {
    "actor": ray.get(plain.where.remote()),
    "actor with its own runtime_env": ray.get(with_env.where.remote()),
    "function by reference": ray.get(by_reference.remote("no-such-run")) == [],
}
shutdown_ray()
print("FOUND " + json.dumps(found))
"""


def test_ray_workers_import_the_drivers_package_not_the_working_directorys(tmp_path):
    decoy = tmp_path / "other-checkout"
    marker = tmp_path / "decoy-imported"
    for package in ("tandemrl", "tandemrl/cluster"):
        (decoy / package).mkdir(parents=True)
        (decoy / package / "__init__.py").write_text(f"open({str(marker)!r}, 'a').write('{package}\\n')\n")
    script = tmp_path / "bin" / "driver.py"  # run by path, like the `tandem` console script
    script.parent.mkdir()
    script.write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=decoy, capture_output=True, text=True, timeout=300, env=env
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("FOUND ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    found = json.loads(lines[0].removeprefix("FOUND "))
    installed = str(Path(tandemrl.__file__).resolve())
    assert found["actor"] == installed and found["actor with its own runtime_env"] == installed, found
    assert found["function by reference"] is True
    assert not marker.exists(), marker.read_text()
