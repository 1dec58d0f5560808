"""`tandem serve-retrieval`: the Search-R1 retrieval server API over our Qdrant index (FastAPI + uvicorn).

`POST /retrieve {"queries": [...], "topk": 3, "return_scores": true}` answers
`{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}` — with `return_scores` false, each
query's entry is the bare list of documents, as in Search-R1's server — so a Search-R1 client works
unchanged. `GET /health` reports readiness. Invariant: the server process owns the index (Qdrant local
mode allows one process per path) and no request can take it down: bad input gets a 4xx naming the
field, a body over `--max-request-mb` or more than MAX_QUERIES_PER_REQUEST queries a 413, a failed
search a 500 for that request only. Bound beyond loopback it requires an API key (`Authorization:
Bearer <key>`) on every path but /health.
"""

from __future__ import annotations

import json
import logging
import sys
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from tandemrl.engine.http_guard import (
    LOOPBACK_HOSTS,
    OPEN_PATHS,
    RETRIEVAL_KEY_ENV,
    is_authorized,
    key_from_env,
    too_large_message,
)
from tandemrl.metrics.startup import mark, mark_process_started
from tandemrl.retrieval.batcher import MicroBatcher
from tandemrl.retrieval.store import Hit

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
    if item.get("type") == "json_invalid":  # its loc holds a character position, not a field
        return "body (malformed JSON)"
    parts = [str(part) for part in item.get("loc", ()) if part != "body"]
    return ".".join(parts) or "body"


async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    """422 like FastAPI's, plus a one-line message that names each offending field."""
    errors = error.errors()
    message = "; ".join(f"{_field_name(item)}: {item.get('msg', 'invalid')}" for item in errors)
    detail = [
        {"loc": list(item.get("loc", ())), "msg": item.get("msg"), "type": item.get("type")}
        for item in errors
    ]
    return JSONResponse(status_code=422, content={"error": f"invalid request: {message}", "detail": detail})


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
        return JSONResponse(status_code=400, content={"error": f"topk={topk}: must be in 1..{MAX_TOPK}."})
    if len(request.queries) > MAX_QUERIES_PER_REQUEST:
        message = f"{len(request.queries)} queries in one request: at most {MAX_QUERIES_PER_REQUEST}; split the batch."
        return JSONResponse(status_code=413, content={"error": message})
    for index, query in enumerate(request.queries):
        try:
            query.encode("utf-8")
        except UnicodeEncodeError as error:
            message = (
                f"queries[{index}] is not valid Unicode text ({error.reason} at character {error.start})."
            )
            return JSONResponse(status_code=400, content={"error": message})
    return None


def _render(hits: list[list[Hit]], return_scores: bool) -> list[list]:
    if return_scores:
        return [[{"document": hit.document, "score": hit.score} for hit in query_hits] for query_hits in hits]
    return [[hit.document for hit in query_hits] for query_hits in hits]


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
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_middleware(RequestGuard, api_key=api_key, max_request_bytes=int(max_request_mb * 2**20))

    @app.get("/health")
    async def health() -> dict:
        mark("first /health answered", once=True)
        return {
            "status": "ok",
            **info,
            "num_batches": batcher.num_batches,
            "num_queries": batcher.num_queries,
        }

    @app.post("/retrieve")
    async def retrieve(request: RetrieveRequest):
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
            return JSONResponse(status_code=500, content={"error": f"retrieval failed: {error}"})
        return {"result": _render(hits, request.return_scores)}

    return app


def run_serve(args) -> int:
    mark_process_started()
    mark("modules imported (fastapi)")
    import uvicorn

    from tandemrl.retrieval.fusion import default_fusion
    from tandemrl.retrieval.retriever import Retriever

    api_key = getattr(args, "api_key", None) or key_from_env(RETRIEVAL_KEY_ENV)
    if args.host not in LOOPBACK_HOSTS and not api_key:
        print(
            f"tandem serve-retrieval: --host {args.host} exposes the index beyond this machine; pass "
            f"--api-key (or set ${RETRIEVAL_KEY_ENV}) so only your clients can query it",
            file=sys.stderr,
        )
        return 2
    try:
        fusion = default_fusion(getattr(args, "fusion", "zscore"))  # a Namespace built in code may lack it
        retriever = Retriever(Path(args.index), mode=args.mode, qdrant_url=args.qdrant_url, fusion=fusion)
    except (ValueError, RuntimeError) as error:  # wrong mode for the index, index locked by another process
        print(f"tandem serve-retrieval: {error}", file=sys.stderr)
        return 2
    mark("retriever built (index, encoder)")
    retriever.search(["warm-up query"], [1])  # load lazy weights before the first real request
    mark("warm-up search done")
    info = {
        "mode": retriever.mode,
        **({"fusion": fusion.method} if retriever.mode == "hybrid" else {}),
        "encoder": retriever.meta.encoder,
        "num_passages": retriever.num_passages,
        "index": str(retriever.index_dir),
    }
    app = create_app(MicroBatcher(retriever.search), info, api_key, getattr(args, "max_request_mb", 4.0))
    log.info(
        "serving %s (%s, %d passages) on http://%s:%d/retrieve",
        args.index,
        retriever.mode,
        retriever.num_passages,
        args.host,
        args.port,
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    finally:
        retriever.close()
    return 0
