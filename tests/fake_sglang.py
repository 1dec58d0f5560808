"""A FAKE SGLang server, run as its own process by tests/integration/test_sglang_conformance.py. It
stands in for `python -m sglang.launch_server` at the process boundary: no model runs behind it.

What it holds us to: every request body may carry only the fields SGLang's request dataclasses define
(sglang/srt/managers/io_struct.py: GenerateReqInput, PauseGenerationReqInput, ContinueGenerationReqInput,
AbortReq, InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput,
UpdateWeightsFromTensorReqInput, UpdateWeightFromDiskReqInput, DestroyWeightsUpdateGroupReqInput; plus
BaseReq's rid and http_worker_ipc), and sampling_params only SGLang's SamplingParams keys; anything else
is a 400 in SGLang's error shape. Answers have SGLang's shapes (entrypoints/http_server.py). The weight
group is joined exactly as SGLang's `init_custom_process_group` joins it (torch's tcp rendezvous, the
bare group name as store prefix, torch's group helper), so a client naming the group otherwise hangs.

Generation is a deterministic stand-in: token i of a request is (sum(prompt) + 7 i) % 1000 with logprob
-0.5, one token every TOKEN_S seconds, none while paused; streams are SGLang's default (cumulative).
GET /fake/state (fake-only) reports what it saw, for the tests to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import json
from pathlib import Path

import torch
from aiohttp import web

TOKEN_S = 0.03
BASE = {"rid", "http_worker_ipc"}
FIELDS = {
    "/generate": BASE
    | {"session_id", "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data"}
    | {"sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob"}
    | {"return_sampling_mask", "return_text_in_logprobs", "stream", "log_metrics", "return_hidden_states"}
    | {"return_routed_experts", "modalities", "session_params", "lora_path", "lora_id", "priority"}
    | {"custom_logit_processor", "bootstrap_host", "bootstrap_port", "bootstrap_room", "routed_dp_rank"}
    | {"data_parallel_rank", "extra_key", "no_logs", "custom_labels", "return_entropy", "cache_salt"},
    "/pause_generation": BASE | {"mode"},
    "/continue_generation": BASE | {"torch_empty_cache"},
    "/abort_request": BASE | {"abort_all", "finished_reason", "abort_message", "weight_versions"},
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
SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p", "min_new_tokens",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "n", "json_schema", "regex", "ebnf", "custom_params",
    "stream_interval", "logit_bias", "sampling_seed",
}  # fmt: skip
PAUSE_MODES = ("abort", "retract", "in_place")


def error(message: str, status: int = 400) -> web.Response:
    """SGLang's ErrorResponse body (its validation handler answers 400)."""
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": status}
    return web.json_response(body, status=status)


class FakeSglang:
    def __init__(self):
        self.paused = asyncio.Event()
        self.abort_epoch = 0
        self.aborted_rids: set[str] = set()
        self.weight_version = "default"
        self.groups: dict[str, object] = {}
        self.received: dict[str, float] = {}
        self.paths: list[str] = []
        self.tokens_at_pause: dict[str, int] = {}
        self.progress: dict[str, int] = {}

    async def body(self, request: web.Request) -> dict:
        body = await request.json() if request.can_read_body else {}
        path = request.path
        unknown = set(body) - FIELDS[path]
        if unknown:
            raise ValueError(f"{path}: fields {sorted(unknown)} are not in SGLang's request dataclass")
        missing = REQUIRED.get(path, set()) - set(body)
        if missing:
            raise ValueError(f"{path}: missing required fields {sorted(missing)}")
        return body

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.validation])
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
        app.router.add_get("/health", lambda r: web.Response(status=200))
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_get(
            "/get_weight_version", lambda r: web.json_response({"weight_version": self.weight_version})
        )
        app.router.add_get("/fake/state", self.state)
        return app

    @web.middleware
    async def validation(self, request, handler):
        try:
            return await handler(request)
        except (ValueError, KeyError, TypeError) as exc:
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
        if not body.get("stream"):
            outputs = [out async for out in self.run(rid, ids, params, bool(body.get("return_logprob")))]
            return web.json_response(outputs[-1])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        async for out in self.run(rid, ids, params, bool(body.get("return_logprob"))):
            await resp.write(b"data: " + json.dumps(out).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def run(self, rid: str, ids: list[int], params: dict, return_logprob: bool):
        out_ids, epoch, limit = [], self.abort_epoch, int(params.get("max_new_tokens", 128))
        while len(out_ids) < limit:
            while self.paused.is_set() and self.abort_epoch == epoch:
                await asyncio.sleep(0.005)
            if self.abort_epoch != epoch or rid in self.aborted_rids:
                yield self.output(rid, ids, out_ids, return_logprob, {"type": "abort", "message": "aborted"})
                return
            await asyncio.sleep(TOKEN_S)
            if self.paused.is_set():
                continue
            out_ids.append((sum(ids) + 7 * len(out_ids)) % 1000)
            self.progress[rid] = len(out_ids)
            done = len(out_ids) == limit
            reason = {"type": "length", "length": limit} if done else None
            yield self.output(rid, ids, out_ids, return_logprob, reason)

    def output(self, rid, ids, out_ids, return_logprob, reason) -> dict:
        meta = {
            "id": rid,
            "finish_reason": reason,
            "prompt_tokens": len(ids),
            "weight_version": self.weight_version,
            "completion_tokens": len(out_ids),
            "cached_tokens": 0,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[-0.5, t, None] for t in out_ids]
        return {"text": "", "output_ids": list(out_ids), "meta_info": meta}

    # ---- control -----------------------------------------------------------------------------------
    async def pause(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise ValueError(f"Invalid mode: {mode!r}. Expected one of {PAUSE_MODES}.")
        self.tokens_at_pause = dict(self.progress)
        self.paused.set()
        if mode == "abort":
            self.abort_epoch += 1
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        await self.body(request)
        self.paused.clear()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        if body.get("abort_all"):
            self.abort_epoch += 1
        else:
            self.aborted_rids.add(str(body.get("rid", "")))
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        text = "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n"  # noqa: E501
        return web.Response(text=text)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": "fake-sglang",
                "tokenizer_path": "fake-sglang",
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
            }
        )

    async def state(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "received": self.received,
                "paths": self.paths,
                "weight_version": self.weight_version,
                "tokens_at_pause": self.tokens_at_pause,
                "progress": self.progress,
            }
        )

    # ---- weights -----------------------------------------------------------------------------------
    async def init_group(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        name, backend = body.get("group_name", "weight_update_group"), body.get("backend", "nccl")
        group = await asyncio.to_thread(join_like_sglang, body, name, backend)
        self.groups[name] = group
        return web.json_response(
            {"success": True, "message": "Succeeded to initialize custom process group."}
        )

    async def destroy_group(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        removed = self.groups.pop(body.get("group_name", "weight_update_group"), None)
        return web.json_response({"success": removed is not None, "message": "destroyed"})

    async def from_distributed(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        group = self.groups[body.get("group_name", "weight_update_group")]
        specs = list(zip(body["names"], body["dtypes"], body["shapes"], strict=True))
        received = await asyncio.to_thread(receive, group, specs)
        self.received.update(received)
        return self.updated(body, "Succeeded to update parameter online.")

    async def from_tensor(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        entries = body["serialized_named_tensors"]
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            raise ValueError("serialized_named_tensors must be a list of base64 strings")
        for entry in entries:
            base64.b64decode(entry, validate=True)  # FastAPI's Base64Bytes would refuse anything else
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
        response = json.loads(self.updated(body, "Succeeded to update model weights.").text)
        return web.json_response({**response, "num_paused_requests": 0})

    def updated(self, body: dict, message: str) -> web.Response:
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
            message += f" Weight version updated to {body['weight_version']}."
        return web.json_response({"success": True, "message": message})


def join_like_sglang(body: dict, group_name: str, backend: str):
    """SGLang's init_custom_process_group: tcp rendezvous, PrefixStore(group_name), torch's helper."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, rendezvous

    timeout = datetime.timedelta(seconds=60)
    init = f"tcp://{body['master_address']}:{body['master_port']}"
    rank, world = int(body["rank_offset"]), int(body["world_size"])
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    web.run_app(FakeSglang().app(), host="127.0.0.1", port=args.port, print=None, access_log=None)
