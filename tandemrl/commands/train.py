"""`tandem train CONFIG [overrides] [--dry-run]`: load the config, place and start the services and
the actor, run, stop all.

Invariant: the order is config and placement plan (errors before anything starts) -> every server
spawned, then the actor submitted, all booting at once -> the driver's own preparation (tokenizer,
prompts, heavy imports) while they boot -> wait for all -> runner; teardown is the reverse and
happens on every exit path, Ctrl-C and SIGTERM included (exit 130, one line). A kill -9 of this
process is cleaned up by the run's reaper (cluster/reaper.py). Every phase of every process lands on
the start-up timeline (host/startup.py). See docs/DESIGN.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from tandemrl.config.loader import load_config
from tandemrl.runner import exit_guard

if TYPE_CHECKING:
    import argparse
    from types import FrameType

    from tandemrl.cluster.actor_group import ActorGroup
    from tandemrl.cluster.cpus import CpuPlan
    from tandemrl.cluster.placement import PlacementPlan
    from tandemrl.config.schema import TandemConfig
    from tandemrl.host.child_server import ChildServer
    from tandemrl.runner.context import RunContext
    from tandemrl.runner.services import Services

log = logging.getLogger(__name__)

EXIT_INTERRUPTED = 130

T = TypeVar("T")


class Interrupt:
    """SIGINT and SIGTERM for `tandem train`. While the session's event loop runs, the first signal
    cancels its main task, as asyncio.Runner does for Ctrl-C: a KeyboardInterrupt raised at whatever
    line runs can be caught by library code and lost (aiohttp turns one raised while it feeds a response
    body into a ClientPayloadError, which the search tool retries). The cancellation unwinds the
    session's teardown and `_train` turns it into KeyboardInterrupt. Outside the loop, or at a second
    signal, the handler raises KeyboardInterrupt at once."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.task: asyncio.Task | None = None
        self.is_reporting = False  # the stop line is being written: a further signal must not cut it

    def handle(self, signum: int, frame: FrameType | None) -> None:
        from tandemrl.runner import exit_guard

        self.received.append(signum)
        if self.is_reporting:
            exit_guard.arm(EXIT_INTERRUPTED, f"second {signal.Signals(signum).name}")
            return
        task = self.task
        if task is not None and not task.done() and len(self.received) == 1:
            task.cancel()
            task.get_loop().call_soon_threadsafe(lambda: None)  # wake the loop from its select
            return
        if len(self.received) > 1 and exit_guard.arm(
            EXIT_INTERRUPTED, f"second {signal.Signals(signum).name}"
        ):
            # whatever the unwinding waits on, the process ends (exit_guard.py); a later signal must not
            # interrupt the stop line
            if len(self.received) > 2:
                return
        signal.default_int_handler(signum, frame)  # KeyboardInterrupt: unwinds through every finally

    async def run(self, session: Awaitable[T]) -> T:
        """Await the session as the task a signal cancels."""
        self.task = asyncio.current_task()
        try:
            return await session
        finally:
            self.task = None


# set by run_train for the run it starts; None when train() is called as a library function
_interrupt: Interrupt | None = None


def process_age_s() -> float:
    """Seconds since this process started (the figure `time to first step` counts from); 0 where the
    system does not say."""
    from tandemrl.host.startup import process_start_epoch

    started = process_start_epoch()
    return max(0.0, time.time() - started) if started is not None else 0.0


def train(config: TandemConfig, write_plots: bool = True, started_s: float | None = None) -> RunContext:
    """Run one training from a derived `TandemConfig`; returns the runner context. `started_s`
    (time.monotonic() at the process start) makes the run log its time to the first step, and starts
    the start-up timeline's clock (else it starts at this call). The run holds `runner.output_dir`
    throughout (runner/output_lock.py): ConfigError at once, nothing started, if another run holds it."""
    from tandemrl.runner.output_lock import hold_output_dir

    with hold_output_dir(config.runner.output_dir):
        return _train_in_output_dir(config, write_plots, started_s)


def _train_in_output_dir(config: TandemConfig, write_plots: bool, started_s: float | None) -> RunContext:
    from tandemrl.cluster.mps import LOG_ENV, PIPE_ENV, SM_PERCENT_ENV, start_for_run
    from tandemrl.host import startup

    origin_epoch = time.time() - (time.monotonic() - started_s) if started_s is not None else time.time()
    output_dir = Path(config.runner.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    # what the run puts in this process's environment for its children, given back when it ends
    run_env = (startup.STARTUP_LOG_ENV, startup.STARTUP_NAME_ENV, PIPE_ENV, LOG_ENV, SM_PERCENT_ENV)
    saved = {key: os.environ.get(key) for key in run_env}
    startup.begin(output_dir / "startup_marks.jsonl", "driver")
    if started_s is not None:
        startup.mark("process started", at=origin_epoch)
    origin = (origin_epoch, "process start" if started_s is not None else "train() call")
    mps = None
    try:
        mps = start_for_run(config)  # before anything touches CUDA: every CUDA process must find it
        if mps is not None:
            startup.mark("MPS daemon started")
        return _train(config, write_plots, started_s, origin)
    finally:
        if mps is not None:
            mps.stop()
        _restore_env(saved)


def _restore_env(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _train(
    config: TandemConfig, write_plots: bool, started_s: float | None, origin: tuple[float, str]
) -> RunContext:
    from tandemrl.cluster.actor_group import ActorGroup
    from tandemrl.cluster.mps import sm_percent_env
    from tandemrl.cluster.placement import describe_plan, plan_placement
    from tandemrl.cluster.ray_nodes import shutdown_ray
    from tandemrl.commands.preflight import check_before_services
    from tandemrl.commands.show import render
    from tandemrl.host.cpus import available_cpus, pin_process
    from tandemrl.host.startup import mark
    from tandemrl.metrics.plots import write_plots as plot
    from tandemrl.runner.services import Services, resolve_auto_devices
    from tandemrl.runner.session import prepare_session, run_session

    if not config.cluster.use_ray:
        os.environ.update(sm_percent_env(config, "actor"))  # the actor trains in this very process
    resolve_auto_devices(config)
    plan = plan_placement(config)
    check_before_services(config)  # what `tandem config show --check` also runs
    cpu_plan, cpu_lines = _cpu_plan(config, plan)
    for line in [*describe_plan(config, plan), *cpu_lines]:
        log.info("%s", line)
    log.info(
        "%s runner, output in %s", "async" if config.runner.async_mode else "sync", config.runner.output_dir
    )
    output_dir = Path(config.runner.output_dir)
    (output_dir / "config.yaml").write_text(render(config) + "\n")  # read by `tandem plot`
    mark("config loaded, placement planned")
    start_s = time.monotonic()
    services = Services(config, plan, engine_cpus=cpu_plan.engines if cpu_plan else ())
    actor, own_cpus = None, available_cpus()
    try:
        if cpu_plan is not None:
            pin_process(cpu_plan.shared)  # this process and all it starts (Ray, servers) but the pinned
        services.launch()
        actor = ActorGroup(config, plan, services.nodes, cpus=cpu_plan.actor if cpu_plan else ())
        mark("actor submitted")
        prepared = prepare_session(config)  # while the servers and the actor boot
        actor.wait_ready()
        actor_s = time.monotonic() - start_s
        mark("actor ready")
        services.wait()
        mark("all services ready")
        log.info(
            "start-up: actor ready after %.1f s, all services after %.1f s",
            actor_s,
            time.monotonic() - start_s,
        )
        placed = placed_nodes(services, actor)
        session = _stop_on_a_death(run_session(config, services, actor, started_s, prepared, origin))
        try:
            ctx = asyncio.run(_interrupt.run(session) if _interrupt is not None else session)
        except asyncio.CancelledError:
            if _interrupt is not None and _interrupt.received:
                raise KeyboardInterrupt from None
            raise
        finally:
            exit_guard.disarm(STUCK_ON_A_DEATH)  # asyncio.run returned: the command ends by itself
        ctx.placed_nodes = placed
    finally:
        if actor is not None:
            actor.shutdown()
        services.stop()
        shutdown_ray()
        if cpu_plan is not None:
            pin_process(own_cpus)  # as it was: a later run in this process plans from the whole set
    if write_plots:
        paths = plot(config.runner.output_dir, config.algorithm.n_minibatches)
        log.info("plots: %s", ", ".join(str(p) for p in paths))
    return ctx


STUCK_ON_A_DEATH = "a server died, and a thread still waits on it"


def _cpu_plan(config: TandemConfig, plan: PlacementPlan) -> tuple[CpuPlan | None, list[str]]:
    """(the run's CPU plan or None, the lines that say it) for `cluster.cpu_pinning` (cluster/cpus.py)."""
    from tandemrl.cluster.cpus import plan_cpus

    cpu_plan, why = plan_cpus(config, plan)
    return cpu_plan, [f"cluster.cpu_pinning = {why}", *(cpu_plan.describe() if cpu_plan else [])]


async def _stop_on_a_death(session: Awaitable[T]) -> T:
    """A dead engine can leave a thread blocked on it (a weight broadcast to a peer that is gone waits out
    its collective's timeout), and `asyncio.run` joins its executor's threads before it returns: the run
    would print its stop line minutes later. So in the `tandem` process the death arms the exit guard
    (runner/exit_guard.py): unless `asyncio.run` returns within its grace, the process prints the stop line
    and exits 1; every server dies with it (PR_SET_PDEATHSIG) and the reaper ends the rest."""
    from tandemrl.runner.services import ServiceDiedError

    try:
        return await session
    except ServiceDiedError as error:
        exit_guard.arm(1, STUCK_ON_A_DEATH, line=f"tandem train: {error}")
        raise


def placed_nodes(services: Services, actor: ActorGroup) -> dict[str, str]:
    """Where Ray actually put each Ray-placed process (node ids read back from the placement groups)."""
    placed = {f"actor rank {rank}": node_id for rank, node_id in enumerate(actor.rank_node_ids)}
    placed.update({h.name: h.node_id for h in services.group.handles if h.node_id is not None})
    for name, node_id in placed.items():
        log.info("%s runs on Ray node %s", name, node_id)
    return placed


def dry_run(config: TandemConfig) -> int:
    """Print the plan: processes with node and GPUs, derived limits, weight-sync route, the actor's
    memory per rank and its load's per node (commands/actor_memory.py), and each launched server's command
    as the launch runs it (its interpreter, PYTHONPATH and key file); start nothing."""
    from tandemrl.cluster.placement import describe_plan, plan_placement
    from tandemrl.commands.actor_memory import describe_actor_memory

    plan = plan_placement(config)
    lines = [*describe_plan(config, plan), *_cpu_plan(config, plan)[1], *describe_actor_memory(config, plan)]
    if config.rollout.backend in ("sglang", "vllm") and plan.engines:
        from tandemrl.cluster.server_supervisor import ServerSpec, build_server

        per_node: dict[int, int] = {}
        for index, placement in enumerate(plan.engines):
            offset = per_node.get(placement.node, 0)
            per_node[placement.node] = offset + 1
            path = config.rollout.model.model_path or "<the embedded SmolLM2>"
            spec = ServerSpec(config.rollout.backend, index, config, model_path=path, port_offset=offset)
            server = build_server(spec, "127.0.0.1")
            section = getattr(config.rollout, config.rollout.backend)
            if plan.num_nodes > 1 and section.host is None:
                server.host = f"<node {placement.node} address>"
            if section.port is None:
                server.port = "<a free port>"  # chosen on its node at launch
            lines.append(f"rollout engine {index} command: {_launch_command(config, server)}")
    print("\n".join(["tandem train --dry-run: nothing started", *lines]))
    return 0


def _launch_command(config: TandemConfig, server: ChildServer) -> str:
    """The command line a launch runs: every launched server gets the run's fresh API key, which SGLang
    reads from a private `--config` file (made at launch) and vLLM from VLLM_API_KEY."""
    args = server.command()
    backend = config.rollout.backend
    extra = list(getattr(config.rollout, backend).extra_args)
    if backend == "sglang":
        at = len(args) - len(extra)
        args[at:at] = ["--config", "<args.yaml with the run's API key, in a private temp dir made at launch>"]
    env = {k: v for k, v in (server.env or {}).items() if k == "PYTHONPATH"}
    if backend == "vllm":
        env["VLLM_API_KEY"] = "<the run's API key>"
    words = [f"{key}={_quoted(value)}" for key, value in env.items()] + [_quoted(str(a)) for a in args]
    return " ".join(words)


def _quoted(word: str) -> str:
    import shlex

    return word if word.startswith("<") else shlex.quote(word)  # <...>: what the launch fills in


def interrupted_line(config: TandemConfig, signum: int) -> str:
    """The one line of an interrupted run: where it stopped and what resume point it left."""
    from tandemrl.metrics.logger import read_history
    from tandemrl.trainer.checkpoint import latest_checkpoint

    output_dir = Path(config.runner.output_dir)
    try:
        history = read_history(output_dir / "metrics.jsonl", skipped=[])
    except ValueError:  # a damaged metrics.jsonl must not hide the stop line
        history = []
    last_step = int(history[-1]["step"]) if history else 0
    checkpoint = latest_checkpoint(output_dir)
    resume = f"resume with runner.resume_from={checkpoint}" if checkpoint else "no checkpoint to resume from"
    return (
        f"tandem train: stopped by {signal.Signals(signum).name} after step {last_step} of "
        f"{config.runner.max_steps}; services stopped. No checkpoint written on interrupt: the actor may be "
        f"mid-update, so its weights are not those of a finished step (runner.save_interval="
        f"{config.runner.save_interval} saved the due ones); {resume}."
    )


def _report_interrupted(config: TandemConfig, received: list[int]) -> int:
    from tandemrl.runner import exit_guard

    print(interrupted_line(config, received[0] if received else signal.SIGINT), file=sys.stderr)
    sys.stderr.flush()
    # everything is stopped: a thread still computing (asyncio's executor) must not keep the process
    exit_guard.arm(EXIT_INTERRUPTED, exit_guard.STILL_RUNNING)
    return EXIT_INTERRUPTED


def _report_stopped(error: Exception) -> int:
    """A server died (or too many groups were dropped): its line, then the exit guard. A thread may still
    wait on the dead server (a weight broadcast to a peer that is gone waits out its collective's timeout),
    and Python joins the executors' threads at exit, after `asyncio.run` has returned and `train` disarmed
    the guard it armed for the death (_stop_on_a_death)."""
    from tandemrl.runner import exit_guard
    from tandemrl.runner.services import ServiceDiedError

    print(f"tandem train: {error}", file=sys.stderr)
    sys.stderr.flush()
    died = isinstance(error, ServiceDiedError)
    exit_guard.arm(1, STUCK_ON_A_DEATH if died else exit_guard.STILL_RUNNING)
    return 1


def run_train(args: argparse.Namespace) -> int:
    from tandemrl.commands.preflight import check_startable
    from tandemrl.runner.output_lock import hold_output_dir
    from tandemrl.runner.services import check_index_free

    config = load_config(args.config, args.overrides)
    if getattr(args, "dry_run", False):
        return dry_run(config)
    check_startable(config)  # what `tandem config show` also refuses, before anything starts
    with hold_output_dir(config.runner.output_dir):  # one run per output directory
        check_index_free(config)  # one run per local index, unless they share one retrieval server
        return _run_held(config)


def _run_held(config: TandemConfig) -> int:
    from tandemrl.buffer.rollout_buffer import DroppedGroupsLimitError
    from tandemrl.cluster.reaper import start_reaper
    from tandemrl.runner.services import ServiceDiedError

    global _interrupt
    interrupt = _interrupt = Interrupt()
    received = interrupt.received
    previous = {signum: signal.signal(signum, interrupt.handle) for signum in (signal.SIGINT, signal.SIGTERM)}
    start_reaper()
    try:
        ctx = train(config, started_s=time.monotonic() - process_age_s())
    except KeyboardInterrupt:
        interrupt.is_reporting = True
        return _report_interrupted(config, received)
    except Exception as error:
        interrupt.is_reporting = bool(received)
        if received:
            # a signal outside the loop that library code turned into another error (see Interrupt)
            log.debug("after %s the run ended with %r", signal.Signals(received[0]).name, error)
            return _report_interrupted(config, received)
        if isinstance(error, (ServiceDiedError, DroppedGroupsLimitError)):
            return _report_stopped(error)
        raise
    finally:
        _interrupt = None
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    output_dir = Path(config.runner.output_dir)
    print(
        f"tandem train: {config.runner.max_steps} steps done; time to first step {ctx.first_step_s:.1f} s; "
        f"TensorBoard logs in {output_dir / 'tensorboard'}, checkpoints in {output_dir / 'checkpoints'}, "
        f"plots in {output_dir / 'plots'}"
    )
    return 0 if ctx is not None else 1
