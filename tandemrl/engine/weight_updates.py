"""The engine's weight-update endpoints, with SGLang's routes and request bodies: process-group setup,
broadcast receive, CUDA IPC receive (`update_weights_from_tensor`), safetensors reload
(`update_weights_from_disk`).

SGLang's `update_weights_from_tensor` entries are pickles; this engine unpickles nothing from the
network: each entry must be base64 JSON of IPC descriptions (engine/weight_transport.py), and a pickle
is refused with a 400 that says so. Receiving and loading run as one command on the engine's loop
thread, so an update lands between two steps. Invariants: a call is all or nothing — its names, shapes
and dtypes are checked against the model before anything is received (each name a parameter of the
served model, given once: a RoPE buffer or a repeated name is refused, not ignored), every tensor is
received before any is loaded, and the loader checks every value before the first copy, so a refused
call, a sender that stops mid-call or a receive that times out (`weight_update_timeout_s`) leaves the
old weights and version; a version is at most MAX_WEIGHT_VERSION and only moves forward (a call carrying `weight_version` sets it, bucketed
updates repeat the same value, one without bumps it), except for the first update after an
(authenticated) group join: a new trainer, e.g. one resumed from an older checkpoint, owns the
sequence from there.
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

from tandemrl.engine.engine import MAX_WEIGHT_VERSION, Engine
from tandemrl.engine.loop import EngineLoop
from tandemrl.engine.weight_transport import (
    BACKENDS,
    broadcast,
    new_process_group,
    parse_dtype,
    rebuild_cuda_tensor,
    run_in_daemon_thread,
)

logger = logging.getLogger(__name__)


def bad_request(reason: str) -> web.Response:
    return web.json_response({"success": False, "message": reason, "error": {"message": reason}}, status=400)


async def read_json(request: web.Request, allowed: set[str]) -> dict:
    """The request's JSON object; raises ValueError naming unknown fields."""
    try:
        body = await request.json() if request.can_read_body else {}
    except RecursionError:
        raise ValueError("body is nested too deeply; send a flat JSON object") from None
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
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 10:
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_WEIGHT_VERSION:
        shown = (
            value if not isinstance(value, (str, int)) or len(str(value)) <= 24 else f"{str(value)[:20]}..."
        )
        raise ValueError(
            f"weight_version must be an integer in 0..{MAX_WEIGHT_VERSION} (or its decimal string), "
            f"got {shown!r}"
        )
    return value


def parse_specs(
    body: dict, shapes_by_name: dict[str, tuple[int, ...]]
) -> list[tuple[str, torch.dtype, list[int]]]:
    """(name, dtype, shape) of every announced tensor, each checked against the served model, so nothing
    is received (or allocated) for an update that would be refused. A name may appear once per call
    (a second copy would silently win), and only parameters may be sent: a RoPE `inv_freq` buffer is
    computed from the config, so sending one is refused rather than ignored."""
    names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
    if not all(isinstance(v, list) for v in (names, dtypes, shapes)):
        raise ValueError("names, dtypes and shapes must be lists")
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError("names, dtypes and shapes must have the same length")
    specs, seen = [], set()
    for name, dtype_text, shape in zip(names, dtypes, shapes, strict=True):
        if not isinstance(name, str):
            raise ValueError(f"names: {name!r} is not a string")
        check_weight_name(name, shapes_by_name, seen)
        dtype = parse_dtype(dtype_text)
        if not dtype.is_floating_point:
            raise ValueError(f"dtypes: weight {name!r} has dtype {dtype_text!r}; weights are floating point")
        if not isinstance(shape, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in shape
        ):
            raise ValueError(f"shapes: weight {name!r} has shape {shape!r}; a shape is a list of integers")
        expected = shapes_by_name[name]
        if tuple(shape) != expected:
            raise ValueError(f"shapes: weight {name!r} has shape {shape}, the model expects {list(expected)}")
        specs.append((name, dtype, list(shape)))
    return specs


def check_weight_name(name: str, shapes_by_name: dict[str, tuple[int, ...]], seen: set[str]) -> None:
    """Raise ValueError unless `name` is a parameter of the served model not yet seen in this call."""
    if name.endswith("rotary_emb.inv_freq"):
        raise ValueError(
            f"names: {name!r} is a RoPE buffer the engine computes from the model config, not a weight; "
            "leave it out of the update. No weight was changed"
        )
    if name not in shapes_by_name:
        raise ValueError(
            f"names: {_short(name)!r} is not a parameter of the served model; no weight was changed"
        )
    if name in seen:
        raise ValueError(
            f"names: {name!r} appears twice in one update (which copy should win?); send each weight once. "
            "No weight was changed"
        )
    seen.add(name)


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def parse_group_args(body: dict) -> tuple[str, int, int, int, str, str]:
    """(master_address, master_port, rank, world_size, group_name, backend) of a group join, checked."""
    address, group_name = body["master_address"], body.get("group_name", "weight_update_group")
    numbers = {key: body[key] for key in ("master_port", "rank_offset", "world_size")}
    for key, value in numbers.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{key} must be an integer, got {value!r}")
    if not isinstance(address, str) or not address:
        raise ValueError(f"master_address must be a host name or address, got {address!r}")
    if not 0 < numbers["master_port"] < 65536:
        raise ValueError(f"master_port must be in 1..65535, got {numbers['master_port']}")
    if not 1 <= numbers["rank_offset"] < numbers["world_size"]:
        raise ValueError(
            f"rank_offset must be in 1..world_size-1 (rank 0 is the trainer), got {numbers['rank_offset']} "
            f"of world_size {numbers['world_size']}"
        )
    if not isinstance(group_name, str):
        raise ValueError(f"group_name must be a string, got {group_name!r}")
    backend = body.get("backend", "gloo")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return address, numbers["master_port"], numbers["rank_offset"], numbers["world_size"], group_name, backend


class WeightUpdateAborted(RuntimeError):
    """Receiving an update's tensors failed or timed out; nothing was loaded."""


class WeightUpdateRoutes:
    def __init__(self, loop: EngineLoop, timeout_s: float = 600.0):
        self.loop, self.timeout_s = loop, timeout_s
        self.groups: dict[str, tuple[object, str]] = {}
        self.shapes_by_name = loop.engine.model.parameter_shapes()

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
            args = parse_group_args(body) + (self.timeout_s,)
            if args[5] == "nccl" and self.loop.engine.device.type != "cuda":
                raise ValueError("backend nccl needs an engine on CUDA; use gloo for a CPU engine")
        except KeyError as error:
            return bad_request(f"init_weights_update_group: missing field {error}")
        except ValueError as error:
            return bad_request(f"init_weights_update_group: {error}")
        group_name, backend = args[4], args[5]
        if self.loop.engine.device.type == "cuda":
            torch.cuda.set_device(self.loop.engine.device)
        try:
            group = await run_in_daemon_thread(new_process_group, *args)
        except Exception as error:  # the rendezvous failed: report, keep serving
            return web.json_response(
                {"success": False, "message": f"group setup failed: {error!r}"}, status=500
            )
        self.groups[group_name] = (group, backend)
        await asyncio.wrap_future(self.loop.call(lambda engine: engine.restart_version_order()))
        logger.info(
            "joined weight update group %s (%s) as rank %d of %d", group_name, backend, args[2], args[3]
        )
        return web.json_response({"success": True, "message": f"joined {group_name}"})

    async def destroy_group(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request, {"group_name"})
        except ValueError as error:
            return bad_request(str(error))
        removed = self.groups.pop(str(body.get("group_name", "weight_update_group")), None)
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
            group_name = body.get("group_name", "weight_update_group")
            if not isinstance(group_name, str) or group_name not in self.groups:
                raise ValueError(
                    f"no weight update group {group_name!r}; call /init_weights_update_group first"
                )
            specs = parse_specs(body, self.shapes_by_name)
            version = parse_weight_version(body.get("weight_version"))
            self.loop.engine.check_weight_version(version)
        except KeyError as error:
            return bad_request(f"update_weights_from_distributed: missing field {error}")
        except (ValueError, TypeError) as error:
            return bad_request(f"update_weights_from_distributed: {error}")
        group, backend = self.groups[group_name]

        def receive_and_load(engine: Engine) -> int:
            device = engine.device if backend == "nccl" else torch.device("cpu")
            received = []
            try:
                for name, dtype, shape in specs:
                    tensor = torch.empty(shape, dtype=dtype, device=device)
                    broadcast(group, tensor, root=0)
                    received.append((name, tensor))
            except RuntimeError as error:  # the sender stopped or stalled: keep the old weights
                self.groups.pop(group_name, None)  # a collective that failed leaves the group unusable
                raise WeightUpdateAborted(
                    f"update_weights_from_distributed aborted after receiving {len(received)} of "
                    f"{len(specs)} tensors (timeout {self.timeout_s:g} s): {error}. No weight was changed "
                    f"(weight_version stays {engine.weight_version}); group {group_name!r} was dropped, "
                    "call /init_weights_update_group again"
                ) from None
            return engine.load_weights(received, version)

        return await self._run_update(receive_and_load, label="update_weights_from_distributed")

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request, TENSOR_FIELDS)
            version = parse_weight_version(body.get("weight_version"))
            items = decode_ipc_entries(body.get("serialized_named_tensors"))
            seen: set[str] = set()
            for item in items:
                if not isinstance(item["name"], str):
                    raise ValueError(f"serialized_named_tensors: name {item['name']!r} is not a string")
                check_weight_name(item["name"], self.shapes_by_name, seen)
            if self.loop.engine.device.type != "cuda":
                raise ValueError(
                    "update_weights_from_tensor carries CUDA IPC handles; the engine is not on CUDA"
                )
            self.loop.engine.check_weight_version(version)
        except KeyError as error:
            return bad_request(f"update_weights_from_tensor: missing field {error}")
        except (ValueError, TypeError) as error:
            return bad_request(f"update_weights_from_tensor: {error}")

        def open_and_load(engine: Engine) -> int:
            torch.cuda.set_device(engine.device)
            named = [(item["name"], rebuild_cuda_tensor(item["tensor"])) for item in items]
            version_after = engine.load_weights(named, version)
            torch.cuda.synchronize(engine.device)  # the sender may free its tensors once we answer
            return version_after

        return await self._run_update(open_and_load, label="update_weights_from_tensor")

    async def update_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request, DISK_FIELDS)
            version = parse_weight_version(body.get("weight_version"))
            self.loop.engine.check_weight_version(version)
            files = sorted(Path(str(body["model_path"])).glob("*.safetensors"))
            if not files:
                raise ValueError(f"model_path {body['model_path']!r} holds no *.safetensors file")
        except KeyError as error:
            return bad_request(f"update_weights_from_disk: missing field {error}")
        except (ValueError, TypeError) as error:
            return bad_request(f"update_weights_from_disk: {error}")

        def read_and_load(engine: Engine) -> int:
            from safetensors.torch import load_file  # safetensors: tensors only, nothing executable

            named = [item for f in files for item in load_file(str(f)).items()]
            # older checkpoints store RoPE's inv_freq buffer; the engine computes it from the config
            named = [(name, tensor) for name, tensor in named if not name.endswith("rotary_emb.inv_freq")]
            return engine.load_weights(named, version)

        response = await self._run_update(read_and_load, label="update_weights_from_disk")
        if response.status == 200:  # SGLang's answer also counts the requests it paused (none here)
            body = json.loads(response.text)
            return web.json_response({**body, "num_paused_requests": 0})
        return response

    async def _run_update(self, fn, label: str) -> web.Response:
        try:
            version = await asyncio.wrap_future(self.loop.call(fn, label=label))
        except ValueError as error:
            return bad_request(str(error))
        except WeightUpdateAborted as error:
            logger.warning("%s", error)
            return web.json_response({"success": False, "message": str(error)}, status=500)
        return web.json_response(
            {"success": True, "message": "weights updated", "weight_version": str(version)}
        )
