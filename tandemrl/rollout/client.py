"""Async client for an engine speaking SGLang's HTTP protocol: the embedded engine or a real SGLang.

Every request body carries only fields of SGLang's request dataclasses (`GenerateReqInput`,
`PauseGenerationReqInput`, `InitWeightsUpdateGroupReqInput`, `UpdateWeightsFromDistributedReqInput`,
`UpdateWeightsFromTensorReqInput`, `UpdateWeightFromDiskReqInput`, `AbortReq`); tests/unit/
test_sglang_conformance.py holds us to that against a fake SGLang that rejects anything else. Our
request metadata (`task_name`, `metadata`) goes only to the embedded engine.

Per-token weight versions: the embedded engine reports them (`meta_info.output_token_weight_versions`,
our extension). A real SGLang does not, so with `kind="sglang"` the client streams and stamps
each token with the version of the update timeline it was received under: `mark_weight_version(v)` is
called at the update boundary (just before `continue_generation`), so tokens received before it carry
the old version and tokens after it the new one (docs/BACKENDS.md). `retract` on SGLang is realised
here (rollout/retract.py). Invariant: `generate` returns exactly the tokens the engine sampled (no
decode/re-encode) with one logprob and one version per token.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import aiohttp

from tandemrl.host.http_guard import auth_headers
from tandemrl.host.http_pool import pooled_connector
from tandemrl.host.startup import mark
from tandemrl.rollout.retract import RetractGate, resent_rid, resumed_body

log = logging.getLogger(__name__)

ENGINE_KINDS = ("embedded", "sglang")
# a streamed request whose connection broke before any answer goes again, at most this often (`_open_stream`)
UNANSWERED_RETRIES = 2
# SGLang's per-request speculation counts, in a finished request's meta_info when it speculates (sglang 0.5.15
# tokenizer_manager.py `_calculate_spec_decoding_metrics`), and the older names of two of them
SPEC_META = {
    "spec_num_correct_drafts": "num_spec_accepted_tokens",
    "spec_num_proposed_drafts": "num_spec_draft_tokens",
}
SPEC_META_ALIASES = {
    "spec_accepted_drafts": "spec_num_correct_drafts",
    "spec_proposed_drafts": "spec_num_proposed_drafts",
}
SPEC_COUNTERS = (
    "num_decode_emitted_tokens",
    "num_decode_rows",
    "num_spec_draft_tokens",
    "num_spec_accepted_tokens",
)


class EngineError(RuntimeError):
    """The engine answered with an error status; the message carries its reason, `status` the HTTP
    status where there was one."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass
class GenerateResult:
    output_ids: list[int]
    output_logprobs: list[float]  # logprob of each sampled token
    finish_reason: str  # "stop" | "length" | "abort"
    matched_stop: int | str | None
    weight_versions: list[int] | None  # per output token (None when neither engine nor timeline gave them)
    weight_version: str | None  # meta_info["weight_version"]
    prompt_tokens: int
    server_s: float | None = None  # meta_info["e2e_latency"]: the request's time inside the server

    @classmethod
    def from_response(cls, body: dict) -> GenerateResult:
        meta = body.get("meta_info", {})
        output_ids = list(body.get("output_ids") or [])
        logprobs = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
        if len(logprobs) != len(output_ids):
            raise EngineError(
                f"engine returned {len(output_ids)} tokens but {len(logprobs)} logprobs; "
                "send return_logprob=true"
            )
        versions = meta.get("output_token_weight_versions")
        return cls.from_parts(meta, output_ids, logprobs, None if versions is None else list(versions))

    @classmethod
    def from_parts(cls, meta: dict, output_ids, logprobs, versions) -> GenerateResult:
        reason = meta.get("finish_reason") or {}
        weight_version = meta.get("weight_version")
        return cls(
            output_ids=list(output_ids),
            output_logprobs=list(logprobs),
            finish_reason=reason.get("type", "abort"),
            matched_stop=reason.get("matched"),
            weight_versions=versions,
            weight_version=None if weight_version is None else str(weight_version),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            server_s=_seconds(meta.get("e2e_latency")),
        )


def _seconds(value) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class HttpClient:
    """One aiohttp session per event loop, an optional `Authorization: Bearer` key, JSON in and out."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.headers = auth_headers(api_key)  # sent on every request; never logged
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    def _http(self) -> aiohttp.ClientSession:
        # A session belongs to one event loop; a client reused under a new loop opens a new session.
        if self._session is not None and self._session_loop is not asyncio.get_running_loop():
            self._session = None
        if self._session is None or self._session.closed:
            self._session_loop = asyncio.get_running_loop()
            connector = pooled_connector(0)  # the engine batches; do not queue on our side
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                headers=self.headers,
            )
        return self._session

    async def _post(self, path: str, body: dict | None = None, params: dict | None = None) -> dict | str:
        async with self._http().post(self.base_url + path, json=body or {}, params=params) as resp:
            return await self._read(resp, path)

    async def _get(self, path: str) -> dict | str:
        async with self._http().get(self.base_url + path) as resp:
            return await self._read(resp, path)

    async def _read(self, resp: aiohttp.ClientResponse, path: str) -> dict | str:
        text = await resp.text()
        if resp.status != 200:
            raise EngineError(f"{self.base_url}{path} answered {resp.status}: {text[:500]}", resp.status)
        if resp.content_type == "application/json":
            return json.loads(text)
        return text

    async def _open_stream(self, path: str, body: dict) -> aiohttp.ClientResponse:
        """POST `body` for a stream. A connection that breaks before the server answers is tried again, at
        most UNANSWERED_RETRIES times: the server either never took the request or aborts it when its
        client goes away (vLLM and SGLang abort a stream whose client disconnects), so no token reaches
        the result twice. The last failure is raised as it came."""
        for attempt in range(UNANSWERED_RETRIES):
            try:
                return await self._http().post(self.base_url + path, json=body)
            except aiohttp.ClientConnectionError as error:
                log.warning("%s%s: %r before any answer; sending it again", self.base_url, path, error)
                await asyncio.sleep(0.1 * (attempt + 1))
        return await self._http().post(self.base_url + path, json=body)

    async def _stream(self, path: str, body: dict):
        """The JSON payloads of a server-sent-event stream (`data: {...}` lines, up to `data: [DONE]`)."""
        async with await self._open_stream(path, body) as resp:
            if resp.status != 200:
                raise EngineError(
                    f"{self.base_url}{path} answered {resp.status}: {(await resp.text())[:500]}", resp.status
                )
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise EngineError(f"{self.base_url}{path} streamed an error: {chunk['error']}")
                yield chunk

    async def health(self) -> bool:
        return await self._answers_ok("/health")

    async def _answers_ok(self, path: str) -> bool:
        """Whether GET `path` answers 200 within 5 s."""
        try:
            async with self._http().get(
                self.base_url + path, timeout=aiohttp.ClientTimeout(total=5.0)
            ) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def is_alive(self) -> bool:
        """What the run's watchdog asks of an external server (runner/services.py `watchdog`): /health."""
        return await self.health()

    async def post(self, path: str, body: dict | None = None) -> dict | str:
        """Any other endpoint; raises EngineError on a non-200 answer."""
        return await self._post(path, body)

    def mark_weight_version(self, version: int) -> None:
        """The update boundary: tokens received from now on were sampled under `version`."""
        self.weight_version = int(version)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def fit_to_context(sampling_params: dict, num_input: int, max_context_len: int | None) -> dict:
    """`sampling_params` with `max_new_tokens` cut to the context left after the input: the embedded engine
    stops a request at its context's end, while SGLang and vLLM refuse one whose input plus max_new_tokens
    would pass it (SGLang's `_validate_one_request`, vLLM's max_model_len check). An input that fills the
    context is refused as the embedded engine refuses it."""
    if max_context_len is None:
        return sampling_params
    room = max_context_len - num_input
    if room <= 0:
        raise EngineError(
            f"prompt has {num_input} tokens but the context is {max_context_len} (rollout.max_context_len); "
            "shorten the prompt or raise rollout.max_context_len"
        )
    wanted = int(sampling_params.get("max_new_tokens", 128))
    return sampling_params if wanted <= room else {**sampling_params, "max_new_tokens": room}


def count_speculation(totals: dict[str, float], meta: dict) -> None:
    """Add a finished SGLang request's speculation counts (its last meta_info) to `totals`: its tokens,
    the draft tokens proposed and accepted, and its rows, the tokens less the accepted drafts (a verify step
    emits one token plus the drafts it accepted; the first token, from the prefill, is a row too), as
    `prometheus_counters` derives them for vLLM. A request that verified nothing (one token) reports no
    counts and adds none; a retracted request adds each of its pieces."""
    counts = {SPEC_META_ALIASES.get(key, key): value for key, value in meta.items()}
    if not all(_count(counts.get(key)) is not None for key in (*SPEC_META, "completion_tokens")):
        return
    accepted = _count(counts["spec_num_correct_drafts"])
    emitted = _count(counts["completion_tokens"])
    totals["num_decode_emitted_tokens"] += emitted
    totals["num_decode_rows"] += emitted - accepted
    for key, name in SPEC_META.items():
        totals[name] += _count(counts[key])


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _checked(answer: dict | str, what: str) -> dict:
    """SGLang answers weight-update calls with {"success", "message"}; success=false is an error."""
    if not isinstance(answer, dict) or not answer.get("success", False):
        raise EngineError(f"{what} failed: {answer}")
    return answer


class EngineClient(HttpClient):
    def __init__(
        self,
        base_url: str,
        timeout_s: float = 600.0,
        api_key: str | None = None,
        kind: str = "embedded",
        weight_version: int = 0,
        max_context_len: int | None = None,
    ):
        if kind not in ENGINE_KINDS:
            raise ValueError(f"kind must be one of {ENGINE_KINDS}, got {kind!r}")
        super().__init__(base_url, timeout_s, api_key)
        self.kind = kind
        self.max_context_len = max_context_len  # SGLang's --context-length: `fit_to_context`
        self.weight_version = weight_version
        self.retract_gate = RetractGate()  # SGLang only (the embedded engine retracts by itself)
        self.live_rids: dict[str, str] = {}  # SGLang only: a caller's rid -> the rid it was sent again as
        self.spec_totals = dict.fromkeys(SPEC_COUNTERS, 0.0)  # SGLang only: `count_speculation`

    async def generate(
        self, input_ids: list[int], sampling_params: dict, rid: str | None = None, extra: dict | None = None
    ) -> GenerateResult:
        if self.kind != "embedded":  # ours stops a request at its context's end by itself
            sampling_params = fit_to_context(sampling_params, len(input_ids), self.max_context_len)
        body = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params),
            "return_logprob": True,
        }
        if rid is not None:
            body["rid"] = rid
        mark("first rollout request sent", once=True)
        if self.kind == "embedded":
            body.update(extra or {})
        else:
            return await self._generate_streamed(body)
        return GenerateResult.from_response(await self._post("/generate", body))

    async def _generate_streamed(self, body: dict) -> GenerateResult:
        """Stream `body`; a request that a retract pause sent back waits for `continue_generation` and
        goes again with its tokens appended to the prompt (rollout/retract.py): the result spans all.
        It goes again under a rid of its own (`resent_rid`): SGLang aborts a streamed request's rid 2 s
        after its stream ended (http_server.py `create_abort_task`), which would cut a request sent again
        under the same rid within that time. `abort_request` finds it under the rid it has now."""
        gate, rid = self.retract_gate, body.get("rid")
        limit = int(body["sampling_params"].get("max_new_tokens", 128))
        ids, logprobs, versions, meta = [], [], [], {}
        marked, attempt = gate.mark(), 0
        try:
            while True:
                await gate.wait_open()
                if attempt and not gate.is_retracted(marked, rid):  # aborted while it waited
                    meta = {**meta, "finish_reason": {"type": "abort", "message": "aborted by the caller"}}
                    break
                marked, sent = gate.mark(), resumed_body(body, ids)
                if rid is not None and attempt:
                    sent["rid"] = self.live_rids[rid] = resent_rid(rid, attempt)
                attempt += 1
                try:
                    meta = await self._stream_tokens(sent, ids, logprobs, versions)
                except EngineError:  # a stream the pause cut: keep what it delivered, go again
                    if not gate.is_retracted(marked, rid):
                        raise
                    continue
                count_speculation(self.spec_totals, meta)
                is_abort = (meta.get("finish_reason") or {}).get("type") == "abort"
                if not (is_abort and gate.is_retracted(marked, rid)):
                    break
                if len(ids) >= limit:  # retracted after its last token: it is complete
                    meta = {**meta, "finish_reason": {"type": "length", "length": limit}}
                    break
        finally:
            if rid is not None:
                self.live_rids.pop(rid, None)
        reported = meta.get("output_token_weight_versions")  # an engine that knows them (ours) wins
        if reported is not None and len(reported) == len(ids):
            versions = [int(v) for v in reported]
        meta = {**meta, "prompt_tokens": len(body["input_ids"])}
        return GenerateResult.from_parts(meta, ids, logprobs, versions)

    async def _stream_tokens(self, body: dict, ids: list, logprobs: list, versions: list) -> dict:
        """Append the tokens of one streamed request to the lists as they arrive (an interrupted stream
        keeps what it delivered); returns its last meta_info. SGLang streams either cumulative or
        incremental `output_ids`; `completion_tokens` (always cumulative) says which."""
        start, meta = len(ids), {}
        async for chunk in self._stream("/generate", {**body, "stream": True}):
            meta = chunk.get("meta_info", {})
            done = len(ids) - start
            total = int(meta.get("completion_tokens", done))
            new = total - done
            if new <= 0:
                continue
            chunk_ids = list(chunk.get("output_ids") or [])
            chunk_lps = [float(e[0]) for e in meta.get("output_token_logprobs") or []]
            if len(chunk_ids) == total:  # cumulative
                chunk_ids = chunk_ids[done:]
            if len(chunk_lps) == total:
                chunk_lps = chunk_lps[done:]
            if len(chunk_ids) != new or len(chunk_lps) != new:
                if (meta.get("finish_reason") or {}).get("type") == "abort":
                    # SGLang's abort of a queued request echoes its last id and every logprob
                    # (tokenizer_manager.py `_handle_abort_req`), merged with any chunk still unread: the
                    # tokens it did not deliver are lost with the abort (a retracted request makes them again)
                    meta = {**meta, "completion_tokens": len(ids)}
                    continue
                raise EngineError(
                    f"stream chunk has {len(chunk_ids)} ids and {len(chunk_lps)} logprobs for {new} new "
                    "tokens; send return_logprob=true"
                )
            ids += chunk_ids
            logprobs += chunk_lps
            versions += [self.weight_version] * new
        return meta

    async def is_alive(self) -> bool:
        """SGLang is asked /model_info, not /health. SGLang 0.5.15's /health (http_server.py
        `health_generate`, SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION on by default) sends a one-token
        generation through the scheduler and answers no sooner than a second, and not before 20 s
        (then 503) while generation is paused: a watchdog asking every second would count a healthy
        server as dead, and a probe running in the scheduler when a `drain` update flushes the cache
        would make SGLang refuse the flush (it flushes only with no request queued or running). /model_info is answered by the HTTP
        server at once (SGLang's own start-up polls it); a scheduler that dies takes the server with it
        (SGLang kills its process tree on a child's SIGQUIT), and one that hangs is SGLang's own watchdog's
        (--watchdog-timeout). Other engines: /health."""
        return await self._answers_ok("/model_info" if self.kind == "sglang" else "/health")

    async def counters(self) -> dict[str, float]:
        """SGLang's speculation counters summed over the requests this client saw finish (`spec_totals`),
        under the embedded engine's /get_server_info names, like `VllmClient.counters`."""
        return dict(self.spec_totals)

    async def pause_generation(self, mode: str) -> dict:
        """The server's answer (the embedded engine's includes where its pause took time, engine/loop.py)."""
        if self.kind == "sglang" and mode == "retract":
            self.retract_gate.close()  # in-flight requests come back (abort) and wait here until continue
            answer = await self._post("/pause_generation", {"mode": "abort"})
        else:
            answer = await self._post("/pause_generation", {"mode": mode})
        return answer if isinstance(answer, dict) else {}

    async def continue_generation(self) -> None:
        await self._post("/continue_generation")
        self.retract_gate.open()

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        if abort_all:
            self.retract_gate.num_abort_all += 1
        elif rid is not None:
            self.retract_gate.aborted_rids.add(rid)
            rid = self.live_rids.get(rid, rid)  # the rid a retracted request was sent again under
        await self._post("/abort_request", {"abort_all": True} if abort_all else {"rid": rid})

    async def flush_cache(self) -> None:
        """Raises EngineError when the engine refuses: SGLang (and ours) flush only when no request is
        queued or running."""
        await self._post("/flush_cache")

    async def num_tp_ranks(self, default: int = 1) -> int:
        """The server's tensor-parallel ranks, each a member of the weight group: SGLang reports its
        `tp_size` in /server_info; the embedded engine is one rank."""
        if self.kind == "embedded":
            return 1
        info = await self.server_info()
        return int(info.get("tp_size", default)) if isinstance(info, dict) else default

    async def finish_weight_update(self, weight_version: int, flush: bool) -> None:
        """After the last bucket of a push: SGLang keeps the old weights' KV in its cache until flushed
        (`flush` says whether the pause mode leaves the engine idle); the embedded engine drops its
        prefix cache on every update by itself."""
        del weight_version  # every bucket carried it
        if not (flush and self.kind == "sglang"):
            return
        try:
            await self.flush_cache()
        except EngineError as error:
            raise EngineError(
                f"{error}. SGLang flushes its cache only when no request is queued or running, which "
                "rollout.pause_mode=retract and drain ensure for this run's requests: is another client "
                "sending to this server?"
            ) from error

    async def get_weight_version(self) -> str:
        # SGLang 0.5.15 answers /get_weight_version with 404 ("use /model_info"); both engines report
        # the version in /model_info
        return str((await self.get_model_info())["weight_version"])

    # SGLang 0.5.15's names; it logs a deprecation warning for every call to /get_model_info and
    # /get_server_info (http_server.py), which the run asks once a step. The embedded engine has both names.
    async def get_model_info(self) -> dict:
        return await self._get("/model_info")

    async def server_info(self) -> dict:
        return await self._get("/server_info")

    # ---- weight updates (SGLang's routes and bodies) --------------------------------------------------
    # Buckets go with flush_cache false: an update that asks for the flush while a request is queued or
    # running fails SGLang's assert and kills its scheduler. The flush comes once, after the last bucket,
    # as its own call, and only where the pause mode leaves the engine idle (`finish_weight_update`).
    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> dict:
        body = {
            "master_address": master_address,
            "master_port": int(master_port),
            "rank_offset": int(rank_offset),
            "world_size": int(world_size),
            "group_name": group_name,
            "backend": backend,
        }
        return _checked(await self._post("/init_weights_update_group", body), "init_weights_update_group")

    async def update_weights_from_distributed(
        self, names, dtypes, shapes, group_name: str, weight_version: int, flush_cache: bool = False
    ) -> dict:
        body = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "weight_version": str(weight_version),
        }
        return _checked(
            await self._post("/update_weights_from_distributed", body), "update_weights_from_distributed"
        )

    async def update_weights_from_tensor(
        self, serialized_named_tensors: list[str], weight_version: int, load_format: str | None = None
    ) -> dict:
        body = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "flush_cache": False,
            "weight_version": str(weight_version),
        }
        if load_format is not None:
            body["load_format"] = load_format
        return _checked(await self._post("/update_weights_from_tensor", body), "update_weights_from_tensor")

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int, flush_cache: bool = True
    ) -> dict:
        body = {
            "model_path": str(model_path),
            "weight_version": str(weight_version),
            "flush_cache": flush_cache,
        }
        return _checked(await self._post("/update_weights_from_disk", body), "update_weights_from_disk")
