"""Benchmarks of tandemrl, one group per folder (benchmarks/README.md), and what their scripts share."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(path: str | Path, obj: object, *, indent: int = 2) -> Path:
    """Write `obj` as JSON (`indent` spaces, a newline at the end) to `path`, making its folder, and print
    `wrote <path>`. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=indent) + "\n")
    print(f"wrote {path}")
    return path
