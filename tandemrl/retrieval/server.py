"""`tandem serve-retrieval`: the Search-R1 retrieval server API over our Qdrant index (FastAPI + uvicorn).

`POST /retrieve {"queries": [...], "topk": 3, "return_scores": true}` answers
`{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}` — with `return_scores` false, each
query's entry is the bare list of documents, as in Search-R1's server — so a Search-R1 client works
unchanged. `GET /health` reports readiness. Invariant: the server process owns the index (Qdrant local
mode allows one process per path) and no request can take it down: bad input gets a 4xx naming the
field, a failed search a 500 for that request only.
"""

from __future__ import annotations

import logging
import sys
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from tandemrl.retrieval.batcher import MicroBatcher
from tandemrl.retrieval.store import Hit

log = logging.getLogger(__name__)

DEFAULT_TOPK = 3  # Search-R1's server falls back to its configured topk (3 in its scripts)
MAX_TOPK = 50
MAX_QUERIES_PER_REQUEST = 4096


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


def _render(hits: list[list[Hit]], return_scores: bool) -> list[list]:
    if return_scores:
        return [[{"document": hit.document, "score": hit.score} for hit in query_hits] for query_hits in hits]
    return [[hit.document for hit in query_hits] for query_hits in hits]


def create_app(batcher: MicroBatcher, info: dict) -> FastAPI:
    """The HTTP app around a started-on-startup `batcher`; `info` is echoed by /health."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await batcher.start()
        try:
            yield
        finally:
            await batcher.stop()

    app = FastAPI(title="tandemrl retrieval", lifespan=lifespan)
    app.add_exception_handler(RequestValidationError, _validation_error)

    @app.get("/health")
    async def health() -> dict:
        return {
            "status": "ok",
            **info,
            "num_batches": batcher.num_batches,
            "num_queries": batcher.num_queries,
        }

    @app.post("/retrieve")
    async def retrieve(request: RetrieveRequest):
        topk = DEFAULT_TOPK if request.topk is None else request.topk
        if not 1 <= topk <= MAX_TOPK:
            return JSONResponse(status_code=400, content={"error": f"topk={topk}: must be in 1..{MAX_TOPK}."})
        if len(request.queries) > MAX_QUERIES_PER_REQUEST:
            return JSONResponse(
                status_code=400,
                content={
                    "error": f"{len(request.queries)} queries in one request: at most {MAX_QUERIES_PER_REQUEST}; "
                    "split the batch."
                },
            )
        if not request.queries:
            return {"result": []}
        try:
            hits = await batcher.submit(request.queries, topk)
        except Exception as error:  # a failed search fails this request, never the server
            log.warning("retrieval failed: %s", error)
            return JSONResponse(status_code=500, content={"error": f"retrieval failed: {error}"})
        return {"result": _render(hits, request.return_scores)}

    return app


def run_serve(args) -> int:
    import uvicorn

    from tandemrl.retrieval.retriever import Retriever

    try:
        retriever = Retriever(Path(args.index), mode=args.mode, qdrant_url=args.qdrant_url)
    except (ValueError, RuntimeError) as error:  # wrong mode for the index, index locked by another process
        print(f"tandem serve-retrieval: {error}", file=sys.stderr)
        return 2
    retriever.search(["warm-up query"], [1])  # load lazy weights before the first real request
    info = {
        "mode": retriever.mode,
        "encoder": retriever.meta.encoder,
        "num_passages": retriever.num_passages,
        "index": str(retriever.index_dir),
    }
    app = create_app(MicroBatcher(retriever.search), info)
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
