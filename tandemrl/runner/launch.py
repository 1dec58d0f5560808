"""`tandem train CONFIG [overrides]`: load the config, start the services and the actor, run, stop all.

Invariant: the order is config (errors before anything starts) -> retrieval server + engines ->
actor worker (Ray or in-process) -> runner; teardown is the reverse and happens on every exit path.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

from tandemrl.config.derive import describe_derived
from tandemrl.config.loader import load_config

log = logging.getLogger(__name__)


def train(config: Any, write_plots: bool = True) -> Any:
    """Run one training from a derived `TandemConfig`; returns the runner context."""
    from tandemrl.cluster.actor_group import ActorGroup
    from tandemrl.config.show import render
    from tandemrl.metrics.plots import write_plots as plot
    from tandemrl.runner.services import Services
    from tandemrl.runner.session import run_session

    for line in describe_derived(config):
        log.info("%s", line)
    log.info(
        "%s runner, output in %s", "async" if config.runner.async_mode else "sync", config.runner.output_dir
    )
    output_dir = Path(config.runner.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "config.yaml").write_text(render(config) + "\n")  # read by `tandem plot`
    services = Services(config).start()
    actor = None
    try:
        actor = ActorGroup(config)
        ctx = asyncio.run(run_session(config, services, actor))
    finally:
        if actor is not None:
            actor.shutdown()
        services.stop()
    if write_plots:
        paths = plot(config.runner.output_dir, config.algorithm.n_minibatches)
        log.info("plots: %s", ", ".join(str(p) for p in paths))
    return ctx


def run_train(args: Any) -> int:
    from tandemrl.buffer.rollout_buffer import DroppedGroupsLimitError
    from tandemrl.runner.services import EngineDiedError

    config = load_config(args.config, args.overrides)
    try:
        ctx = train(config)
    except (EngineDiedError, DroppedGroupsLimitError) as error:
        print(f"tandem train: {error}", file=sys.stderr)
        return 1
    output_dir = Path(config.runner.output_dir)
    print(
        f"tandem train: {config.runner.max_steps} steps done; TensorBoard logs in {output_dir / 'tensorboard'}, "
        f"checkpoints in {output_dir / 'checkpoints'}, plots in {output_dir / 'plots'}"
    )
    return 0 if ctx is not None else 1
