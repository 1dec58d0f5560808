"""`tandem config show`: the resolved configuration as YAML, derived values marked with a comment, API
keys shown only as `<set>`. It refuses (exit 2) what `tandem train` would refuse at start-up
(config/preflight.py), so a config that shows is one that starts."""

from __future__ import annotations

import argparse

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
    from tandemrl.config.preflight import check_startable

    config = load_config(args.config, args.overrides)
    check_startable(config)
    print(render(config))
    return 0
