"""The rollout driver: keeps the engines fed through the buffer's admission and collects finished groups.

    feed.next() ─► buffer.issue ─► run_group (agent loop, one task per group) ─► buffer.finish
         ▲ admission loop wakes on every change            (least-loaded engine per group)
         └──────────── next_handoff(actor weight_version) ◄─ buffer.take

Invariants: admission is decided only by the buffer's limits (the staleness limit among them, which
counts the weight versions the driver reports to the buffer) and by the runner's wish to issue
(`pause_admission` for sync training and drains; a `quota` on in-flight + buffered groups in sync
mode); a failing group or a broken buffer limit is re-raised to the runner at its next wait, so no
error is swallowed. `weight_version` is the version in the engines; the runner moves it after a sync.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from tandemrl.buffer.rollout_buffer import HandOff, TaskBuffer
from tandemrl.host.startup import mark

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tandemrl.agent.tools import AgentEnv
    from tandemrl.buffer.group import Group
    from tandemrl.config.agent import AgentLoopConfig
    from tandemrl.data.loader import Prompt
    from tandemrl.rollout.client import HttpClient
    from tandemrl.runner.prompt_feed import PromptFeed

log = logging.getLogger(__name__)

RunGroupFn = Callable[..., Awaitable[list[Any]]]


class RolloutDriver:
    def __init__(
        self,
        buffer: TaskBuffer,
        feed: PromptFeed,
        engines: list[HttpClient],
        search: AgentEnv,
        tokenizer: PreTrainedTokenizerBase,
        agent_cfg: AgentLoopConfig,
        group_size: int,
        weight_version: int,
        run_group_fn: RunGroupFn | None = None,
        quota: int | None = None,
    ):
        if run_group_fn is None:
            from tandemrl.agent.loop import run_group as run_group_fn
        self.buffer, self.feed, self.engines = buffer, feed, engines
        self.search, self.tokenizer, self.agent_cfg = search, tokenizer, agent_cfg
        self.group_size = group_size
        self.weight_version = weight_version
        buffer.set_weight_version(weight_version)
        self.quota = quota  # sync mode: at most this many groups in flight + buffered
        self._run_group = run_group_fn
        self._engine_load = [0] * len(engines)
        self._tasks: dict[int, asyncio.Task] = {}
        self._is_paused = False
        self._error: BaseException | None = None
        self._changed = asyncio.Event()
        self._admission_task: asyncio.Task | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._admission_task = asyncio.create_task(self._admission_loop(), name="admission")

    async def stop(self) -> None:
        """Cancel admission and every group still running (their prompts are skipped on resume)."""
        tasks = [t for t in [self._admission_task, *self._tasks.values()] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ---- admission ---------------------------------------------------------------------------------
    def _wants_to_issue(self) -> bool:
        if self._is_paused or self._error is not None:
            return False
        return self.quota is None or self.buffer.num_inflight + self.buffer.num_buffered < self.quota

    async def _admission_loop(self) -> None:
        while True:
            changed = self._changed
            try:
                self._admit()
            except Exception as error:  # e.g. empty data: re-raised by the runner's next wait
                log.error("admission failed: %r", error)
                self._error = self._error or error
                self.buffer.set_admission_open(False)
                self._notify()
                return
            await changed.wait()

    def _admit(self) -> None:
        """Issue groups while the runner wants to and the buffer's limits allow it."""
        wants = self._wants_to_issue()
        self.buffer.set_admission_open(wants)
        while wants and self.buffer.can_admit():
            self._issue(self.feed.next())
            wants = self._wants_to_issue()
            self.buffer.set_admission_open(wants)

    def _issue(self, prompt: Prompt) -> None:
        group = self.buffer.issue(prompt, self.weight_version)
        mark("first group issued", once=True)
        engine_index = min(range(len(self.engines)), key=self._engine_load.__getitem__)
        self._engine_load[engine_index] += 1
        self._tasks[group.issue_id] = asyncio.create_task(
            self._run(group, engine_index), name=f"group-{group.issue_id}"
        )

    async def _run(self, group: Group, engine_index: int) -> None:
        try:
            trajectories = await self._run_group(
                group.prompt,
                self.group_size,
                self.engines[engine_index],
                self.search,
                self.tokenizer,
                self.agent_cfg,
            )
            if self._error is not None:
                return  # the run is failing: leave the group unfinished rather than act on it
            self.buffer.finish(group.issue_id, trajectories, self.weight_version)
            mark("first group done", once=True)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # re-raised by the runner's next wait
            log.error("group %d (prompt %s) failed: %r", group.issue_id, group.prompt_id, error)
            self._error = self._error or error
        finally:
            self._engine_load[engine_index] -= 1
            self._tasks.pop(group.issue_id, None)
            self._notify()

    # ---- what the runners call ---------------------------------------------------------------------
    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    async def next_handoff(self, actor_weight_version: int, pause_admission: bool = False) -> HandOff:
        """Wait until `rollout_batch_size` finished groups pass the drops, and take them; with
        `pause_admission` (sync mode) admission is closed in the same instant, before it can refill."""
        while True:
            self.raise_if_failed()
            changed = self._changed
            handoff = self.buffer.take(actor_weight_version)
            if handoff is not None:
                self._is_paused = self._is_paused or pause_admission
                self._notify()  # slots were freed: admission may issue again
                return handoff
            await changed.wait()

    @property
    def is_paused(self) -> bool:
        return self._is_paused

    def pause_admission(self) -> None:
        self._is_paused = True
        self._notify()

    def resume_admission(self) -> None:
        self._is_paused = False
        self._notify()

    async def wait_idle(self) -> None:
        """Wait until no group is in flight (the `drain` pause mode; admission must be paused)."""
        while self._tasks:
            self.raise_if_failed()
            await self._changed.wait()
        self.raise_if_failed()

    def set_weight_version(self, weight_version: int) -> None:
        """The engines now hold `weight_version`; groups that can no longer be trained are dropped."""
        self.weight_version = weight_version
        self.buffer.set_weight_version(weight_version)  # may open admission (its staleness limit)
        self.buffer.drop_stale(weight_version)
        self._notify()
