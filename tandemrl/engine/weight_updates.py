"""The engine's weight-update endpoints: process-group setup, broadcast receive, CUDA IPC receive.

Receiving and loading run as one command on the engine's loop thread, so a update lands between two
steps. Invariant: the weight version changes only after every tensor of a call has been loaded; a
call carrying `weight_version` sets it (bucketed updates repeat the same value), one without bumps it.
"""

from __future__ import annotations

import asyncio
import logging

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
            body = await read_json(request, {"named_tensors", "weight_version", "flush_cache", "load_format"})
            version = parse_weight_version(body.get("weight_version"))
            items = body["named_tensors"]
            if not isinstance(items, list) or not all(
                isinstance(i, dict) and {"name", "tensor"} <= set(i) for i in items
            ):
                raise ValueError('named_tensors must be a list of {"name", "tensor"} IPC descriptions')
            if self.loop.engine.device.type != "cuda":
                raise ValueError(
                    "update_weights_from_tensor carries CUDA IPC handles; the engine is not on CUDA"
                )
        except (ValueError, KeyError, TypeError) as error:
            return bad_request(f"update_weights_from_tensor: {error!r}")

        def open_and_load(engine: Engine) -> int:
            torch.cuda.set_device(engine.device)
            named = [(item["name"], rebuild_cuda_tensor(item["tensor"])) for item in items]
            version_after = engine.load_weights(named, version)
            torch.cuda.synchronize(engine.device)  # the sender may free its tensors once we answer
            return version_after

        return await self._run_update(open_and_load)

    async def _run_update(self, fn) -> web.Response:
        try:
            version = await asyncio.wrap_future(self.loop.call(fn))
        except ValueError as error:
            return bad_request(str(error))
        return web.json_response(
            {"success": True, "message": "weights updated", "weight_version": str(version)}
        )
