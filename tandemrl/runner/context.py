"""What a runner works with: the `RunContext` both runners hand to the pieces of a step (runner/step.py).

Invariant: `ctx.weight_version` is the version in the engines and the one the next hand-off is
measured against (docs/DESIGN.md, Weight sync); it moves only in `sync_weights`, after the engines hold the new weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tandemrl.host.loop_monitor import LoopMonitor
from tandemrl.runner.rollout_driver import RolloutDriver

if TYPE_CHECKING:
    import asyncio

    from tandemrl.cluster.actor_group import ActorGroup
    from tandemrl.config.schema import TandemConfig
    from tandemrl.data.loader import Prompt
    from tandemrl.metrics.logger import MetricsLogger
    from tandemrl.rollout.client import HttpClient
    from tandemrl.runner.step import PendingValidation


@dataclass
class RunContext:
    config: TandemConfig
    driver: RolloutDriver
    actor: ActorGroup
    engines: list[HttpClient]  # one client per engine
    logger: MetricsLogger
    output_dir: Path
    weight_version: int
    start_step: int = 0
    val_prompts: list[Prompt] = field(default_factory=list)
    last_step_end_s: float = field(default_factory=time.monotonic)
    clock_start_s: float | None = None  # monotonic start of the first step (`start_clock`)
    busy_mark: tuple[float, dict[str, float]] | None = None  # (monotonic time, engines' BUSY_KEYS totals)
    retrieval_mark: tuple[float, dict[str, float]] | None = None  # (monotonic time, RETRIEVAL_KEYS totals)
    launched_spec_mark: tuple[float, dict[str, float]] | None = None  # vLLM's or SGLang's spec counters
    started_s: float | None = None  # monotonic time of the process start (`tandem train`)
    first_step_s: float = float("nan")  # process start -> end of the run's first step
    placed_nodes: dict[str, str] = field(default_factory=dict)  # process -> the Ray node id it runs on
    startup_origin: tuple[float, str] | None = None  # (epoch, what it is): the start-up timeline's clock
    is_first_step_done: bool = False
    colocated_policy: str = "concurrent"  # the plan's: time_share stands the engines down while training
    atomic_weight_updates: bool = False  # a push lands between two engine steps (rollout/weight_sync.py)
    pending_validation: PendingValidation | None = None  # a validation running beside the next step
    bookkeeping: asyncio.Task | None = None  # the last step's records and row, made beside this step
    train_reads: asyncio.Future | None = None  # the engines' counters around this step's train step
    # how long the driver's event loop (agents, runner, bookkeeping) was held, and by what: `close_step`
    # takes each step's window (host/loop_monitor.py); None: not watched (tests that build a context)
    loop_monitor: LoopMonitor | None = None

    @property
    def engines_stand_down(self) -> bool:
        """`cluster.colocated_policy=time_share`: the engines are paused while the actor trains."""
        return self.colocated_policy == "time_share"

    @property
    def engines_generate_while_training(self) -> bool:
        """The async runner with engines that are not stood down for the train step (`time_share`)."""
        return self.config.runner.async_mode and not self.engines_stand_down

    @property
    def may_overlap_validation(self) -> bool:
        """`runner.overlap_validation`, unless the engines stand down while the actor trains: a validation
        paused then would finish after the next weight sync, on weights not its step's."""
        return self.config.runner.overlap_validation and not self.engines_stand_down

    @property
    def ledger_path(self) -> Path:
        return self.output_dir / "prompts.jsonl"
