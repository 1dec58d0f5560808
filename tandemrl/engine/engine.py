"""The engine: `step()` = schedule -> launch -> postprocess, plus aborts, retraction and weight loading.

Single-threaded by design: the HTTP server drives it from one loop thread (`loop.py`), so weight updates
and pauses always fall between two steps. On CUDA the runner's `launch` returns while the GPU works, and
`step()` postprocesses the *previous* step meanwhile (one step in flight, as SGLang's overlap scheduler):
a request that stops at step n was already scheduled in step n+1, whose token for it is dropped. Every
operation that is not a step (abort, retract, weight load, flush) first drains the step in flight.
A prefill step may forward only a chunk of a long request (see `scheduler.py`): that row samples
nothing, so it gets no pending token and its postprocessed token is discarded. With speculative decoding
(`rollout.engine.speculative`) a decode step verifies each request's n-gram draft (`speculative.py`) and
appends every token it emits, up to a stop; the step does not overlap (on CUDA a verify step is one eager
Triton forward, `FastModelRunner.launch_verify`).
Invariant: every added request is returned by `step()` or `abort*()` exactly once, with its finish reason
(requests finished while draining come out of the next `step()` or `take_finished()`); the weight version
stamped on a token is the version of the weights that produced its logits.
"""

from __future__ import annotations

import gc
import json
import logging
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tandemrl.config.engine import DEFAULT_PREFIX_CACHE_AGE, EngineConfig, model_context_limit
from tandemrl.engine.fast_model_runner import build_runner
from tandemrl.engine.kv_cache import BlockManager, kv_bytes_per_token
from tandemrl.engine.model import load_model
from tandemrl.engine.model_runner import StepResult
from tandemrl.engine.prefix_cache import PrefixCachingBlockManager, PrefixCachingScheduler
from tandemrl.engine.scheduler import Scheduler
from tandemrl.engine.sequence import SamplingParams, Sequence, Status
from tandemrl.engine.speculative import NgramDrafter
from tandemrl.engine.stops import StopChecker
from tandemrl.host.devices import resolve_device, resolve_dtype
from tandemrl.host.startup import mark

MAX_WEIGHT_VERSION = 2**31 - 1  # one version per training step: no run gets near it

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_GB = 1.0
_CUDA_DEFAULT_KV_FRACTION = 0.4  # of free memory: the actor may share the GPU


@dataclass
class _Launched:
    """A step handed to the runner, waiting to be postprocessed."""

    seqs: list[Sequence]
    samples: list[bool]  # per row: False for a prefill chunk, whose row's token is not a sample
    result: StepResult
    weight_version: int
    is_decode: bool = False
    is_verify: bool = False  # speculative decode step: each row's result is a list of emitted tokens


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved, getattr(torch, dtype)


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device, self.dtype = resolve_device_dtype(config.device, config.dtype)
        self.model, self.hf_config = load_model(config.model_path, self.device, self.dtype)
        limit = model_context_limit(self.hf_config.to_dict())
        if limit is not None and config.max_context_len > limit:  # config/derive.py checks it before a run
            raise ValueError(
                f"max_context_len {config.max_context_len:,} is longer than the {limit:,} tokens "
                f"{config.model_path} allows (max_position_embeddings, with any RoPE scaling)"
            )
        mark("engine: model loaded")
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        mark("engine: tokenizer loaded")
        self.stops = StopChecker(self.tokenizer, _eos_ids(config.model_path, self.hf_config, self.tokenizer))
        num_blocks = self._num_blocks()
        self.drafter = (
            NgramDrafter(config.spec_num_draft_tokens, config.spec_ngram_min, config.spec_ngram_max)
            if config.speculative == "ngram"
            else None
        )
        scheduler_args = (config.max_running_requests, config.max_prefill_tokens, config.prefill_delay_steps)
        if config.enable_prefix_caching:
            max_age = config.prefix_cache_max_age
            self.blocks = PrefixCachingBlockManager(
                num_blocks, config.block_size, DEFAULT_PREFIX_CACHE_AGE if max_age is None else max_age
            )
            self.scheduler = PrefixCachingScheduler(self.blocks, *scheduler_args, self.drafter)
        else:
            self.blocks = BlockManager(num_blocks, config.block_size)
            self.scheduler = Scheduler(self.blocks, *scheduler_args, self.drafter)
        self.runner = build_runner(self.model, num_blocks, config, self.device, self.dtype)
        # a verify step's tokens are the next step's inputs, so a speculating engine never overlaps steps
        # (config/engine.py refuses overlap_steps=true with it)
        overlaps = self.runner.overlaps if config.overlap_steps is None else config.overlap_steps
        self.overlaps = overlaps and self.drafter is None
        self.weight_version = 0
        self.is_version_set_by_update = False  # whether a call carrying this version loaded it
        self.is_version_order_restarted = False  # a new trainer joined: its first version may be any
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.num_steps = 0
        self.num_prefill_steps = 0
        self.num_decode_rows = 0  # rows over all decode steps: / (num_steps - num_prefill_steps) = the batch
        self.num_decode_emitted_tokens = 0  # tokens decode rows appended: > num_decode_rows by speculation
        self.num_spec_draft_tokens = 0  # draft tokens verified
        self.num_spec_accepted_tokens = 0  # of those, accepted
        self.last_step_kind = ""  # "prefill" | "decode" | "": the kind of the step launched last
        self.num_requests_added = 0
        self.num_requests_finished = 0
        self.requests: dict[str, Sequence] = {}
        self.in_flight: _Launched | None = None
        self.finished: list[Sequence] = []  # finished while draining, not yet returned
        if config.freeze_gc:
            gc.collect()
            gc.freeze()
        mark("engine ready")
        logger.info(
            "engine ready: %s on %s/%s, %d KV blocks of %d tokens",
            config.model_path,
            self.device,
            self.dtype,
            num_blocks,
            config.block_size,
        )

    def _num_blocks(self) -> int:
        cfg = self.config
        per_block = kv_bytes_per_token(self.model.cfg, self.dtype) * cfg.block_size
        min_blocks = -(-cfg.max_context_len // cfg.block_size) + 1  # one full-context request must fit
        want = -(-cfg.max_running_requests * cfg.max_context_len // cfg.block_size)
        if cfg.kv_cache_gb is not None:
            budget = cfg.kv_cache_gb * 2**30
        elif self.device.type == "cuda":
            budget = torch.cuda.mem_get_info(self.device)[0] * _CUDA_DEFAULT_KV_FRACTION
        else:
            budget = _CPU_DEFAULT_KV_GB * 2**30
        return max(min_blocks, min(want, int(budget // per_block)))

    # ---- requests -------------------------------------------------------------------------------------

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request the engine cannot serve (the server answers 400)."""
        vocab = self.model.cfg["vocab_size"]
        if not prompt_ids:
            raise ValueError("input_ids is empty; send at least one token")
        # Two C passes over the tokens (it runs on the loop thread for every request, before the GPU starts):
        # array("I") takes only integers in [0, 2**32), numpy finds the largest.
        try:
            ids = array("I", prompt_ids)
        except (TypeError, OverflowError):
            ids = None
        if ids is None or int(np.frombuffer(ids, dtype=np.uintc).max()) >= vocab:
            raise ValueError(f"input_ids must be token ids in [0, {vocab})")
        if any(token_id >= vocab for token_id in params.stop_token_ids):
            raise ValueError(
                f"sampling_params.stop_token_ids must be token ids in [0, {vocab}), got "
                f"{[t for t in params.stop_token_ids if t >= vocab][:3]} (the model never samples them)"
            )
        if len(prompt_ids) >= self.config.max_context_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens but the context is "
                f"{self.config.max_context_len} (max_context_len); shorten the prompt or raise "
                "rollout.max_context_len"
            )

    def add_request(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, extra: dict | None = None
    ) -> Sequence:
        self.validate(prompt_ids, params)
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in flight; request ids must be unique")
        seq = Sequence(
            rid=rid,
            prompt_ids=list(prompt_ids),
            params=params,
            max_total_len=self.config.max_context_len,
            extra=dict(extra or {}),
        )
        self.requests[rid] = seq
        self.scheduler.add(seq)
        self.num_requests_added += 1
        return seq

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None or bool(self.finished)

    def step(self) -> list[Sequence]:
        """Launch a scheduling step, postprocess the one before it; returns the requests that finished."""
        finished, self.finished = self.finished, []
        finished += self._finish_empty_requests()
        seqs, is_prefill = self.scheduler.schedule_step()
        launched = None
        if seqs:
            num_new = sum(s.step_end - s.num_cached_tokens + len(s.draft_ids) for s in seqs)
            samples = [s.chunk_end is None for s in seqs]
            is_verify = self.drafter is not None and not is_prefill
            result = self.runner.launch_verify(seqs) if is_verify else self.runner.launch(seqs)
            launched = _Launched(seqs, samples, result, self.weight_version, not is_prefill, is_verify)
            for seq, sampled in zip(seqs, samples, strict=True):
                seq.chunk_end = None
                if sampled:
                    seq.num_pending += 1
            if is_prefill:
                self.num_prefill_tokens += num_new
                self.num_prefill_steps += 1
            else:
                self.num_decode_tokens += num_new
                self.num_decode_rows += len(seqs)
            self.num_steps += 1
        self.last_step_kind = ("prefill" if is_prefill else "decode") if seqs else ""
        previous, self.in_flight = self.in_flight, launched
        if previous is not None:
            finished += self._postprocess(previous)
        if not self.overlaps:
            self.drain()
            finished += self.take_finished()
        return finished

    def _postprocess(self, launched: _Launched) -> list[Sequence]:
        # Before waiting for the GPU: bookkeeping on the tokens appended so far (prefix reuse hashes the
        # blocks they filled) runs while the step computes, not after it.
        self.scheduler.after_step(launched.seqs)
        token_ids, logprobs = launched.result.get()
        if not launched.is_verify:
            token_ids, logprobs = [[t] for t in token_ids], [[lp] for lp in logprobs]
        finished = []
        rows = zip(launched.seqs, launched.samples, token_ids, logprobs, strict=True)
        for seq, sampled, row_ids, row_logprobs in rows:
            if not sampled:
                continue
            seq.num_pending -= 1
            if seq.status is Status.FINISHED:  # stopped at the step before: this token is past its end
                continue
            if launched.is_verify:
                self._count_verified(seq, len(row_ids) - 1)
            for token_id, logprob in zip(row_ids, row_logprobs, strict=True):
                seq.append(token_id, logprob, launched.weight_version)
                self.num_decode_emitted_tokens += launched.is_decode
                reason = self.stops.check(seq)
                if reason is not None:  # the tokens after a stop were never generated
                    finished.append(self._finish(seq, reason))
                    break
        return finished

    def _count_verified(self, seq: Sequence, num_accepted: int) -> None:
        self.num_spec_draft_tokens += len(seq.draft_ids)
        self.num_spec_accepted_tokens += num_accepted
        self.scheduler.after_verify(seq, num_accepted)

    def drain(self) -> None:
        """Postprocess the step in flight (its finished requests wait in `take_finished()`)."""
        if self.in_flight is not None:
            launched, self.in_flight = self.in_flight, None
            self.finished += self._postprocess(launched)

    def take_finished(self) -> list[Sequence]:
        finished, self.finished = self.finished, []
        return finished

    def _finish_empty_requests(self) -> list[Sequence]:
        """max_new_tokens = 0: answer with no output and no forward pass, as SGLang does."""
        empty = [s for s in self.scheduler.waiting if s.params.max_new_tokens == 0 and not s.output_ids]
        return [self._finish(s, {"type": "length", "length": 0}) for s in empty]

    def _finish(self, seq: Sequence, reason: dict) -> Sequence:
        self.scheduler.finish(seq, reason)
        del self.requests[seq.rid]
        self.num_requests_finished += 1
        return seq

    def abort(self, rid: str, message: str = "aborted by request") -> Sequence | None:
        self.drain()
        seq = self.requests.get(rid)
        if seq is None or seq.status is Status.FINISHED:
            return None
        return self._finish(seq, {"type": "abort", "message": message})

    def abort_all(self, message: str) -> list[Sequence]:
        self.drain()
        return [self._finish(s, {"type": "abort", "message": message}) for s in list(self.requests.values())]

    def retract_all(self) -> int:
        self.drain()
        return self.scheduler.retract_all()

    # ---- weights --------------------------------------------------------------------------------------

    def load_weights(self, named_tensors, weight_version: int | None = None) -> int:
        """Copy HF-named tensors into the model; bumps (or sets) the weight version. Between steps only."""
        self.check_weight_version(weight_version)
        self.drain()
        names = self.model.load_weights(named_tensors)
        old_version = self.weight_version
        self.weight_version = self.weight_version + 1 if weight_version is None else int(weight_version)
        if isinstance(self.blocks, PrefixCachingBlockManager) and self.weight_version != old_version:
            # cached K/V ages by one version (a push's later buckets repeat it); a version that goes back
            # (a trainer resumed from an older checkpoint) leaves nothing of the cache. Running requests
            # keep their K/V, and cache what they fill next with their table's epoch while it is young enough
            went_back = self.weight_version < old_version
            self.blocks.next_epoch(self.blocks.max_age + 1 if went_back else 1)
        self.is_version_set_by_update = weight_version is not None
        self.is_version_order_restarted = False
        logger.info("loaded %d tensors, weight_version=%d", len(names), self.weight_version)
        return self.weight_version

    def check_weight_version(self, weight_version: int | None) -> None:
        """A version only moves forward: it must exceed the current one, except that the buckets of one
        push repeat the version the first bucket set (a bare version-less call bumps by one), and that
        the first update after `restart_version_order` (a trainer joined anew, e.g. resumed from an
        older checkpoint) may carry any version >= 0."""
        if weight_version is None:
            return
        if weight_version > MAX_WEIGHT_VERSION:
            raise ValueError(
                f"weight_version={weight_version} is above {MAX_WEIGHT_VERSION}: no run makes that many "
                "versions, and every later update would be refused. No weight was changed."
            )
        is_repeat = weight_version == self.weight_version and self.is_version_set_by_update
        is_fresh = self.is_version_order_restarted and weight_version >= 0
        if weight_version < 0 or (weight_version <= self.weight_version and not (is_repeat or is_fresh)):
            raise ValueError(
                f"weight_version={weight_version} is not larger than the current weight_version "
                f"{self.weight_version}; versions only move forward. No weight was changed."
            )

    def restart_version_order(self) -> None:
        """A trainer joined a new weight-update group: it owns the version sequence from now on."""
        self.is_version_order_restarted = True

    def flush_cache(self) -> bool:
        """Drop cached KV; refused (False) while requests hold blocks, as SGLang refuses it then."""
        self.drain()
        if self.scheduler.running:
            return False
        self.blocks.reset()
        return True

    def stats(self) -> dict:
        return dict(
            num_prefill_tokens=self.num_prefill_tokens,
            num_decode_tokens=self.num_decode_tokens,
            num_steps=self.num_steps,
            num_prefill_steps=self.num_prefill_steps,
            num_decode_rows=self.num_decode_rows,
            num_decode_emitted_tokens=self.num_decode_emitted_tokens,
            num_spec_draft_tokens=self.num_spec_draft_tokens,
            num_spec_accepted_tokens=self.num_spec_accepted_tokens,
            num_prefix_hit_tokens=getattr(self.scheduler, "num_prefix_hit_tokens", 0),
            num_stale_prefix_hit_tokens=getattr(self.blocks, "num_stale_hit_tokens", 0),
            num_prefill_graph_steps=getattr(getattr(self.runner, "prefill_graphs", None), "num_replays", 0),
            num_requests_added=self.num_requests_added,
            num_requests_finished=self.num_requests_finished,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            num_free_blocks=self.blocks.num_free_blocks,
            num_blocks=self.blocks.num_blocks,
            weight_version=self.weight_version,
        )


def _eos_ids(model_path: str, hf_config, tokenizer) -> set[int]:
    """End-of-sequence ids from generation_config.json, config.json and the tokenizer, as HF/SGLang stop."""
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    gen_config = Path(model_path) / "generation_config.json"
    if gen_config.exists():
        sources.append(json.loads(gen_config.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return ids
