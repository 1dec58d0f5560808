"""The agent loop's tools, keyed by the tag the model writes, and the environment they make with the reward.

    model turn ─► parse_action(tags) ─► <search> q </search>   ─► SearchCall    ─► <information>...</information>
                                     └► <calculator> x </...> ─► FunctionTool  ─► <result>...</result>
                                     └► <answer> a </answer>  ─► RewardFunction (agent/reward.py)

Invariants: a tool's block is whole text produced here, cut to its token budget with its closing tag
kept, and the loop appends it with loss mask 0 (it is never trained on); a tool that raises, returns
something that is not text or runs past its timeout answers with an error text in its block (counted
in the trajectory), never kills the run. `search` is the built-in tool behind the same interface;
plug-in tools come from `tools.<name>.function` (config/agent.py, CustomToolConfig).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tandemrl.agent.plugin import load_callable
from tandemrl.agent.prompt import (
    INFO_CLOSE,
    INFO_OPEN,
    STOP_STRINGS,
    encode_text,
    format_message,
    information_block,
)
from tandemrl.agent.reward import RewardFunction, load_reward
from tandemrl.agent.search_tool import SearchError
from tandemrl.config.errors import ConfigError
from tandemrl.host.messages import one_line

if TYPE_CHECKING:
    from tandemrl.agent.search_tool import SearchTool
    from tandemrl.config.agent import AgentLoopConfig, RewardConfig, ToolsConfig

log = logging.getLogger(__name__)

SEARCH_TAG = "search"


@dataclass
class ToolOutput:
    text: str  # the whole block inserted after the model's turn (masked), within the budget
    is_error: bool = False
    ids: list[int] | None = None  # the block's ids when the tool encoded it already (else the loop does)


class Tool(Protocol):
    tag: str  # the model writes <tag> input </tag>
    max_tokens: int  # the most tokens one block may take

    def min_tokens(self, tokenizer) -> int:
        """The smallest block (an empty result); the loop ends the trajectory when not even this fits."""

    async def call(self, content: str, tokenizer, max_tokens: int) -> ToolOutput: ...


class SearchCall:
    """The built-in `search` tool: the retrieval server's top-k documents as a Search-R1 information block."""

    tag = SEARCH_TAG

    def __init__(self, search_tool: SearchTool, max_tokens: int):
        self.search_tool, self.max_tokens = search_tool, max_tokens

    def min_tokens(self, tokenizer) -> int:
        return len(encode_text(tokenizer, INFO_OPEN + INFO_CLOSE))

    async def call(self, content: str, tokenizer, max_tokens: int) -> ToolOutput:
        try:
            docs = (await self.search_tool.search([content]))[0]
        except SearchError as error:  # "search failed: ..." after the tool's retries
            return ToolOutput(format_message(f"{INFO_OPEN}{error}{INFO_CLOSE}", tokenizer, max_tokens), True)
        text, ids = information_block(docs, tokenizer, max_tokens)
        return ToolOutput(text, ids=ids)


class FunctionTool:
    """A plug-in tool: `fn(input: str) -> str` (plain or async) answers `<tag> input </tag>` with
    `<result_tag>output</result_tag>`; a plain function runs in a worker thread, so it never stalls the
    other trajectories (past `timeout_s` the model gets an error text; the thread runs on until the
    function returns, as Python threads cannot be stopped)."""

    def __init__(self, name: str, fn: Callable, tag: str, result_tag: str, max_tokens: int, timeout_s: float):
        self.name, self.fn, self.tag = name, fn, tag
        self.max_tokens, self.timeout_s = max_tokens, timeout_s
        self.opening, self.closing = f"\n\n<{result_tag}>", f"</{result_tag}>\n\n"
        self._warned = False

    def min_tokens(self, tokenizer) -> int:
        return len(encode_text(tokenizer, self.opening + self.closing))

    async def call(self, content: str, tokenizer, max_tokens: int) -> ToolOutput:
        try:
            if inspect.iscoroutinefunction(self.fn):
                result = await asyncio.wait_for(self.fn(content), self.timeout_s)
            else:
                result = await asyncio.wait_for(asyncio.to_thread(self.fn, content), self.timeout_s)
            if not isinstance(result, str):
                raise TypeError(f"returned {type(result).__name__}, not str")
            text, is_error = result, False
        except asyncio.TimeoutError:
            text, is_error = f"tool {self.name} timed out after {self.timeout_s:g} s", True
        except Exception as error:  # the user's code: the model sees the error, the run goes on
            text, is_error = f"tool {self.name} failed: {one_line(error)}", True
        if is_error and not self._warned:
            self._warned = True  # once per run: the count is in the trajectories (num_tool_errors)
            log.warning("tools.%s: %s (further failures are counted, not logged)", self.name, text)
        block, ids = self._block(text, tokenizer, max_tokens)
        return ToolOutput(block, is_error, ids)

    def _block(self, text: str, tokenizer, max_tokens: int) -> tuple[str, list[int]]:
        """The result block, its text cut by tokens so that the block fits `max_tokens`; and its ids."""
        block = self.opening + text + self.closing
        ids = encode_text(tokenizer, block)
        if len(ids) <= max_tokens:
            return block, ids
        text_ids = encode_text(tokenizer, text)
        for room in range(max(0, max_tokens - self.min_tokens(tokenizer) - 1), 0, -1):
            # decoding and re-encoding may merge tokens differently at the edges: one token less, until it fits
            block = self.opening + tokenizer.decode(text_ids[:room]) + self.closing
            ids = encode_text(tokenizer, block)
            if len(ids) <= max_tokens:
                return block, ids
        block = self.opening + self.closing
        return block, encode_text(tokenizer, block)


class AgentEnv:
    """What the agent loop acts in: its tools by tag and the reward. It stands where the search tool
    stood (the rollout driver, the watchdog, validation): `url`, `health`, `server_info`, `search` and
    `close` are the search tool's."""

    def __init__(self, search_tool: SearchTool, tools: dict[str, Tool], reward: RewardFunction):
        assert SEARCH_TAG in tools, "search is always a tool"
        self.search_tool, self.tools, self.reward = search_tool, tools, reward
        self.tags = tuple(tools)
        self.stop_strings = [*STOP_STRINGS, *(f"</{tag}>" for tag in tools if tag != SEARCH_TAG)]

    @classmethod
    def builtin(cls, search_tool: SearchTool, max_info_tokens: int, format_reward: bool = False) -> AgentEnv:
        """Search only, and the built-in reward: what the loop uses when handed a bare search tool."""
        return cls(
            search_tool,
            {SEARCH_TAG: SearchCall(search_tool, max_info_tokens)},
            RewardFunction(None, format_reward=format_reward),
        )

    @property
    def url(self) -> str:
        return self.search_tool.url

    async def health(self) -> bool:
        return await self.search_tool.health()

    async def server_info(self) -> dict:
        return await self.search_tool.server_info()

    async def search(self, queries: list[str], topk: int | None = None) -> list[list[dict]]:
        return await self.search_tool.search(queries, topk)

    async def close(self) -> None:
        await self.search_tool.close()


def build_env(
    agentloop: AgentLoopConfig, tools: ToolsConfig, reward: RewardConfig, search_tool: SearchTool
) -> AgentEnv:
    """The run's environment: the search tool, the plug-in tools of `tools.<name>` and `reward.function`,
    each loaded and checked (ConfigError in one line naming the key)."""
    by_tag: dict[str, Tool] = {SEARCH_TAG: SearchCall(search_tool, agentloop.max_info_tokens)}
    for name, tool_cfg in tools.custom.items():
        fn = load_tool_function(name, tool_cfg.function)
        by_tag[tool_cfg.tag] = FunctionTool(
            name, fn, tool_cfg.tag, tool_cfg.result_tag, tool_cfg.max_tokens, tool_cfg.timeout_s
        )
    return AgentEnv(search_tool, by_tag, load_reward(reward, agentloop.format_reward))


def check_plugins(agentloop: AgentLoopConfig, tools: ToolsConfig, reward: RewardConfig) -> None:
    """The start-up check of every plug-in (`tandem config show`, `tandem train`, `tandem eval`): the
    reward imports and its dry call returns a finite number; each tool imports and takes one argument."""
    load_reward(reward, agentloop.format_reward)
    for name, tool_cfg in tools.custom.items():
        load_tool_function(name, tool_cfg.function)


def load_tool_function(name: str, spec: str) -> Callable:
    key = f"tools.{name}.function"
    fn = load_callable(spec, key)
    try:
        inspect.signature(fn).bind("input")
    except TypeError:
        raise ConfigError(
            f"{key}={spec!r}: the function must take the tool's input text as its one argument "
            f"(def {name}(text: str) -> str)."
        ) from None
    except ValueError:  # no signature to inspect (some builtins): trust it
        pass
    return fn
