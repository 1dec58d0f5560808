"""The engine's HTTP server (SGLang protocol), `tandem serve-engine`.

aiohttp on the main thread, the engine on its loop thread (`loop.py`); handlers only queue commands
and await their futures. Request and response shapes follow SGLang's `/generate`; our extension is
`meta_info.output_token_weight_versions` (the weight version of every output token). `stream=true` is
answered with one server-sent event holding the whole output (then `[DONE]`), so a client that streams
from SGLang drives this engine unchanged. Invariant: every accepted `/generate` is answered exactly
once, with the whole output (also across retract pauses); a client that disconnects has its request
aborted. Every request passes `http_guard` first (API key, size limit); a bad one gets a 400 naming
its field, and `/health` answers 503 while the loop thread has been stuck in one step or command for
longer than `health_stall_s`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
import uuid
from pathlib import Path

import torch
from aiohttp import web

from tandemrl.config.derive import check_model_dir
from tandemrl.config.engine import options_from_args
from tandemrl.engine.engine import Engine, EngineConfig
from tandemrl.engine.loop import PAUSE_MODES, EngineLoop
from tandemrl.engine.sequence import SamplingParams, Sequence
from tandemrl.engine.weight_updates import WeightUpdateRoutes, bad_request, read_json
from tandemrl.host.http_guard import (
    ENGINE_KEY_ENV,
    PORT_IN_USE_EXIT,
    PortInUseError,
    bind_socket,
    guard_middlewares,
    is_loopback,
    key_from_env,
    open_beyond_loopback_message,
)
from tandemrl.host.loop_monitor import LoopMonitor
from tandemrl.host.startup import mark, mark_process_started

logger = logging.getLogger(__name__)

# SGLang's documented /generate fields we honour, plus our request metadata (`task_name`, `metadata`).
GENERATE_FIELDS = {
    "input_ids",
    "text",
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "stream",
    "task_name",
    "metadata",
}


def response_body(seq: Sequence, text: str, weight_version: int, return_logprob: bool) -> dict:
    meta = {
        "id": seq.rid,
        "finish_reason": seq.finish_reason,
        "prompt_tokens": len(seq.prompt_ids),
        "completion_tokens": len(seq.output_ids),
        "cached_tokens": 0,
        "weight_version": str(weight_version),
        "output_token_weight_versions": list(seq.output_weight_versions),
        "num_retractions": seq.num_retractions,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, None] for lp, tok in zip(seq.output_logprobs, seq.output_ids, strict=True)
        ]
    meta.update({k: v for k, v in seq.extra.items()})
    return {"text": text, "output_ids": list(seq.output_ids), "meta_info": meta}


class EngineServer:
    def __init__(
        self,
        loop: EngineLoop,
        model_path: str,
        api_key: str | None = None,
        max_request_mb: float = 16.0,
        health_stall_s: float = 60.0,
        weight_update_timeout_s: float = 600.0,
    ):
        self.loop, self.model_path, self.api_key = loop, model_path, api_key
        self.max_request_bytes = int(max_request_mb * 2**20)
        self.health_stall_s, self.weight_update_timeout_s = health_stall_s, weight_update_timeout_s
        self.started_s = time.time()
        # how long this server's event loop was held (host/loop_monitor.py): a request's answer waits
        # behind whatever holds it, time its client sees as HTTP (runner/step_metrics.py)
        self.loop_monitor = LoopMonitor()

    def build_app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.max_request_bytes,
            middlewares=guard_middlewares(self.api_key, self.max_request_bytes),
        )
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/pause_generation", self.pause)
        app.router.add_post("/continue_generation", self.resume)
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_post("/flush_cache", self.flush_cache)
        app.router.add_get("/flush_cache", self.flush_cache)
        app.router.add_get("/get_weight_version", self.weight_version)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_get("/server_info", self.server_info)  # SGLang 0.5.15's name; get_ is its old one
        app.router.add_get("/metrics", self.server_info)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_get("/model_info", self.model_info)  # what a run's watchdog asks an SGLang-kind engine
        WeightUpdateRoutes(self.loop, self.weight_update_timeout_s).add_to(app)
        app.on_startup.append(_mark_starting)
        app.on_startup.append(self._watch_loop)
        app.on_cleanup.append(self._stop_watching_loop)
        return app

    async def _watch_loop(self, app: web.Application) -> None:
        self.loop_monitor.start()

    async def _stop_watching_loop(self, app: web.Application) -> None:
        self.loop_monitor.stop()

    def _parse_generate(self, body: dict) -> tuple[list[int], SamplingParams]:
        for key in ("stream", "return_logprob", "return_text_in_logprobs"):
            if key in body and not isinstance(body[key], bool):
                raise ValueError(f"{key} must be true or false, got {body[key]!r}")
        if body.get("top_logprobs_num"):
            raise ValueError("top_logprobs_num is not supported by the embedded engine; omit it or send 0")
        if not isinstance(body.get("rid"), (str, type(None))):
            raise ValueError(f"rid must be a string, got {body['rid']!r}")
        input_ids, text = body.get("input_ids"), body.get("text")
        if input_ids is None and text is None:
            raise ValueError("send input_ids (a list of token ids) or text (a string): the body has neither")
        if input_ids is not None and text is not None:
            raise ValueError("send either text or input_ids, not both (the engine would have to pick one)")
        if text is not None:
            input_ids = self._tokenize(text)
        # type(...) is int: JSON true/false are not token ids (bool is an int subclass)
        if not isinstance(input_ids, list) or not all(type(t) is int for t in input_ids):
            raise ValueError("input_ids must be one list of token ids (batched requests are not supported)")
        params = SamplingParams.from_dict(body.get("sampling_params"))
        self.loop.engine.validate(input_ids, params)
        return input_ids, params

    def _tokenize(self, text) -> list[int]:
        if not isinstance(text, str):
            raise ValueError("text must be one string (batched requests are not supported)")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:  # a lone surrogate: valid JSON, not text
            raise ValueError(
                f"text is not valid Unicode ({error.reason} at character {error.start}); send UTF-8 text"
            ) from None
        return self.loop.engine.tokenizer.encode(text)

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request, GENERATE_FIELDS)
            if "text" in body:  # tokenizing a long text must not hold the event loop (and /health)
                input_ids, params = await asyncio.to_thread(self._parse_generate, body)
            else:
                input_ids, params = self._parse_generate(body)
        except (ValueError, TypeError) as error:
            return bad_request(str(error))
        rid = str(body.get("rid") or uuid.uuid4().hex)
        extra = {k: body[k] for k in ("task_name", "metadata") if k in body}
        return_logprob = body.get("return_logprob", False)
        received_s = time.monotonic()
        aio_loop = asyncio.get_running_loop()
        done: asyncio.Future = aio_loop.create_future()
        engine = self.loop.engine

        def on_finish(seq: Sequence) -> None:  # loop thread: build the answer there, hand it over
            result = response_body(seq, engine.stops.output_text(seq), engine.weight_version, return_logprob)
            result["meta_info"]["e2e_latency"] = time.monotonic() - received_s  # SGLang's name: in the server
            aio_loop.call_soon_threadsafe(lambda: done.done() or done.set_result(result))

        try:
            await asyncio.wrap_future(self.loop.submit(rid, input_ids, params, extra, on_finish))
        except ValueError as error:
            return bad_request(str(error))
        try:
            result = await done
        except asyncio.CancelledError:
            self.loop.abort(rid)  # the client went away; free the engine's slot
            raise
        if not body.get("stream"):
            return web.json_response(result)
        # stream=true (SGLang clients stream): one event with the whole output, then SGLang's [DONE]
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        await stream.write(b"data: " + json.dumps(result).encode() + b"\n\ndata: [DONE]\n\n")
        return stream

    async def pause(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request, {"mode", "rid"})  # SGLang's PauseGenerationReqInput
            mode = body.get("mode", "abort")
            if mode not in PAUSE_MODES:
                raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        except ValueError as error:
            return bad_request(str(error))
        info = await asyncio.wrap_future(self.loop.pause(mode))
        message = {"message": "Generation paused successfully.", "status": "ok"}  # SGLang's answer
        return web.json_response({**message, "success": True, "mode": mode, **info})

    async def resume(self, request: web.Request) -> web.Response:
        try:
            await read_json(request, {"torch_empty_cache", "rid"})  # SGLang's ContinueGenerationReqInput
        except ValueError as error:
            return bad_request(str(error))
        await asyncio.wrap_future(self.loop.resume())
        return web.json_response(
            {"message": "Generation continued successfully.", "status": "ok", "success": True}
        )

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(
                request, {"rid", "abort_all", "finished_reason", "abort_message", "weight_versions"}
            )
        except ValueError as error:
            return bad_request(str(error))
        rid = None if body.get("abort_all") else body.get("rid")
        if rid is None and not body.get("abort_all"):
            return bad_request("abort_request needs a rid or abort_all=true")
        num_aborted = await asyncio.wrap_future(self.loop.abort(None if rid is None else str(rid)))
        return web.json_response({"success": True, "num_aborted": num_aborted})

    async def flush_cache(self, request: web.Request) -> web.Response:
        is_flushed = await asyncio.wrap_future(self.loop.call(lambda engine: engine.flush_cache()))
        if not is_flushed:
            return web.Response(status=400, text="Cache not flushed: requests are running; retry when idle.")
        return web.Response(text="Cache flushed.")

    async def weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.loop.engine.weight_version)})

    async def health(self, request: web.Request) -> web.Response:
        if self.loop.error is not None:
            return web.Response(status=503, text=f"engine loop died: {self.loop.error!r}")
        busy_s = self.loop.busy_for_s()
        if busy_s > self.health_stall_s:
            return web.Response(
                status=503,
                text=f"engine loop blocked for {busy_s:.0f} s in {self.loop.busy_with} "
                f"(health_stall_s={self.health_stall_s:g})",
            )
        mark("first /health answered", once=True)
        return web.Response(text="ok")

    async def server_info(self, request: web.Request) -> web.Response:
        stats = await asyncio.wrap_future(self.loop.call(lambda engine: engine.stats()))
        totals = self.loop_monitor.totals()
        return web.json_response(
            {
                **stats,
                "is_paused": self.loop.is_paused,
                "busy_s": self.loop.busy_s,  # cumulative seconds with requests running
                "prefill_busy_s": self.loop.prefill_busy_s,  # the part of it in steps that launched a prefill
                # cumulative seconds the HTTP side's event loop ran its timer late, and was held past 50 ms
                "http_loop_late_s": totals["loop_late_s"],
                "http_loop_stalled_s": totals["loop_stalled_s"],
                "model_path": self.model_path,
                "uptime_s": time.time() - self.started_s,
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        engine = self.loop.engine
        return web.json_response(
            {  # SGLang's fields, then ours
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": str(engine.weight_version),
                "model_type": engine.model.cfg["model_type"],
                "max_context_len": engine.config.max_context_len,
            }
        )


async def _mark_starting(app: web.Application) -> None:
    mark("HTTP server starting")


def _engine_server(args) -> EngineServer:
    """Load the model, start the loop thread, and wrap it in the HTTP server the flags describe."""
    config = EngineConfig(
        model_path=str(args.model),
        device=args.device,
        dtype=args.dtype,
        max_running_requests=args.max_running_requests,
        max_context_len=args.max_context_len,
        seed=args.seed,
        freeze_gc=True,  # this process serves one engine
        **options_from_args(args),
    )
    loop = EngineLoop(Engine(config))
    loop.start()
    return EngineServer(
        loop,
        str(args.model),
        api_key=getattr(args, "api_key", None) or key_from_env(ENGINE_KEY_ENV),
        max_request_mb=getattr(args, "max_request_mb", 16.0),
        health_stall_s=getattr(args, "health_stall_s", 60.0),
        weight_update_timeout_s=getattr(args, "weight_update_timeout_s", 600.0),
    )


def run_serve(args) -> int:
    """`tandem serve-engine`: bind the port, load the model, start the loop thread, serve until
    SIGTERM/SIGINT. Beyond loopback only with an API key; the port is bound before the model loads, so
    a clash is reported at once."""
    mark_process_started()
    mark("modules imported (torch, aiohttp, engine)")
    api_key = getattr(args, "api_key", None) or key_from_env(ENGINE_KEY_ENV)
    if not is_loopback(args.host) and not api_key:
        print(
            open_beyond_loopback_message(
                "serve-engine", args.host, "the engine's control API", ENGINE_KEY_ENV
            ),
            file=sys.stderr,
        )
        return 2
    if not (Path(args.model) / "config.json").exists():
        raise FileNotFoundError(
            f"--model {args.model}: no config.json there; pass a Hugging Face model "
            "directory (e.g. from `tandem prepare model`)"
        )
    check_model_dir(Path(args.model), "--model")  # a broken config.json: one paragraph, not tracebacks
    try:
        sock = bind_socket(args.host, args.port, "serve-engine")
    except OSError as error:
        print(str(error), file=sys.stderr)
        return PORT_IN_USE_EXIT if isinstance(error, PortInUseError) else 2
    if args.device != "cuda" and "OMP_NUM_THREADS" not in os.environ:
        # the CPU engine shares the machine with the trainer: oversubscribed OpenMP threads spin
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    args.api_key = api_key  # the flag or the variable, for the server
    server = _engine_server(args)
    logger.info(
        "API key %s; serving on http://%s:%d",
        "required but on /health" if server.api_key else "not set: open to local processes",
        args.host,
        sock.getsockname()[1],
    )
    try:
        # shutdown_timeout: on SIGTERM wait briefly for answers in flight, never for a stalled update
        web.run_app(
            server.build_app(),
            sock=sock,
            handler_cancellation=True,
            print=None,
            access_log=None,
            shutdown_timeout=5.0,
        )
    finally:
        server.loop.stop()
    return 0
