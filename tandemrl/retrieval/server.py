"""`tandem serve-retrieval`: the Search-R1 retrieval server API over our Qdrant index (FastAPI + uvicorn).

`POST /retrieve {"queries": [...], "topk": 3, "return_scores": true}` answers
`{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}` — with `return_scores` false, each
query's entry is the bare list of documents, as in Search-R1's server — so a Search-R1 client works
unchanged. `GET /health` reports readiness (mode, encoder, counts; never where the index lives).
Invariant: the server process owns the index (Qdrant local mode allows one process per path) and no
request can take it down: bad input gets a 4xx naming the field, in one shape (`{"error": message}`,
validation errors with FastAPI's `detail` beside it), a body over `--max-request-mb` or more than
MAX_QUERIES_PER_REQUEST queries a 413, a failed search a 500 for that request only. An empty or blank
query is refused (it would return arbitrary documents). Bound beyond loopback it requires an API key
(`Authorization: Bearer <key>`) on every path but /health; the port is bound before the index loads.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException

from tandemrl.host.cpus import limit_threads
from tandemrl.host.http_guard import (
    OPEN_PATHS,
    PORT_IN_USE_EXIT,
    RETRIEVAL_KEY_ENV,
    PortInUseError,
    bind_socket,
    is_authorized,
    is_loopback,
    key_from_env,
    open_beyond_loopback_message,
    too_large_message,
)
from tandemrl.host.startup import mark, mark_process_started
from tandemrl.retrieval.batcher import MicroBatcher
from tandemrl.retrieval.store import Hit, server_errors

log = logging.getLogger(__name__)

DEFAULT_TOPK = 3  # Search-R1's server falls back to its configured topk (3 in its scripts)
MAX_TOPK = 50
MAX_QUERIES_PER_REQUEST = 1024
# a longer query is cut here (the dense encoder keeps ~256 tokens anyway), so BM25 work stays bounded
MAX_QUERY_CHARS = 4096


class RetrieveRequest(BaseModel):
    """Search-R1's QueryRequest; strict so that `"topk": "3"` or `"queries": "text"` are rejected."""

    model_config = ConfigDict(strict=True, extra="ignore")
    queries: list[str]
    topk: int | None = None
    return_scores: bool = False


def _field_name(item: dict) -> str:
    parts = [str(part) for part in item.get("loc", ()) if part != "body"]
    return ".".join(parts) or "body"


def _invalid(errors: list[dict]) -> JSONResponse:
    """422 like FastAPI's, plus a one-line message that names each offending field."""
    message = "; ".join(f"{_field_name(item)}: {item.get('msg', 'invalid')}" for item in errors)
    detail = [
        {"loc": ["body", *item.get("loc", ())], "msg": item.get("msg"), "type": item.get("type")}
        for item in errors
    ]
    return JSONResponse(status_code=422, content={"error": f"invalid request: {message}", "detail": detail})


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": message})


async def _http_error(_: Request, error: HTTPException) -> JSONResponse:
    """404 / 405 in the server's one error shape (FastAPI's `detail` kept beside it)."""
    return JSONResponse(
        status_code=error.status_code,
        content={"error": f"{error.detail}", "detail": error.detail},
        headers=getattr(error, "headers", None),
    )


def parse_request(body: bytes) -> RetrieveRequest | JSONResponse:
    """The request of a raw body, or the 4xx answer naming what is wrong with it. The body is parsed
    here, whatever its content type (Search-R1's clients send JSON), so every error has one shape."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        return _error(
            422, f"invalid request: body (malformed JSON): byte {error.start} is not UTF-8; send JSON"
        )
    try:
        raw = json.loads(text)
    except RecursionError:
        return _error(
            422, "invalid request: body (malformed JSON): nested too deeply; send a flat JSON object"
        )
    except ValueError as error:
        return _error(422, f"invalid request: body (malformed JSON): {error}")
    if not isinstance(raw, dict):
        return _error(
            422, f"invalid request: body must be a JSON object with 'queries', not a {type(raw).__name__}"
        )
    try:
        return RetrieveRequest.model_validate(raw)
    except ValidationError as error:
        return _invalid(error.errors(include_url=False, include_input=False))


class RequestGuard:
    """ASGI middleware: the API key (when set), then the body-size limit, counted as the body streams
    in, so neither a stranger nor a huge upload reaches the handler."""

    def __init__(self, app, api_key: str | None, max_request_bytes: int):
        self.app, self.api_key, self.max_request_bytes = app, api_key, max_request_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if scope["path"] not in OPEN_PATHS and not is_authorized(headers.get("authorization"), self.api_key):
            message = f"{scope['path']} needs the server's API key: send 'Authorization: Bearer <key>'"
            return await _send_error(send, 401, message)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_request_bytes:
            return await _send_error(send, 413, too_large_message(int(length), self.max_request_bytes))
        body = bytearray()  # read here, within the limit, then replayed to the app in one message
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message], receive), send)  # a disconnect: pass it on
            body += message.get("body", b"")
            if len(body) > self.max_request_bytes:
                return await _send_error(send, 413, too_large_message(None, self.max_request_bytes))
            if not message.get("more_body", False):
                break
        replayed = _replay([{"type": "http.request", "body": bytes(body), "more_body": False}], receive)
        await self.app(scope, replayed, send)


def _replay(messages: list[dict], receive):
    """A `receive` that hands out `messages`, then waits on the real one (for a disconnect)."""
    queue = list(messages)

    async def replay():
        return queue.pop(0) if queue else await receive()

    return replay


async def _send_error(send, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def refusal(request: RetrieveRequest, topk: int) -> JSONResponse | None:
    """The 4xx answer for a request that cannot be searched (naming the first bad field), or None."""
    if not 1 <= topk <= MAX_TOPK:
        return _error(400, f"topk={topk}: must be in 1..{MAX_TOPK}.")
    if len(request.queries) > MAX_QUERIES_PER_REQUEST:
        message = f"{len(request.queries)} queries in one request: at most {MAX_QUERIES_PER_REQUEST}; split the batch."
        return _error(413, message)
    for index, query in enumerate(request.queries):
        try:
            query.encode("utf-8")
        except UnicodeEncodeError as error:
            return _error(
                400,
                f"queries[{index}] is not valid Unicode text ({error.reason} at character {error.start}).",
            )
        if not query.strip():
            return _error(
                400,
                f"queries[{index}] is empty or only whitespace: it would match arbitrary documents. "
                "Send the text to search for.",
            )
    return None


def _render(hits: list[list[Hit]], return_scores: bool) -> list[list]:
    if return_scores:
        return [
            [{"document": _json_safe(hit.document), "score": _json_safe(hit.score)} for hit in query_hits]
            for query_hits in hits
        ]
    return [[_json_safe(hit.document) for hit in query_hits] for query_hits in hits]


def _json_safe(value):
    """NaN and infinity as null: JSON has neither, and one in a passage's payload (an index built before
    `tandem index build` refused them) made every answer that hit the passage a 500."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_safe(item) for item in value]
    return value


def create_app(
    batcher: MicroBatcher, info: dict, api_key: str | None = None, max_request_mb: float = 4.0
) -> FastAPI:
    """The HTTP app around a started-on-startup `batcher`; `info` is echoed by /health."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await batcher.start()
        mark("HTTP server starting")
        try:
            yield
        finally:
            await batcher.stop()

    app = FastAPI(title="tandemrl retrieval", lifespan=lifespan)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_middleware(RequestGuard, api_key=api_key, max_request_bytes=int(max_request_mb * 2**20))

    @app.get("/health")
    async def health() -> dict:
        mark("first /health answered", once=True)
        return {
            "status": "ok",
            **info,
            "num_batches": batcher.num_batches,
            "num_queries": batcher.num_queries,
            "busy_s": batcher.busy_s,
            "queue_wait_s": batcher.queue_wait_s,
        }

    @app.post("/retrieve")
    async def retrieve(http_request: Request):
        request = parse_request(await http_request.body())
        if isinstance(request, JSONResponse):
            return request
        topk = DEFAULT_TOPK if request.topk is None else request.topk
        refused = refusal(request, topk)
        if refused is not None:
            return refused
        if not request.queries:
            return {"result": []}
        try:
            hits = await batcher.submit([query[:MAX_QUERY_CHARS] for query in request.queries], topk)
        except Exception as error:  # a failed search fails this request, never the server
            log.warning("retrieval failed: %s", error)
            return _error(500, f"retrieval failed: {error}")
        return {"result": _render(hits, request.return_scores)}

    return app


def _open_retriever(args, fusion, sock):
    """The retriever of `args.index`, or None after printing why it cannot be opened (the bound
    socket is closed whenever it is not returned with a retriever)."""
    from tandemrl.retrieval.retriever import Retriever

    try:
        retriever = Retriever(Path(args.index), mode=args.mode, qdrant_url=args.qdrant_url, fusion=fusion)
    except (ValueError, RuntimeError, *server_errors()) as error:  # wrong mode, index locked, no server
        sock.close()
        print(f"tandem serve-retrieval: {error}", file=sys.stderr)
        return None
    except BaseException:
        sock.close()
        raise
    mark("retriever built (index, encoder)")
    return retriever


def run_serve(args) -> int:
    """`tandem serve-retrieval`: bind the port, open the index, serve. Beyond loopback only with a key."""
    mark_process_started()
    mark("modules imported (fastapi)")
    import uvicorn

    from tandemrl.retrieval.fusion import default_fusion

    api_key = getattr(args, "api_key", None) or key_from_env(RETRIEVAL_KEY_ENV)
    if not is_loopback(args.host) and not api_key:
        print(
            open_beyond_loopback_message("serve-retrieval", args.host, "the index", RETRIEVAL_KEY_ENV),
            file=sys.stderr,
        )
        return 2
    num_threads = getattr(args, "num_threads", 0)  # a Namespace built in code may lack it
    if num_threads < 0:  # before the port and the index: nothing opened yet
        print(
            f"tandem serve-retrieval: --num-threads={num_threads}: use 0 (every core) or more",
            file=sys.stderr,
        )
        return 2
    try:
        sock = bind_socket(args.host, args.port, "serve-retrieval")  # before the index: a clash fails now
    except OSError as error:
        print(str(error), file=sys.stderr)
        return PORT_IN_USE_EXIT if isinstance(error, PortInUseError) else 2
    fusion = default_fusion(getattr(args, "fusion", "zscore"))  # a Namespace built in code may lack it
    retriever = _open_retriever(args, fusion, sock)
    if retriever is None:
        return 2
    blas_threads = limit_threads(num_threads) if num_threads else None  # torch is loaded with the encoder
    retriever.search(["warm-up query"], [1])  # load lazy weights before the first real request
    mark("warm-up search done")
    info = {
        "mode": retriever.mode,
        **({"fusion": fusion.method} if retriever.mode == "hybrid" else {}),
        "encoder": Path(retriever.meta.encoder).name,  # a path names the machine's layout: its last part
        "num_passages": retriever.num_passages,
        **({"num_threads": num_threads} if num_threads else {}),
        **({"blas_threads": blas_threads} if blas_threads is not None else {}),
    }
    app = create_app(MicroBatcher(retriever.search), info, api_key, getattr(args, "max_request_mb", 4.0))
    log.info(
        "serving %s (%s, %d passages) on http://%s:%d/retrieve",
        args.index,
        retriever.mode,
        retriever.num_passages,
        args.host,
        sock.getsockname()[1],
    )
    try:
        config = uvicorn.Config(app, log_level="warning", access_log=False)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        retriever.close()
        sock.close()
    return 0
