"""The engine's weight-update endpoints, with SGLang's routes and request bodies: process-group setup,
broadcast receive, CUDA IPC receive (`update_weights_from_tensor`), safetensors reload
(`update_weights_from_disk`).

SGLang's `update_weights_from_tensor` entries are pickles; this engine unpickles nothing from the
network: each entry must be base64 JSON of IPC descriptions (engine/weight_transport.py), and a pickle
is refused with a 400 that says so. Receiving and loading run as one command on the engine's loop
thread, so an update lands between two steps. Invariant: the weight version changes only after every
tensor of a call has been loaded; a call carrying `weight_version` sets it (bucketed updates repeat the
same value), one without bumps it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
from pathlib import Path

import torch
from aiohttp import web

from tandemrl.engine.engine import Engine
from tandemrl.engine.loop import EngineLoop
from tandemrl.engine.weight_transport import broadcast, new_process_group, parse_dtype, rebuild_cuda_tensor

logger = logging.getLogger(__name__)


def bad_request(reason: str) -> web.Response:
    return web.json_response({"success": False, "message": reason, "error": {"message": reason}}, status=400)


async def read_json(request: web.Request, allowed: set[str]) -> dict:
    """The request's JSON object; raises ValueError naming unknown fields."""
    try:
        body = await request.json() if request.can_read_body else {}
    except ValueError as error:
        raise ValueError(f"body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    unknown = set(body) - allowed
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}; allowed: {sorted(allowed)}")
    return body


# the fields of SGLang's UpdateWeightsFromTensorReqInput / UpdateWeightFromDiskReqInput (and BaseReq's rid)
TENSOR_FIELDS = {
    "serialized_named_tensors",
    "load_format",
    "flush_cache",
    "abort_all_requests",
    "weight_version",
    "disable_draft_model",
    "torch_empty_cache",
    "rid",
}
DISK_FIELDS = {
    "model_path",
    "load_format",
    "abort_all_requests",
    "weight_version",
    "is_async",
    "torch_empty_cache",
    "keep_pause",
    "recapture_cuda_graph",
    "token_step",
    "flush_cache",
    "manifest",
    "rid",
}


def decode_ipc_entries(entries) -> list[dict]:
    """The IPC descriptions of `serialized_named_tensors` (one entry per TP rank; this engine has one).
    Raises ValueError for anything but base64 JSON, pickles included."""
    if not isinstance(entries, list) or not entries or not all(isinstance(e, str) for e in entries):
        raise ValueError("serialized_named_tensors must be a non-empty list of base64 strings")
    try:
        raw = base64.b64decode(entries[0], validate=True)
    except binascii.Error as error:
        raise ValueError(f"serialized_named_tensors[0] is not base64: {error}") from None
    if raw[:1] == b"\x80":
        raise ValueError(
            "serialized_named_tensors holds a pickle; this engine unpickles nothing from the network. "
            "Send base64 JSON of IPC descriptions (tandemrl.rollout.weight_sync.ipc_payload)"
        )
    try:
        items = json.loads(raw)
    except ValueError as error:
        raise ValueError(f"serialized_named_tensors[0] is not base64 JSON: {error}") from None
    if not isinstance(items, list) or not all(
        isinstance(i, dict) and {"name", "tensor"} <= set(i) for i in items
    ):
        raise ValueError(
            'serialized_named_tensors[0] must decode to a list of {"name", "tensor"} descriptions'
        )
    return items


def parse_weight_version(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        return int(value)
    raise ValueError(f"weight_version must be an integer (or its decimal string), got {value!r}")


class WeightUpdateRoutes:
    def __init__(self, loop: EngineLoop):
        self.loop = loop
        self.groups: dict[str, tuple[object, str]] = {}

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/init_weights_update_group", self.init_group)
        app.router.add_post("/destroy_weights_update_group", self.destroy_group)
        app.router.add_post("/update_weights_from_distributed", self.update_from_distributed)
        app.router.add_post("/update_weights_from_tensor", self.update_from_tensor)
        app.router.add_post("/update_weights_from_disk", self.update_from_disk)

    async def init_group(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(
                request,
                {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"},
            )
            group_name, backend = body.get("group_name", "weight_update_group"), body.get("backend", "gloo")
            if backend == "nccl" and self.loop.engine.device.type != "cuda":
                raise ValueError("backend nccl needs an engine on CUDA; use gloo for a CPU engine")
            args = (
                body["master_address"],
                int(body["master_port"]),
                int(body["rank_offset"]),
                int(body["world_size"]),
                group_name,
                backend,
            )
        except (ValueError, KeyError, TypeError) as error:
            return bad_request(f"init_weights_update_group: {error!r}")
        if self.loop.engine.device.type == "cuda":
            torch.cuda.set_device(self.loop.engine.device)
        try:
            group = await asyncio.to_thread(new_process_group, *args)
        except Exception as error:  # the rendezvous failed: report, keep serving
            return web.json_response(
                {"success": False, "message": f"group setup failed: {error!r}"}, status=500
            )
        self.groups[group_name] = (group, backend)
        logger.info(
            "joined weight update group %s (%s) as rank %d of %d", group_name, backend, args[2], args[3]
        )
        return web.json_response({"success": True, "message": f"joined {group_name}"})

    async def destroy_group(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request, {"group_name"})
        except ValueError as error:
            return bad_request(str(error))
        removed = self.groups.pop(body.get("group_name", "weight_update_group"), None)
        return web.json_response(
            {"success": removed is not None, "message": "destroyed" if removed else "unknown"}
        )

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(
                request,
                {
                    "names",
                    "dtypes",
                    "shapes",
                    "group_name",
                    "flush_cache",
                    "weight_version",
                    "abort_all_requests",
                    "load_format",
                    "torch_empty_cache",
                },
            )
            names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
            if not (len(names) == len(dtypes) == len(shapes)):
                raise ValueError("names, dtypes and shapes must have the same length")
            specs = [
                (n, parse_dtype(d), [int(x) for x in s])
                for n, d, s in zip(names, dtypes, shapes, strict=True)
            ]
            version = parse_weight_version(body.get("weight_version"))
            group_name = body.get("group_name", "weight_update_group")
            if group_name not in self.groups:
                raise ValueError(
                    f"no weight update group {group_name!r}; call /init_weights_update_group first"
                )
        except (ValueError, KeyError, TypeError) as error:
            return bad_request(f"update_weights_from_distributed: {error!r}")
        group, backend = self.groups[group_name]

        def receive_and_load(engine: Engine) -> int:
            device = engine.device if backend == "nccl" else torch.device("cpu")
            received = []
            for name, dtype, shape in specs:
                tensor = torch.empty(shape, dtype=dtype, device=device)
                broadcast(group, tensor, root=0)
                received.append((name, tensor))
            return engine.load_weights(received, version)

        return await self._run_update(receive_and_load)

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request, TENSOR_FIELDS)
            version = parse_weight_version(body.get("weight_version"))
            items = decode_ipc_entries(body.get("serialized_named_tensors"))
            if self.loop.engine.device.type != "cuda":
                raise ValueError(
                    "update_weights_from_tensor carries CUDA IPC handles; the engine is not on CUDA"
                )
        except (ValueError, KeyError, TypeError) as error:
            return bad_request(f"update_weights_from_tensor: {error}")

        def open_and_load(engine: Engine) -> int:
            torch.cuda.set_device(engine.device)
            named = [(item["name"], rebuild_cuda_tensor(item["tensor"])) for item in items]
            version_after = engine.load_weights(named, version)
            torch.cuda.synchronize(engine.device)  # the sender may free its tensors once we answer
            return version_after

        return await self._run_update(open_and_load)

    async def update_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request, DISK_FIELDS)
            version = parse_weight_version(body.get("weight_version"))
            files = sorted(Path(str(body["model_path"])).glob("*.safetensors"))
            if not files:
                raise ValueError(f"model_path {body['model_path']!r} holds no *.safetensors file")
        except (ValueError, KeyError, TypeError) as error:
            return bad_request(f"update_weights_from_disk: {error!r}")

        def read_and_load(engine: Engine) -> int:
            from safetensors.torch import load_file  # safetensors: tensors only, nothing executable

            named = [item for f in files for item in load_file(str(f)).items()]
            return engine.load_weights(named, version)

        response = await self._run_update(read_and_load)
        if response.status == 200:  # SGLang's answer also counts the requests it paused (none here)
            body = json.loads(response.text)
            return web.json_response({**body, "num_paused_requests": 0})
        return response

    async def _run_update(self, fn) -> web.Response:
        try:
            version = await asyncio.wrap_future(self.loop.call(fn))
        except ValueError as error:
            return bad_request(str(error))
        return web.json_response(
            {"success": True, "message": "weights updated", "weight_version": str(version)}
        )
