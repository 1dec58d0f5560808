"""Where the embedded defaults live: `$TANDEM_HOME` (default `~/.cache/tandemrl`).

Invariant: every prepared artefact has exactly one default path, defined here, so the CLI, the
runner and the tests agree on where to find it.
"""

from __future__ import annotations

import os
from pathlib import Path


def tandem_home() -> Path:
    return Path(os.environ.get("TANDEM_HOME", Path.home() / ".cache" / "tandemrl")).expanduser()


def default_model_dir() -> Path:
    return tandem_home() / "models" / "SmolLM2-135M-Instruct"


def default_coldstart_dir() -> Path:
    """Where `tandem sft` writes the embedded policy after its cold start; `model_path: coldstart` names it."""
    return tandem_home() / "models" / "SmolLM2-135M-Instruct-coldstart"


def default_retriever_dir() -> Path:
    return tandem_home() / "models" / "all-MiniLM-L6-v2"


def default_kb_dir() -> Path:
    return tandem_home() / "kb" / "seed0"


def default_index_dir() -> Path:
    return tandem_home() / "index" / "kb-seed0-minilm"
