"""`tandem config show [--check]`: the resolved configuration as YAML, derived values marked with a
comment, API keys shown only as `<set>`. It refuses (exit 2) bad keys and combinations and what this
machine could not start (commands/preflight.py `check_startable`); `--check` also runs every other check
`tandem train` makes before it starts a service (`check_before_services`: data files read whole, the
index, the model directory, placeholder paths), so a config that passes `config show --check` gets past
`train`'s start-up checks. Plain `config show` does not read the data: it shows configs meant for
another machine, and the defaults."""

from __future__ import annotations

import argparse
import sys

import yaml

from tandemrl.config.loader import load_config, to_dict


def render(config) -> str:
    """YAML of every key; a derived key carries `# derived: <how>` on its line."""
    lines = yaml.safe_dump(to_dict(config), sort_keys=False, default_flow_style=False).splitlines()
    out, path = [], []
    for line in lines:
        stripped = line.lstrip()
        depth = (len(line) - len(stripped)) // 2
        key = stripped.split(":", 1)[0]
        if stripped.startswith("- ") or ":" not in stripped:
            out.append(line)
            continue
        path = path[:depth] + [key]
        if key == "api_key" and not stripped.endswith(": null"):
            line = line.split(":", 1)[0] + ": <set>"  # a secret: say that it is set, never what it is
        how = config.derived.get(".".join(path))
        out.append(f"{line}  # derived: {how}" if how else line)
    return "\n".join(out)


def run_show(args: argparse.Namespace) -> int:
    from tandemrl.commands.preflight import check_startable

    config = load_config(args.config, args.overrides)
    check_startable(config)
    if getattr(args, "check", False):
        from tandemrl.cluster.placement import plan_placement
        from tandemrl.commands.preflight import check_before_services
        from tandemrl.runner.services import resolve_auto_devices

        resolve_auto_devices(config)  # as train does before it plans
        plan_placement(config)
        check_before_services(config)
    print(render(config))
    if getattr(args, "check", False):
        print(
            "# --check: every check `tandem train` makes before it starts a service passed", file=sys.stderr
        )
    return 0
