"""A FAKE SGLang server, run as its own process by tests/integration/test_sglang_conformance.py. It
stands in for `python -m sglang.launch_server` (sglang 0.5.15) at the process boundary: no model runs
behind it. Its rules are SGLang's, read in the sglang 0.5.15 wheel (the pin of the `sglang` extra) and in
sgl-project/sglang on GitHub (python/sglang/srt/managers/io_struct.py @ 001067fffe33427bee0ed2f007fb7551a1d76b44,
python/sglang/srt/managers/scheduler_update_weights_mixin.py @ 018c9109680f6f5b0654114b9159101256e1e18b):

- Bodies: only the fields of SGLang's request structs (managers/io_struct.py: GenerateReqInput,
  PauseGenerationReqInput, ContinueGenerationReqInput, AbortReq, InitWeightsUpdateGroupReqInput,
  UpdateWeightsFromDistributedReqInput, UpdateWeightsFromTensorReqInput, UpdateWeightFromDiskReqInput,
  DestroyWeightsUpdateGroupReqInput, FlushCacheReqInput; plus BaseReq's rid and http_worker_ipc), and
  sampling_params only SamplingParams' keys (sampling/sampling_params.py), and the control requests'
  fields of their struct's types (`FIELD_TYPES`: a weight version is a string); anything else is a 400.
- Tensor parallelism (`--tp-size N`): every TP rank is a process of its own, as SGLang's schedulers
  are. Each joins the weight group at `rank_offset + tp_rank` (model_executor/model_runner.py,
  init_weights_update_group) in a group of the `world_size` given, exactly as SGLang's
  `init_custom_process_group` joins (tcp rendezvous, the bare group name as store prefix, torch's group
  helper); each receives every broadcast tensor; and for update_weights_from_tensor rank r opens
  `serialized_named_tensors[r]` (managers/tp_worker.py), so fewer entries than ranks fail. Each entry
  is opened by SGLang's `SafeUnpickler` (utils/common.py), which loads a global only from the modules it
  allows (torch, Python's own, multiprocessing's reductions, ...): the fake reads the entry's globals
  without loading it and, as the scheduler's exception would, crashes on one outside them (`refused_globals`).
- Pause modes (managers/tokenizer_manager.py, managers/scheduler.py pause_generation): every mode holds
  new requests at the tokenizer until continue (`is_pause_cond`). `abort` aborts every request and
  returns once none is left, looking again each second (it polls `model_update_lock`, which every
  request holds while it lives: so it takes a second or more whenever a request was running); the
  scheduler itself is not paused. `retract` moves running requests to the waiting queue, where they
  re-prefill on continue; `in_place` freezes them with their KV.
- Lengths (tokenizer_manager.py `_validate_one_request`, with `--context-length N`): an input of N tokens
  or more, or one whose `max_new_tokens` would pass N, is refused (a stream's one chunk is the error).
- Aborts (managers/tokenizer_manager.py `abort_request`): a rid aborts only while a request with exactly
  that rid lives, and then every live request whose rid starts with it. Every streamed /generate response
  aborts its own rid 2 s after its stream ended (`create_abort_task`), so a request sent again under the
  same rid within those 2 s is aborted.
- The cache: prefixes stay cached under the weight version that computed them, until a flush. A
  prefill that reuses a prefix cached under another version counts as a stale prefill (/fake/state).
  `/flush_cache` succeeds only with no request queued or running, else 400 (Scheduler.flush_cache,
  is_fully_idle); an update sent with `flush_cache: true` while a request is queued or running fails
  SGLang's assert ("Cache flush failed after updating weights") and kills the scheduler: the fake
  answers 500 and reports `crashed` from then on.
- /health is SGLang's `health_generate` (entrypoints/http_server.py): 503 while the server is starting
  (until its warm-up request is done), then a one-token generation with input_ids [0] through the
  scheduler, answered no sooner than a second (it sleeps 1 s before it looks), 200 once the scheduler has
  put out anything since the probe began, else 503 after SGLANG_HEALTH_CHECK_TIMEOUT (20 s), as while the
  scheduler is paused; the probe's request stays queued meanwhile, so a flush then is refused.
  SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false makes /health a plain 200 once started, as in SGLang.
- /get_weight_version answers 404 (0.5.15: "use /model_info"); /model_info and /server_info have
  0.5.15's shapes (server_info: the server args, `tp_size` among them); their old names /get_model_info
  and /get_server_info answer too, each call logging SGLang's deprecation warning (`deprecated_calls`).
- The command line is `sglang.launch_server`'s for the flags tandem sends (rollout/sglang_process.py),
  any other flag is an error as in SGLang's argparse; `--config FILE` is merged as SGLang's
  ConfigArgumentMerger does (server_args_config_parser.py: YAML only, a mapping whose keys become flags,
  the command line's own flags win). With `--api-key` every request but OPTIONS and the paths under
  /health and /metrics needs `Authorization: Bearer <key>` (scheme in any case), else 401
  {"error": "Unauthorized"} (utils/auth.py `decide_request_auth`: tandem's endpoints are NORMAL or
  ADMIN_OPTIONAL, and without --admin-api-key both take the api key). `python -m tests.fake_sglang`
  takes that command line; tests/integration/test_sglang_launched.py puts a `sglang.launch_server`
  module that runs it on the server's PYTHONPATH, so `tandem train` launches the fake through Ray.
- It logs each control call it answers (pause mode, continue, weight update and its version, flush) to
  stdout, one line each, which a launched server's log under the run's output dir keeps.

Generation is a deterministic stand-in: token i of a request is (sum(prompt) + 7 i) % 1000 with logprob
-0.5, one token every TOKEN_S seconds; a streamed chunk holds every token so far (SGLang's default), or
only its new ones with `--incremental-streaming-output` (which tandem sends), completion_tokens counting
all either way. With
`--speculative-num-draft-tokens N` (SGLang's flag: N - 1 draft tokens a verify step) a finished request's
meta_info carries 0.5.15's speculation counts (tokenizer_manager.py `_calculate_spec_decoding_metrics`:
only once it finished, aborts included, and only when it verified at least once), as if its first token
came from the prefill and every verify step accepted one draft token (`spec_counts`). GET /fake/state
(fake-only) reports what it saw.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import hmac
import json
import multiprocessing
import os
import pickletools
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from aiohttp import web

TOKEN_S = 0.03
STREAM_ABORT_S = 2.0  # create_abort_task's sleep
WARMUP_S = 0.3  # the fake's warm-up request: /health answers 503 until it is done (ServerStatus.Starting)
HEALTH_CHECK_TIMEOUT_S = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))
BASE = {"rid", "http_worker_ipc"}
FIELDS = {
    "/generate": BASE
    | {"session_id", "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data"}
    | {"mm_hashes", "use_audio_in_video", "sampling_params", "return_logprob", "logprob_start_len"}
    | {"top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "stream", "log_metrics"}
    | {"return_hidden_states", "return_routed_experts", "routed_experts_start_len", "return_indexer_topk"}
    | {"modalities", "session_params", "lora_path", "lora_id", "custom_logit_processor"}
    | {"positional_embed_overrides", "bootstrap_host", "bootstrap_port", "bootstrap_room"}
    | {"bootstrap_pair_key", "decode_tp_size", "routed_dp_rank", "disagg_prefill_dp_rank", "routing_key"}
    | {"conversation_id", "background", "require_reasoning", "priority", "extra_key", "no_logs"}
    | {"custom_labels", "return_bytes", "return_entropy", "return_prompt_token_ids"}
    | {"external_trace_header", "received_time", "need_wait_for_mm_inputs", "num_items_assigned"}
    | {"mm_data_mooncake", "encoder_urls", "max_dynamic_patch", "min_dynamic_patch"}
    | {"image_max_dynamic_patch", "video_max_dynamic_patch", "images_config", "multi_item_delimiter_indices"},
    "/pause_generation": BASE | {"mode"},
    "/continue_generation": BASE | {"torch_empty_cache"},
    "/abort_request": BASE | {"abort_all", "finished_reason", "abort_message"},
    "/flush_cache": BASE | {"timeout_s"},
    "/init_weights_update_group": BASE
    | {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"},
    "/destroy_weights_update_group": BASE | {"group_name"},
    "/update_weights_from_distributed": BASE
    | {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version"}
    | {"load_format", "torch_empty_cache"},
    "/update_weights_from_tensor": BASE
    | {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests", "weight_version"}
    | {"disable_draft_model", "torch_empty_cache"},
    "/update_weights_from_disk": BASE
    | {"model_path", "load_format", "abort_all_requests", "weight_version", "is_async", "torch_empty_cache"}
    | {"keep_pause", "recapture_cuda_graph", "token_step", "flush_cache", "manifest"},
}
REQUIRED = {
    "/init_weights_update_group": {"master_address", "master_port", "rank_offset", "world_size"},
    "/update_weights_from_distributed": {"names", "dtypes", "shapes"},
    "/update_weights_from_tensor": {"serialized_named_tensors"},
    "/update_weights_from_disk": {"model_path"},
}
# the types of the control requests' fields (io_struct.py; msgspec structs checked by pydantic, which
# turns no number into a str): "str?" may also be null, "float" takes an int too
FIELD_TYPES = {
    **dict.fromkeys(("master_address", "group_name", "backend", "model_path", "mode"), "str"),
    **dict.fromkeys(("weight_version", "load_format", "rid"), "str?"),
    **dict.fromkeys(("master_port", "rank_offset", "world_size", "token_step"), "int"),
    **dict.fromkeys(
        ("flush_cache", "abort_all_requests", "torch_empty_cache", "abort_all", "is_async"), "bool"
    ),
    **dict.fromkeys(("keep_pause", "recapture_cuda_graph", "disable_draft_model"), "bool"),
    **{"timeout_s": "float?", "names": "list[str]", "dtypes": "list[str]", "shapes": "list[list[int]]"},
}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


FIELD_TYPE_CHECKS = {
    "str": lambda v: isinstance(v, str),
    "int": _is_int,
    "float": lambda v: _is_int(v) or isinstance(v, float),
    "bool": lambda v: isinstance(v, bool),
    "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "list[list[int]]": lambda v: (
        isinstance(v, list) and all(isinstance(x, list) and all(map(_is_int, x)) for x in v)
    ),
}


def type_problem(field: str, value) -> str | None:
    """Why SGLang's schema would refuse `value` for a control request's `field`, or None."""
    kind = FIELD_TYPES.get(field)
    if kind is None or (kind.endswith("?") and value is None):
        return None
    kind = kind.rstrip("?")
    return (
        None if FIELD_TYPE_CHECKS[kind](value) else f"{field}: Input should be a valid {kind}, got {value!r}"
    )


# the struct defaults of the flags that matter here (io_struct.py): an update flushes unless told not to
FLUSH_DEFAULT = True
SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "custom_params", "stream_interval", "logit_bias", "sampling_seed",
}  # fmt: skip
PAUSE_MODES = ("abort", "retract", "in_place")
FLUSH_REFUSED = "Cache not flushed because there are pending requests."


# SGLang 0.5.15's SafeUnpickler (utils/common.py): a pickle's global loads only when "module." starts with
# one of these, and never these (module, name) pairs
SAFE_UNPICKLER_PREFIXES = (
    *("builtins.", "collections.", "copyreg.", "functools.", "itertools.", "operator.", "types.", "weakref."),
    *("torch.", "multiprocessing.resource_sharer.", "multiprocessing.reduction.", "pickletools."),
    *("peft.", "transformers.", "huggingface_hub.", "torch_npu."),
    *(
        "sglang.srt.weight_sync.tensor_bucket.",
        "sglang.srt.model_executor.model_runner.",
        "sglang.srt.layers.",
    ),
    *("sglang.srt.utils.", "sglang.srt.disaggregation.", "sglang.srt.managers."),
)
SAFE_UNPICKLER_DENIED = {
    ("builtins", "eval"),
    ("builtins", "exec"),
    ("builtins", "compile"),
    ("os", "system"),
    ("subprocess", "Popen"),
    ("subprocess", "run"),
    ("codecs", "decode"),
    ("types", "CodeType"),
    ("types", "FunctionType"),
}


def pickle_globals(raw: bytes) -> list[tuple[str, str]]:
    """The (module, name) of every global a pickle would load, read from its opcodes without loading it
    (STACK_GLOBAL takes the two strings pushed last, directly or from the memo)."""
    found, pushed, memo = [], [], {}
    for op, arg, _ in pickletools.genops(raw):
        if op.name == "GLOBAL":
            module, name = arg.split(" ", 1)
            found.append((module, name))
        elif op.name == "STACK_GLOBAL":
            found.append((str(pushed[-2]), str(pushed[-1])))
        elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            pushed.append(arg)
            continue
        elif op.name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
            continue
        elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = pushed[-1] if pushed else None
            continue
        elif op.name in ("GET", "BINGET", "LONG_BINGET"):
            pushed.append(memo.get(arg))
            continue
        pushed.append(None)  # anything else pushed or popped: no longer a string pair for STACK_GLOBAL
    return found


def refused_globals(raw: bytes) -> list[str]:
    """The globals of a pickle that SGLang's SafeUnpickler would refuse to load."""
    return [
        f"{module}.{name}"
        for module, name in pickle_globals(raw)
        if (module, name) in SAFE_UNPICKLER_DENIED
        or not any(f"{module}.".startswith(prefix) for prefix in SAFE_UNPICKLER_PREFIXES)
    ]


def error(message: str, status: int = 400) -> web.Response:
    """SGLang's ErrorResponse body (its validation handler answers 400)."""
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": status}
    return web.json_response(body, status=status)


def say(line: str) -> None:
    """One control call answered, on stdout (a launched server's log)."""
    print(f"fake SGLang: {line}", flush=True)


@dataclass
class Request:
    rid: str
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    is_retracted: bool = False  # in the waiting queue after a retract pause: re-prefills on continue
    is_aborted: bool = False


class FakeSglang:
    def __init__(
        self,
        tp_size: int = 1,
        num_draft_tokens: int = 0,
        api_key: str | None = None,
        incremental: bool = False,
        context_length: int | None = None,
    ):
        self.tp_size = tp_size
        self.context_length = context_length  # --context-length (None: no limit, the model's in SGLang)
        self.incremental = incremental  # --incremental-streaming-output: each chunk holds only its new tokens
        self.api_key = api_key  # --api-key: every path but /health* and /metrics* needs it
        self.is_up = False  # ServerStatus.Starting until the warm-up is done
        self.last_output_s = 0.0  # when the scheduler last put out a token (what /health waits for)
        self.num_health_probes = 0
        self.probes: set[asyncio.Task] = set()
        self.num_draft_tokens = num_draft_tokens  # --speculative-num-draft-tokens; 0: no speculation
        self.scheduler_paused = False  # retract / in_place: the scheduler's loop stops
        self.tokenizer_held = False  # any pause: new requests wait at the tokenizer until continue
        self.abort_epoch = 0
        self.stream_abort_tasks: set[asyncio.Task] = set()
        self.weight_version = "default"
        self.active: dict[str, Request] = {}  # queued or running in the scheduler
        self.cache: dict[tuple[int, ...], str] = {}  # cached prefix -> the weight version that made it
        self.stale_prefills: list[str] = []
        self.num_flushes = 0
        self.crash = ""  # what killed the scheduler ("": it lives)
        self.deprecated_calls: list[str] = []  # /get_model_info, /get_server_info: SGLang warns each time
        self.received: dict[str, float] = {}
        self.rank_received: list[dict[str, float]] = [{} for _ in range(tp_size)]
        self.ranks: list[dict] = []
        self.tensor_entries_read: list[list[int]] = []
        self.update_flush_flags: list[bool] = []
        self.paths: list[str] = []
        self.tokens_at_pause: dict[str, int] = {}
        self.progress: dict[str, int] = {}
        context = multiprocessing.get_context("spawn")
        self.workers = []
        for tp_rank in range(tp_size):
            parent, child = context.Pipe()
            process = context.Process(target=tp_worker, args=(tp_rank, child), daemon=True)
            process.start()
            self.workers.append(parent)

    async def body(self, request: web.Request) -> dict:
        body = await request.json() if request.can_read_body else {}
        path = request.path
        unknown = set(body) - FIELDS[path]
        if unknown:
            raise ValueError(f"{path}: fields {sorted(unknown)} are not in SGLang's request dataclass")
        missing = REQUIRED.get(path, set()) - set(body)
        if missing:
            raise ValueError(f"{path}: missing required fields {sorted(missing)}")
        if path != "/generate":
            problems = [p for p in (type_problem(k, v) for k, v in body.items()) if p]
            if problems:
                raise ValueError(f"{path}: {'; '.join(problems)}")
        return body

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.authentication, self.validation])
        post = {
            "/generate": self.generate,
            "/pause_generation": self.pause,
            "/continue_generation": self.resume,
            "/abort_request": self.abort,
            "/init_weights_update_group": self.init_group,
            "/destroy_weights_update_group": self.destroy_group,
            "/update_weights_from_distributed": self.from_distributed,
            "/update_weights_from_tensor": self.from_tensor,
            "/update_weights_from_disk": self.from_disk,
        }
        for path, handler in post.items():
            app.router.add_post(path, handler)
        app.router.add_route("*", "/flush_cache", self.flush_cache)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health)
        app.on_startup.append(self.warm_up)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_get("/model_info", self.model_info)
        app.router.add_get("/get_weight_version", self.weight_version_gone)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_get("/fake/state", self.state)
        return app

    @web.middleware
    async def authentication(self, request, handler):
        """SGLang's `decide_request_auth` with an api key and no admin key (utils/auth.py)."""
        exempt = request.method == "OPTIONS" or request.path.startswith(("/health", "/metrics", "/fake/"))
        if self.api_key is None or exempt:
            return await handler(request)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), self.api_key.encode()):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    @web.middleware
    async def validation(self, request, handler):
        if self.crash and request.path != "/fake/state":
            return error(f"the scheduler died: {self.crash}", 500)
        try:
            return await handler(request)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            return error(str(exc))

    # ---- generation --------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await self.body(request)
        ids, params = body.get("input_ids"), body.get("sampling_params") or {}
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError("input_ids must be a non-empty list of ints")
        if set(params) - SAMPLING_KEYS:
            raise TypeError(
                f"SamplingParams got unexpected keyword arguments {sorted(set(params) - SAMPLING_KEYS)}"
            )
        rid = str(body.get("rid") or f"r{id(body)}")
        if rid in self.active:
            raise ValueError(f"Duplicate request ID: {rid}")
        too_long = self.length_problem(len(ids), params.get("max_new_tokens"))
        if too_long and body.get("stream"):  # the stream's generator raises: one error chunk, then [DONE]
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            chunk = {"error": {"message": too_long, "type": "invalid_request_error", "code": 400}}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
            return resp
        if too_long:
            raise ValueError(too_long)
        while self.tokenizer_held:  # a pause holds new requests at the tokenizer
            await asyncio.sleep(0.005)
        if not body.get("stream"):
            outputs = [out async for out in self.run(rid, ids, params, bool(body.get("return_logprob")))]
            return web.json_response(outputs[-1])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        sent = 0  # tokens already streamed (incremental chunks start after them)
        async for out in self.run(rid, ids, params, bool(body.get("return_logprob"))):
            if self.incremental:
                out = delta(out, sent)
                sent += len(out["output_ids"])
            await resp.write(b"data: " + json.dumps(out).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        task = asyncio.create_task(self.abort_after_stream(rid))  # the response's background task
        self.stream_abort_tasks.add(task)
        task.add_done_callback(self.stream_abort_tasks.discard)
        return resp

    def length_problem(self, num_input: int, max_new_tokens) -> str | None:
        """TokenizerManager._validate_one_request: the input, and the input plus max_new_tokens, must fit
        the context (no --allow-auto-truncate: refused, not cut)."""
        limit = self.context_length
        if limit is None:
            return None
        if num_input >= limit:
            return (
                f"The input ({num_input} tokens) is longer than the model's context length ({limit} tokens)."
            )
        if max_new_tokens is not None and num_input + int(max_new_tokens) > limit:
            return (
                f"Requested token count exceeds the model's maximum context length of {limit} tokens. You "
                f"requested a total of {num_input + int(max_new_tokens)} tokens: {num_input} tokens from the input "
                f"messages and {max_new_tokens} tokens for the completion."
            )
        return None

    async def abort_after_stream(self, rid: str) -> None:
        """SGLang hands every streamed /generate response a background task that aborts its rid
        STREAM_ABORT_S after the stream ended (http_server.py `create_abort_task`, meant for clients that
        left): a new request that took the same rid meanwhile is aborted by it."""
        await asyncio.sleep(STREAM_ABORT_S)
        self.abort_rid(rid)

    def abort_rid(self, rid: str) -> None:
        """TokenizerManager.abort_request: nothing unless a live request has exactly this rid (one
        tokenizer worker); the scheduler then aborts every request whose rid starts with it."""
        if not rid or rid not in self.active:
            return
        for other, req in self.active.items():
            if other.startswith(rid):
                req.is_aborted = True

    def prefill(self, req: Request) -> None:
        """Reuse the longest cached prefix (counting it when another weight version computed it), then
        cache the request's tokens under the current version."""
        tokens = tuple(req.prompt + req.output)
        matches = [prefix for prefix in self.cache if tokens[: len(prefix)] == prefix]
        if matches and self.cache[max(matches, key=len)] != self.weight_version:
            self.stale_prefills.append(req.rid)
        self.cache[tokens] = self.weight_version

    async def run(self, rid: str, ids: list[int], params: dict, return_logprob: bool):
        req, epoch, limit = Request(rid, list(ids)), self.abort_epoch, int(params.get("max_new_tokens", 128))
        self.active[rid] = req
        try:
            self.prefill(req)
            while len(req.output) < limit:
                while self.scheduler_paused and self.abort_epoch == epoch:
                    await asyncio.sleep(0.005)
                if self.abort_epoch != epoch or req.is_aborted:
                    reason = {"type": "abort", "message": "Abort in waiting queue"}
                    yield self.output(req, return_logprob, reason)
                    return
                if req.is_retracted:  # back from the waiting queue: its KV was freed
                    req.is_retracted = False
                    self.prefill(req)
                await asyncio.sleep(TOKEN_S)
                if self.scheduler_paused:
                    continue
                req.output.append((sum(ids) + 7 * len(req.output)) % 1000)
                self.last_output_s = time.monotonic()
                self.progress[rid] = len(req.output)
                done = len(req.output) == limit
                yield self.output(req, return_logprob, {"type": "length", "length": limit} if done else None)
            self.cache[tuple(req.prompt + req.output)] = self.weight_version
        finally:
            self.active.pop(rid, None)

    def output(self, req: Request, return_logprob: bool, reason) -> dict:
        meta = {
            "id": req.rid,
            "finish_reason": reason,
            "prompt_tokens": len(req.prompt),
            "weight_version": self.weight_version,
            "completion_tokens": len(req.output),
            "cached_tokens": 0,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[-0.5, t, None] for t in req.output]
        if reason is not None and self.num_draft_tokens > 1:
            meta.update(spec_counts(len(req.output), self.num_draft_tokens))
        return {"text": "", "output_ids": list(req.output), "meta_info": meta}

    # ---- health ------------------------------------------------------------------------------------
    async def warm_up(self, app: web.Application) -> None:
        async def finish() -> None:
            await asyncio.sleep(WARMUP_S)
            self.is_up = True

        app["warm_up"] = asyncio.create_task(finish())

    async def health(self, request: web.Request) -> web.Response:
        if not self.is_up:
            return web.Response(status=503)
        plain = os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower() in ("0", "false")
        if plain and request.path == "/health":
            return web.Response(status=200)
        self.num_health_probes += 1
        tic = time.monotonic()
        rid = f"HEALTH_CHECK_{self.num_health_probes}"
        task = asyncio.create_task(self.probe(rid))  # it outlives the answer, as SGLang's request does
        self.probes.add(task)
        task.add_done_callback(self.probes.discard)
        while time.monotonic() < tic + HEALTH_CHECK_TIMEOUT_S:
            await asyncio.sleep(1)
            if self.last_output_s > tic:
                return web.Response(status=200)
        return web.Response(status=503)

    async def probe(self, rid: str) -> None:
        """The health check's request: input_ids [0], one greedy token, through the scheduler."""
        while self.tokenizer_held:
            await asyncio.sleep(0.005)
        async for _ in self.run(rid, [0], {"max_new_tokens": 1, "temperature": 0.0}, False):
            pass

    # ---- control -----------------------------------------------------------------------------------
    async def pause(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise ValueError(f"Invalid mode: {mode!r}. Expected one of {PAUSE_MODES}.")
        self.tokens_at_pause = dict(self.progress)
        say(f"pause_generation mode={mode}, {len(self.active)} request(s) active")
        self.tokenizer_held = True
        if mode == "abort":
            while True:  # SGLang's tokenizer aborts all, then looks each second until no request is left
                self.abort_epoch += 1
                await asyncio.sleep(0)
                if not self.active:
                    break
                await asyncio.sleep(1.0)
        else:
            self.scheduler_paused = True
            for req in self.active.values():
                req.is_retracted = req.is_retracted or mode == "retract"
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        await self.body(request)
        say("continue_generation")
        self.tokenizer_held = self.scheduler_paused = False
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        if body.get("abort_all"):
            self.abort_epoch += 1
        else:
            self.abort_rid(str(body.get("rid", "")))
        return web.Response(status=200)

    def try_flush(self) -> bool:
        if self.active:
            return False
        self.cache.clear()
        self.num_flushes += 1
        say("cache flushed")
        return True

    async def flush_cache(self, request: web.Request) -> web.Response:
        if request.method == "POST":
            await self.body(request)
        if not self.try_flush():
            return web.Response(status=400, text=FLUSH_REFUSED)
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. (When there are running or "
            "waiting requests, the operation will not be performed.)\n"
        )

    def note_deprecated(self, request: web.Request, name: str) -> None:
        """SGLang 0.5.15 logs a warning for every call to a deprecated name (http_server.py)."""
        if request.path != name:
            self.deprecated_calls.append(request.path)
            say(
                f"Endpoint '{request.path}' is deprecated and will be removed in a future version. Please use '{name}' instead."
            )

    async def model_info(self, request: web.Request) -> web.Response:
        self.note_deprecated(request, "/model_info")
        return web.json_response(
            {
                "model_path": "fake-sglang",
                "tokenizer_path": "fake-sglang",
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
            }
        )

    async def weight_version_gone(self, request: web.Request) -> web.Response:
        detail = "Endpoint '/get_weight_version' or '/weight_version' is deprecated. Please use '/model_info' instead."
        return web.json_response({"detail": detail}, status=404)

    async def server_info(self, request: web.Request) -> web.Response:
        self.note_deprecated(request, "/server_info")
        return web.json_response(
            {"model_path": "fake-sglang", "tp_size": self.tp_size, "dp_size": 1, "internal_states": [{}]}
        )

    async def state(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "received": self.received,
                "rank_received": self.rank_received,
                "ranks": self.ranks,
                "tensor_entries_read": self.tensor_entries_read,
                "update_flush_flags": self.update_flush_flags,
                "num_flushes": self.num_flushes,
                "stale_prefills": self.stale_prefills,
                "crashed": bool(self.crash),
                "deprecated_calls": self.deprecated_calls,
                "paths": self.paths,
                "weight_version": self.weight_version,
                "tokens_at_pause": self.tokens_at_pause,
                "progress": self.progress,
                "num_health_probes": self.num_health_probes,
            }
        )

    # ---- weights -----------------------------------------------------------------------------------
    async def on_workers(self, command: str, payload) -> list:
        """Run `command` on every TP rank at once (a group needs all of them); their answers in rank order."""

        def call():
            for conn in self.workers:
                conn.send((command, payload))
            return [conn.recv() for conn in self.workers]

        answers = await asyncio.to_thread(call)
        failed = [message for status, message in answers if status != "ok"]
        if failed:
            raise ValueError(f"{command} failed on a TP rank: {failed[0]}")
        return [message for _, message in answers]

    async def init_group(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        body.setdefault("group_name", "weight_update_group")
        body.setdefault("backend", "nccl")
        try:
            last = int(body["rank_offset"]) + self.tp_size - 1
            if last >= int(body["world_size"]):  # SGLang's ranks below it would wait in the rendezvous
                raise ValueError(
                    f"rank {last} (rank_offset {body['rank_offset']} + tp_rank {self.tp_size - 1}) is not in "
                    f"a world of {body['world_size']}"
                )
            self.ranks = await self.on_workers("init", body)
        except ValueError as exc:  # SGLang answers success=false with the reason
            message = f"Failed to initialize custom process group: {exc}."
            return web.json_response({"success": False, "message": message}, status=400)
        return web.json_response(
            {"success": True, "message": "Succeeded to initialize custom process group."}
        )

    async def destroy_group(self, request: web.Request) -> web.Response:
        await self.body(request)
        return web.json_response({"success": True, "message": "destroyed"})

    async def from_distributed(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        specs = list(zip(body["names"], body["dtypes"], body["shapes"], strict=True))
        per_rank = await self.on_workers("receive", {"group_name": body.get("group_name"), "specs": specs})
        for rank, received in enumerate(per_rank):
            self.rank_received[rank].update(received)
        self.received.update(per_rank[0])
        return self.updated(body, "Succeeded to update parameter online.")

    async def from_tensor(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        entries = body["serialized_named_tensors"]
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            raise ValueError("serialized_named_tensors must be a list of base64 strings")
        for entry in entries:
            raw = base64.b64decode(entry, validate=True)  # the Base64Bytes schema refuses anything else
            refused = refused_globals(raw) if raw[:1] == b"\x80" else []
            if refused:  # MultiprocessingSerializer.deserialize raises in the scheduler, which dies of it
                self.crash = (
                    f"RuntimeError: Blocked unsafe class loading ({refused[0]}), "
                    "to prevent exploitation of CVE-2025-10164"
                )
                return error(self.crash, 500)
        read = []
        for tp_rank in range(self.tp_size):  # TpModelWorker: serialized_named_tensors[self.tp_rank]
            if tp_rank >= len(entries):
                raise IndexError(
                    f"TP rank {tp_rank}: serialized_named_tensors[{tp_rank}] is out of range "
                    f"({len(entries)} entries for tp_size {self.tp_size}): list index out of range"
                )
            read.append(tp_rank)
        self.tensor_entries_read.append(read)
        return self.updated(body, "Succeeded to update model weights.")

    async def from_disk(self, request: web.Request) -> web.Response:
        from safetensors.torch import load_file

        body = await self.body(request)
        files = sorted(Path(body["model_path"]).glob("*.safetensors"))
        if not files:
            return web.json_response(
                {"success": False, "message": "no safetensors", "num_paused_requests": 0}, status=400
            )
        for f in files:
            self.received.update({k: float(v.double().sum()) for k, v in load_file(str(f)).items()})
        self.paths.append(body["model_path"])
        response = self.updated(body, "Succeeded to update model weights.")
        if response.status != 200:
            return response
        return web.json_response({**json.loads(response.text), "num_paused_requests": 0})

    def updated(self, body: dict, message: str) -> web.Response:
        """The scheduler's tail of every update: the version, then the flush it was asked for, asserted."""
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
            message += f" Weight version updated to {body['weight_version']}."
        flush = bool(body.get("flush_cache", FLUSH_DEFAULT))
        self.update_flush_flags.append(flush)
        say(f"weight update to version {body.get('weight_version')}, flush_cache {flush}")
        if flush and not self.try_flush():
            self.crash = "AssertionError: Cache flush failed after updating weights"
            return error(self.crash, 500)
        return web.json_response({"success": True, "message": message})


def tp_worker(tp_rank: int, conn) -> None:
    """One TP rank's process: joins the weight group as SGLang's does and receives broadcasts."""
    groups = {}
    while True:
        command, payload = conn.recv()
        try:
            if command == "init":
                name = payload["group_name"]
                groups[name] = join_like_sglang(payload, tp_rank, name, payload["backend"])
                answer = {
                    "rank": int(payload["rank_offset"]) + tp_rank,
                    "world_size": int(payload["world_size"]),
                }
            else:
                group = groups[payload["group_name"] or "weight_update_group"]
                answer = receive(group, payload["specs"])
            conn.send(("ok", answer))
        except Exception as exc:  # noqa: BLE001  every failure goes back to the HTTP side as a message
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def join_like_sglang(body: dict, tp_rank: int, group_name: str, backend: str):
    """SGLang's init_custom_process_group at rank `rank_offset + tp_rank`: tcp rendezvous,
    PrefixStore(group_name), torch's helper."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, rendezvous

    rank, world = int(body["rank_offset"]) + tp_rank, int(body["world_size"])
    timeout = datetime.timedelta(seconds=60)
    init = f"tcp://{body['master_address']}:{body['master_port']}"
    store, rank, world = next(rendezvous(init, rank, world, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(
        world, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout
    )
    return group


def receive(group, specs) -> dict[str, float]:
    import torch.distributed as dist

    out = {}
    for name, dtype, shape in specs:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype))
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        group.broadcast([tensor], opts).wait()
        out[name] = float(tensor.double().sum())
    return out


def spec_counts(num_tokens: int, num_draft_tokens: int) -> dict[str, int]:
    """A request's speculation counts in 0.5.15's meta_info names (and their deprecated aliases): the first
    token from the prefill, then verify steps of one accepted draft and the bonus token each (the last
    may emit the bonus only); none when it never verified."""
    verify_ct = num_tokens // 2  # ceil((num_tokens - 1) / 2)
    if verify_ct == 0:
        return {}
    correct, proposed = num_tokens - 1 - verify_ct, verify_ct * (num_draft_tokens - 1)
    return {
        "spec_verify_ct": verify_ct,
        "spec_num_correct_drafts": correct,
        "spec_num_proposed_drafts": proposed,
        "spec_accepted_drafts": correct,
        "spec_proposed_drafts": proposed,
        "spec_accept_rate": correct / proposed,
        "spec_accept_length": num_tokens / verify_ct,
    }


def delta(out: dict, sent: int) -> dict:
    """An incremental chunk (`--incremental-streaming-output`): the output ids and output logprobs after
    the first `sent`, as tokenizer_manager.py `_slice_streaming_output_meta_info` cuts them; the rest of
    meta_info (completion_tokens included) stays cumulative."""
    meta = dict(out["meta_info"])
    if "output_token_logprobs" in meta:
        meta["output_token_logprobs"] = meta["output_token_logprobs"][sent:]
    return {**out, "output_ids": out["output_ids"][sent:], "meta_info": meta}


LAUNCH_FLAGS = {  # sglang.launch_server's flags that tandem sends (rollout/sglang_process.py), as SGLang types them
    "--model-path": str,
    "--tp-size": int,
    "--mem-fraction-static": float,
    "--host": str,
    "--port": int,
    "--context-length": int,
    "--max-running-requests": int,
    "--random-seed": int,
    "--dtype": str,
    "--api-key": str,
    "--speculative-algorithm": str,
    "--speculative-num-draft-tokens": int,
    "--incremental-streaming-output": bool,  # a switch (store_true)
}


def merge_config(argv: list[str]) -> list[str]:
    """SGLang's ConfigArgumentMerger: the YAML file's keys as flags, then the command line (which wins)."""
    import yaml

    if argv.count("--config") > 1:
        raise ValueError("Multiple config files specified! Only one allowed.")
    if "--config" not in argv:
        return argv
    at = argv.index("--config")
    if at == len(argv) - 1:
        raise ValueError("No config file specified after --config flag!")
    path = Path(argv[at + 1])
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise ValueError(f"Config file must be YAML format, got: {path.suffix}")
    if not path.exists():
        raise ValueError(f"Config file not found: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError("Config file must contain a dictionary at root level")
    flags = [item for key, value in data.items() for item in (f"--{key}", str(value))]
    return flags + argv[:at] + argv[at + 2 :]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sglang serve (fake)")
    for flag, kind in LAUNCH_FLAGS.items():
        if kind is bool:
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=kind, required=flag == "--port")
    parser.set_defaults(tp_size=1, speculative_num_draft_tokens=0, host="127.0.0.1")
    return parser.parse_args(merge_config(argv))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    fake = FakeSglang(
        args.tp_size,
        args.speculative_num_draft_tokens or 0,
        args.api_key,
        args.incremental_streaming_output,
        args.context_length,
    )
    say(f"serving on {args.host}:{args.port}, tp_size {args.tp_size}")
    # a stream frozen by a pause must not hold the exit (aiohttp waits 60 s for open requests by default)
    web.run_app(fake.app(), host=args.host, port=args.port, print=None, access_log=None, shutdown_timeout=1.0)


if __name__ == "__main__":
    main()
