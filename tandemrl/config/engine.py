"""The embedded engine's configuration, owned here and nowhere else: config/ holds it (pure Python) so
the schema and the engine (engine/engine.py, engine/server.py) import it from below both.

`EngineOptions` are the engine's own settings. They go whole from YAML to the engine under one name
each: `rollout.engine.<name>` in the config = `tandem serve-engine --<name>` (underscores as dashes,
flags generated from the fields by `add_engine_flags`) = `EngineConfig.<name>`. `EngineConfig` adds what
the run decides: the weights, device, dtype, the request and context limits (`rollout.*`, shared with
SGLang servers) and the seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from dataclasses import dataclass

from tandemrl.config.errors import ConfigError

MAX_PREFIX_CACHE_AGE = 8  # weight versions: older K/V than that is a different policy's
# prefix_cache_max_age where nothing derived it (a `serve-engine` started by hand); a run derives 0 or 1
DEFAULT_PREFIX_CACHE_AGE = 1
MAX_PREFILL_DELAY_STEPS = 256  # a few hundred ms of decode steps at most: a held request must not starve
SPECULATIVE_MODES = ("none", "ngram")
MAX_SPEC_DRAFT_TOKENS = 16  # a verify row forwards 1 + this; longer drafts are rarely accepted whole
MAX_SPEC_NGRAM = 8
# tokens per KV-cache block: vLLM takes at most 256, the paged kernels index a block's slots in one tile
MAX_BLOCK_SIZE = 1024


# RoPE scalings whose `factor` stretches the trained positions (vLLM derives its max_model_len the same way);
# llama3 and longrope configs already give the stretched length in max_position_embeddings
_STRETCHING_ROPE_TYPES = ("linear", "dynamic", "yarn")


def model_context_limit(hf_config: dict) -> int | None:
    """The longest context a Hugging Face model config allows: `max_position_embeddings` (a multimodal
    config's `text_config` holds it), times the RoPE scaling's `factor` for a scaling that stretches positions
    (`rope_parameters` in transformers 5, `rope_scaling` before). None: the config names no limit."""
    text = hf_config.get("text_config") if isinstance(hf_config.get("text_config"), dict) else hf_config
    limit = text.get("max_position_embeddings")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        return None
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    factor = rope.get("factor") if isinstance(rope, dict) else None
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type in _STRETCHING_ROPE_TYPES and isinstance(factor, (int, float)) and math.isfinite(factor):
        original = rope.get("original_max_position_embeddings")
        base = original if isinstance(original, int) and original > 0 else limit
        limit = max(limit, int(base * factor))
    return limit


@dataclass(kw_only=True)
class EngineOptions:
    kv_cache_gb: float | None = None  # None: sized from max_running_requests x max_context_len, capped
    block_size: int = 16  # tokens per KV-cache block
    # prompt tokens one prefill step forwards; a longer prompt is prefilled in chunks that alternate with
    # decode steps (SGLang's --chunked-prefill-size)
    max_prefill_tokens: int = 8192
    # decode steps a request waiting for admission may be held so one prefill step takes more of them
    # (engine/scheduler.py); 0: a waiting request is prefilled at the next step
    prefill_delay_steps: int = 0
    enable_prefix_caching: bool = True  # reuse the KV of a resent context (the agent loop resends each turn)
    # weight updates a cached prefix's K/V may serve across (engine/prefix_cache.py): 1 reuses the previous
    # weights' K/V, the approximation in_place pausing makes for running requests; 0 drops it at each update.
    # None: derived (config/derive.py): 1 for the async runner, 0 where nothing is in flight at an update (the
    # sync runner, async at max_head_offpolicyness 0), so those rollouts stay exactly on-policy
    prefix_cache_max_age: int | None = None
    enable_cuda_graphs: bool = True  # CUDA bf16/fp16 only; CPU and fp32 use the reference path
    # prefill steps replay CUDA graphs too, one per token bucket up to 8,192 tokens (engine/prefill_graphs.py);
    # needs enable_cuda_graphs. An eager prefill step is bound by the host's kernel launches at small sizes
    prefill_cuda_graphs: bool = True
    overlap_steps: bool | None = None  # schedule step n+1 while step n runs; None: where the runner gains
    # speculative decoding (engine/speculative.py): ngram drafts up to `spec_num_draft_tokens` tokens by
    # prompt lookup (the last spec_ngram_max..spec_ngram_min tokens matched earlier in the request's own
    # context) and one forward verifies them, with exact sampling; steps do not overlap (docs/DESIGN.md,
    # Speculative decoding, Fast paths)
    speculative: str = "none"
    spec_num_draft_tokens: int = 4
    spec_ngram_min: int = 1
    spec_ngram_max: int = 3

    def __post_init__(self):
        for name in ("kv_cache_gb", "block_size", "max_prefill_tokens"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):  # NaN compares False
                raise ConfigError(
                    f"rollout.engine.{name}={value!r}: must be a finite number > 0. Set a positive number"
                    + (
                        " (max_prefill_tokens: prompt tokens one prefill step forwards)."
                        if "prefill" in name
                        else "."
                    )
                )
        if not self.block_size <= MAX_BLOCK_SIZE:
            raise ConfigError(
                f"rollout.engine.block_size={self.block_size!r}: must be at most {MAX_BLOCK_SIZE} (tokens per "
                "KV-cache block; the cache holds at least two blocks, so a huge block allocates its whole size). "
                "Use 16."
            )
        if not 0 <= self.prefill_delay_steps <= MAX_PREFILL_DELAY_STEPS:
            raise ConfigError(
                f"rollout.engine.prefill_delay_steps={self.prefill_delay_steps!r}: must be within 0-"
                f"{MAX_PREFILL_DELAY_STEPS} (decode steps a waiting request may be held before its prefill; "
                "0 prefills it at the next step)."
            )
        if (
            self.prefix_cache_max_age is not None
            and not 0 <= self.prefix_cache_max_age <= MAX_PREFIX_CACHE_AGE
        ):
            raise ConfigError(
                f"rollout.engine.prefix_cache_max_age={self.prefix_cache_max_age!r}: must be within 0-"
                f"{MAX_PREFIX_CACHE_AGE} (weight updates a cached prefix may serve across; 0 drops the cache "
                "at every update)."
            )
        self._check_speculative()

    def _check_speculative(self) -> None:
        if self.speculative not in SPECULATIVE_MODES:
            raise ConfigError(
                f"rollout.engine.speculative={self.speculative!r}: must be one of {', '.join(SPECULATIVE_MODES)}."
            )
        if not 1 <= self.spec_num_draft_tokens <= MAX_SPEC_DRAFT_TOKENS:
            raise ConfigError(
                f"rollout.engine.spec_num_draft_tokens={self.spec_num_draft_tokens!r}: must be within 1-"
                f"{MAX_SPEC_DRAFT_TOKENS} (draft tokens one verify step checks per request)."
            )
        if not 1 <= self.spec_ngram_min <= self.spec_ngram_max <= MAX_SPEC_NGRAM:
            raise ConfigError(
                f"rollout.engine.spec_ngram_min={self.spec_ngram_min!r}, "
                f"rollout.engine.spec_ngram_max={self.spec_ngram_max!r}: "
                f"need 1 <= spec_ngram_min <= spec_ngram_max <= {MAX_SPEC_NGRAM} (n-gram sizes the draft looks up)."
            )
        if self.speculative != "none" and self.overlap_steps:
            raise ConfigError(
                f"rollout.engine.overlap_steps=true with rollout.engine.speculative={self.speculative}: a verify "
                "step's tokens decide the next step's inputs, so it cannot overlap; set overlap_steps to null."
            )


@dataclass
class EngineConfig(EngineOptions):
    model_path: str
    device: str = "cpu"
    dtype: str = "float32"
    max_running_requests: int = 64
    max_context_len: int = 4096
    seed: int = 0
    # Move every object alive once the engine is built to the GC's permanent generation (`gc.freeze`, as
    # vLLM's and SGLang's servers do): a full collection would otherwise walk the model's, torch's and
    # transformers' objects, stalling the step loop (and the GPU behind it) for up to hundreds of ms.
    # For a process that serves one engine (`tandem serve-engine`, the benchmark); frozen objects that
    # later become cyclic garbage are never collected.
    freeze_gc: bool = False


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(EngineOptions))


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One `serve-engine` flag per `EngineOptions` field, same name, same default."""
    hints = typing.get_type_hints(EngineOptions)
    for field in dataclasses.fields(EngineOptions):
        hint = hints[field.name]
        kind = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        if kind is bool:
            parser.add_argument(
                flag(field.name), action=argparse.BooleanOptionalAction, default=field.default
            )
        else:
            parser.add_argument(flag(field.name), type=kind, default=field.default)


def options_from_args(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in OPTION_NAMES}


def engine_flags(options: EngineOptions) -> list[str]:
    """The `serve-engine` flags that reproduce `options` (unset optional values are left out)."""
    args: list[str] = []
    for name in OPTION_NAMES:
        value = getattr(options, name)
        if value is None:
            continue
        if isinstance(value, bool):
            args.append(flag(name) if value else "--no-" + flag(name)[2:])
        else:
            args += [flag(name), str(value)]
    return args
