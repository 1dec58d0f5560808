"""A request inside the engine: its sampling parameters, tokens so far and per-token bookkeeping.

Invariant: `output_ids`, `output_logprobs` and `output_weight_versions` always have the same length;
tokens are only appended, so a retracted request keeps everything it generated and is re-prefilled
over `prompt_ids + output_ids`. A token the GPU has sampled but the host has not read yet is *pending*
(`num_pending`: the last launch's token, and for a moment the one before it while the engine overlaps
steps): it counts in `num_tokens` (its position and KV slot are known) but not in `output_ids` until
the step that sampled it is postprocessed. A prefill step may forward only a chunk of a request's
uncached tokens: `chunk_end` then marks where it stops (set by the scheduler, cleared by the engine once
the step is launched) and the step samples nothing for that request. With speculative decoding a decode
step also forwards `draft_ids` after the last token and may append several tokens at once.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandemrl.config.checks import MAX_INT32

if TYPE_CHECKING:
    from tandemrl.engine.speculative import NgramIndex

SAMPLING_KEYS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_p",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "n",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
}
MAX_STOPS = 256  # stop strings / stop token ids per request: each is checked at every generated token
# Accepted for SGLang compatibility only at their neutral value; anything else is refused, not ignored.
_NEUTRAL = {
    "min_p": 0.0,
    "n": 1,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
}


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k (0 is refused, as SGLang refuses it)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    @classmethod
    def from_dict(cls, raw: dict | None) -> SamplingParams:
        """Validate SGLang-style sampling params; raises ValueError naming the field and the reason."""
        if raw is not None and not isinstance(raw, dict):
            raise ValueError(f"sampling_params must be a JSON object, got {type(raw).__name__}")
        raw = dict(raw or {})
        unknown = set(raw) - SAMPLING_KEYS
        if unknown:
            raise ValueError(f"unknown sampling_params {sorted(unknown)}; supported: {sorted(SAMPLING_KEYS)}")
        for key, neutral in _NEUTRAL.items():
            if key in raw and raw.pop(key) not in (neutral, None):
                raise ValueError(
                    f"sampling_params.{key} is not supported by the embedded engine "
                    f"(only {neutral!r}); remove it or use an SGLang server"
                )
        raw.pop("spaces_between_special_tokens", None)
        stop = raw.pop("stop", None) or []
        raw["stop"] = [stop] if isinstance(stop, str) else stop
        raw["stop_token_ids"] = raw.get("stop_token_ids") or []
        params = cls(**{k: v for k, v in raw.items() if v is not None})
        params.check()
        return params

    def check(self) -> None:
        def is_int(value) -> bool:  # JSON true/false are not numbers here
            return isinstance(value, int) and not isinstance(value, bool)

        def is_number(value) -> bool:
            return (is_int(value) or isinstance(value, float)) and math.isfinite(value)

        if not is_int(self.max_new_tokens) or not 0 <= self.max_new_tokens <= MAX_INT32:
            raise ValueError(
                f"sampling_params.max_new_tokens must be an integer in 0..{MAX_INT32}, "
                f"got {self.max_new_tokens!r}"
            )
        if not is_number(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"sampling_params.temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling_params.top_p must be a number in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k == 0 or not -1 <= self.top_k <= MAX_INT32:
            raise ValueError(
                f"sampling_params.top_k must be -1 (disabled) or an integer in 1..{MAX_INT32}, "
                f"got {self.top_k!r}"
            )
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(
                f"sampling_params.stop must be a string or a list of non-empty strings, got {self.stop!r}"
            )
        if not all(_is_text(s) for s in self.stop):
            raise ValueError(
                "sampling_params.stop holds a string that is not valid Unicode (a lone surrogate)"
            )
        if not isinstance(self.stop_token_ids, list) or not all(
            is_int(t) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids
        ):
            raise ValueError(
                f"sampling_params.stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}"
            )
        for key in ("stop", "stop_token_ids"):
            if len(getattr(self, key)) > MAX_STOPS:
                raise ValueError(
                    f"sampling_params.{key} has {len(getattr(self, key))} entries; at most {MAX_STOPS}"
                )
        for key in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"sampling_params.{key} must be true or false, got {getattr(self, key)!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # a request is itself: identity, not field-by-field equality (list.remove etc.)
class Sequence:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    max_total_len: int  # prompt + output may not exceed the context
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_weight_versions: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # tokens whose K/V sit in the cache
    status: Status = Status.WAITING
    finish_reason: dict | None = None
    num_retractions: int = 0
    extra: dict = field(default_factory=dict)  # request metadata echoed back (e.g. task_name)
    num_pending: int = 0  # sampled on the GPU, not yet appended (see the module doc)
    chunk_end: int | None = None  # the scheduled step stops at this token, short of `num_tokens`
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks (prefix reuse)
    num_registered_blocks: int = 0  # leading blocks of the table the prefix cache has seen (prefix reuse)
    kv_epoch: int = 0  # the prefix cache's epoch of the oldest K/V in its table (engine/prefix_cache.py)
    # speculative decoding (engine/speculative.py): the draft the scheduled decode step verifies after the
    # last token (its K/V is provisional: the engine keeps only the accepted part), and the n-gram index
    draft_ids: list[int] = field(default_factory=list)
    ngram_index: NgramIndex | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def step_end(self) -> int:
        """The end of the tokens the scheduled step forwards: its chunk's end, else all the tokens."""
        return self.num_tokens if self.chunk_end is None else self.chunk_end

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def can_grow(self) -> bool:
        """False once the pending token is the last one the request may have (length or context)."""
        return (
            len(self.output_ids) + self.num_pending < self.params.max_new_tokens
            and self.num_tokens < self.max_total_len
        )

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def append(self, token_id: int, logprob: float, weight_version: int) -> None:
        self.output_ids.append(token_id)
        self.output_logprobs.append(logprob)
        self.output_weight_versions.append(weight_version)
