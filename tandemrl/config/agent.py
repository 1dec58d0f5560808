"""The agent's sections: `agentloop.*` (turns, token budgets, sampling), `tools.*` (the search tool and
plug-in tools with their tags) and `reward.*` (the reward function)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandemrl.config.checks import MAX_INT32, _check, _check_finite_positive, _check_positive, _is_host_port


@dataclass
class AgentLoopConfig:
    task_name: str | None = None
    max_turns: int = 4
    max_actor_accept_staleness: int | None = None  # None: unlimited
    # model + tool tokens after the prompt. A 2-hop KB question takes ~370 tokens when all goes well
    # (two model turns, two information blocks, the answer); on real text (Wikipedia summaries) one
    # block of 3 passages is ~400 tokens, so max_turns searches need ~2k (docs/LEARNING.md, Budgets)
    max_response_tokens: int = 2048
    max_new_tokens_per_turn: int = 256
    # per information block; documents are truncated to fit. 512 cut no answer-bearing real-text block
    # (256 lost 12 % of them); KB blocks are under 160 (benchmarks/results/retrieval/info_budget.json)
    max_info_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    format_reward: bool = False  # Search-R1's structure score on top of exact match

    def __post_init__(self):
        _check(
            1 <= self.max_turns <= self.max_response_tokens,
            "agentloop.max_turns",
            self.max_turns,
            f"must be >= 1 and at most agentloop.max_response_tokens ({self.max_response_tokens}): it counts "
            "the searches of a trajectory, and the Search-R1 prompt tells the model to search (with 0 every "
            "search would be answered 'answer now'); every turn takes at least one token of the response",
            "Use e.g. 4 (Search-R1's setting).",
        )
        if self.max_actor_accept_staleness is not None:
            _check(
                self.max_actor_accept_staleness >= 0,
                "agentloop.max_actor_accept_staleness",
                self.max_actor_accept_staleness,
                "must be >= 0",
                "Use null for unlimited staleness.",
            )
        for key in ("max_response_tokens", "max_new_tokens_per_turn", "max_info_tokens"):
            _check_positive(f"agentloop.{key}", getattr(self, key))
        _check(
            self.temperature >= 0,
            "agentloop.temperature",
            self.temperature,
            "must be >= 0",
            "Use 0 for greedy decoding.",
        )
        _check(0 < self.top_p <= 1, "agentloop.top_p", self.top_p, "must be in (0, 1]", "Use 1.0 to disable.")
        _check(
            math.isfinite(self.temperature),
            "agentloop.temperature",
            self.temperature,
            "must be finite",
            "Use e.g. 1.0, or 0 for greedy decoding.",
        )
        _check(
            self.top_k == -1 or 1 <= self.top_k <= MAX_INT32,
            "agentloop.top_k",
            self.top_k,
            f"must be -1 (disabled) or in 1..{MAX_INT32:,} (the engines take a 32-bit integer)",
            "Use -1 to disable top-k sampling.",
        )
        _check(
            self.max_new_tokens_per_turn <= self.max_response_tokens,
            "agentloop.max_new_tokens_per_turn",
            self.max_new_tokens_per_turn,
            f"is larger than agentloop.max_response_tokens={self.max_response_tokens}, so one turn could "
            "never use it",
            "Lower max_new_tokens_per_turn or raise max_response_tokens.",
        )


@dataclass
class SearchToolConfig:
    server_addr: str = "127.0.0.1:8000"
    topk: int = 3
    timeout_s: float = 10.0
    max_retries: int = 3
    backoff_s: float = 0.5
    # a step whose failed searches (after retries) pass this fraction of its searches logs a warning
    warn_error_fraction: float = 0.05
    api_key: str | None = None  # None: $TANDEM_RETRIEVAL_API_KEY (a server launched by the run needs none)

    def __post_init__(self):
        _check(
            0 <= self.warn_error_fraction <= 1,
            "tools.search.warn_error_fraction",
            self.warn_error_fraction,
            "must be in [0, 1]",
            "Use e.g. 0.05.",
        )
        _check_finite_positive("tools.search.timeout_s", self.timeout_s)
        _check(
            math.isfinite(self.backoff_s) and self.backoff_s >= 0,
            "tools.search.backoff_s",
            self.backoff_s,
            "must be a finite number >= 0",
            "Use 0 to retry at once.",
        )
        _check(1 <= self.topk <= 50, "tools.search.topk", self.topk, "must be in 1..50", "Use e.g. 3.")
        address = self.server_addr.removeprefix("http://").removeprefix("https://").split("/", 1)[0]
        _check(
            _is_host_port(address),  # ':' or 'h:99999' passed here and failed at the first search
            "tools.search.server_addr",
            self.server_addr,
            "must be host:port, http(s)://host:port or a URL ending in /retrieve, with a port from 1 to 65535",
            "Use e.g. 127.0.0.1:8000.",
        )
        _check(
            self.max_retries >= 0,
            "tools.search.max_retries",
            self.max_retries,
            "must be >= 0",
            "Use 0 to disable retries.",
        )


# tags the agent loop already gives a meaning to: a plug-in tool may not take them
RESERVED_TOOL_TAGS = ("search", "answer", "think", "information")
_TAG_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def _check_tag(key: str, tag: str) -> None:
    _check(
        bool(tag) and tag[0].isalpha() and set(tag) <= _TAG_CHARS,
        key,
        tag,
        "must be a tag name: a letter, then letters, digits, '_' or '-'",
        "Use e.g. calculator (the model writes <calculator> ... </calculator>).",
    )


@dataclass
class CustomToolConfig:
    """`tools.<name>`: a plug-in tool (agent/tools.py). The model writes `<tag> input </tag>`; the
    callable's output goes back as `<result_tag>output</result_tag>`, masked from the loss."""

    function: str | None = None  # "module.path:callable" or "path/to/file.py:callable"; required
    tag: str | None = None  # None: the tool's name
    result_tag: str = "result"
    max_tokens: int = 256  # one result block, tags included; the output is cut to fit
    timeout_s: float = 10.0  # per call; a call past it returns an error text to the model


@dataclass
class ToolsConfig:
    search: SearchToolConfig = field(default_factory=SearchToolConfig)
    # plug-in tools by name, written as tools.<name>.function etc. (the loader files every key of
    # `tools` other than `search` here; `tandem config show` prints them back at tools.<name>)
    custom: dict[str, CustomToolConfig] = field(default_factory=dict)

    EXTRA_KEYS_FIELD = "custom"  # config/loader.py: unknown keys of this section are entries of `custom`

    def __post_init__(self):
        taken: dict[str, str] = {}  # tool tag -> the key that took it
        for name, tool in self.custom.items():
            _check(
                tool.function is not None,
                f"tools.{name}.function",
                None,
                "is required for a plug-in tool",
                f'Set tools.{name}.function to "module.path:callable" or "path/to/file.py:callable".',
            )
            _check_positive(f"tools.{name}.max_tokens", tool.max_tokens)
            _check_finite_positive(f"tools.{name}.timeout_s", tool.timeout_s)
            if tool.tag is None:
                _check_tag(f"tools.{name}", name)
                tool.tag = name
            _check_tag(f"tools.{name}.tag", tool.tag)
            owner = "the Search-R1 format" if tool.tag in RESERVED_TOOL_TAGS else taken.get(tool.tag)
            _check(
                owner is None,
                f"tools.{name}.tag",
                tool.tag,
                f"is already taken (by {owner})",
                "Give each tool a tag of its own.",
            )
            taken[tool.tag] = f"tools.{name}.tag"
        for name, tool in self.custom.items():  # results may share a tag, never with a tool or the format
            _check_tag(f"tools.{name}.result_tag", tool.result_tag)
            owner = (
                "the Search-R1 format"
                if tool.result_tag in RESERVED_TOOL_TAGS
                else taken.get(tool.result_tag)
            )
            _check(
                owner is None,
                f"tools.{name}.result_tag",
                tool.result_tag,
                f"is already taken (by {owner})",
                "Use a result tag no tool uses, e.g. result.",
            )


@dataclass
class RewardConfig:
    """The trajectory reward (agent/reward.py). None: exact match (+ Search-R1's format score under
    agentloop.format_reward); built-ins: tandemrl.agent.reward:exact_match, tandemrl.agent.reward:f1."""

    function: str | None = None  # "module.path:callable" or "path/to/file.py:callable"
