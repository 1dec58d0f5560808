"""rollout.backend wiring without servers: the pause modes each backend can realise (a clear ConfigError
at start-up otherwise), the weight routes and flushes per backend and pause mode, the vLLM request
mapping, the embedded engine's refusal of pickled tensors, and SGLang's SafeUnpickler rule (as the fake
applies it) over tandem's IPC entries."""

from __future__ import annotations

import base64
import collections
import io
import json
import pickle

import pytest
import torch

from tandemrl.config.loader import load_config
from tandemrl.config.schema import ConfigError
from tandemrl.engine.weight_updates import decode_ipc_entries
from tandemrl.rollout.backends import make_client, make_weight_sender
from tandemrl.rollout.client import EngineClient
from tandemrl.rollout.vllm_client import VllmClient, check_pause_mode, completion_body
from tandemrl.rollout.weight_sync import DiskWeightSender, WeightSender, ipc_payload
from tests.fake_sglang import pickle_globals, refused_globals

PAUSE = ("retract", "drain", "in_place")


def test_pause_mode_is_derived_per_backend():
    assert load_config(None, []).rollout.pause_mode == "retract"
    vllm = load_config(None, ["rollout.backend=vllm", "rollout.server_addrs=[127.0.0.1:8000]"])
    assert vllm.rollout.pause_mode == "in_place" and "rollout.pause_mode" in vllm.derived
    drain = load_config(None, ["rollout.backend=vllm", "rollout.pause_mode=drain"])
    assert drain.rollout.pause_mode == "drain"


def test_vllm_refuses_retract_at_startup_and_takes_every_weight_route():
    with pytest.raises(
        ConfigError, match=r"rollout.pause_mode='retract' with rollout.backend=vllm.*in_place"
    ):
        load_config(None, ["rollout.backend=vllm", "rollout.pause_mode=retract"])
    with pytest.raises(ValueError, match="not available on vLLM"):
        check_pause_mode("retract")
    check_pause_mode("in_place")
    from tandemrl.cluster.placement import plan_placement

    vllm = ["rollout.backend=vllm", "retrieval.launch=false"]
    assert plan_placement(load_config(None, vllm + ["rollout.device=cpu"])).weight_sync == "gloo"
    shared = vllm + [
        "cluster.component_placement={'actor,rollout': '0'}",
        "actor.device=cuda",
        "rollout.device=cuda",
    ]
    assert plan_placement(load_config(None, shared)).weight_sync == "cuda_ipc"
    assert load_config(None, vllm + ["rollout.weight_sync=disk"]).rollout.weight_sync == "disk"


def test_completion_body_maps_sglang_sampling_params():
    params = {"max_new_tokens": 5, "temperature": 0.0, "top_k": -1, "stop": ["</a>"], "stop_token_ids": [2]}
    body = completion_body("m", [1, 2, 3], params, rid="r1")
    assert body["max_tokens"] == 5 and body["top_k"] == 0 and body["stop"] == ["</a>"]
    assert body["prompt"] == [1, 2, 3] and body["request_id"] == "r1" and body["stream"] is True
    assert body["logprobs"] == 0 and body["return_token_ids"] is True and "max_new_tokens" not in body
    with pytest.raises(ValueError, match=r"\['min_p'\] have no vLLM equivalent"):
        completion_body("m", [1], {"min_p": 0.1}, rid=None)


def test_clients_and_senders_per_backend(tmp_path):
    assert isinstance(make_client("vllm", "http://h:1"), VllmClient)
    assert make_client("sglang", "http://h:1").kind == "sglang"
    assert isinstance(make_client("embedded", "http://h:1"), EngineClient)
    sender = make_weight_sender("vllm", "disk", ["http://h:1"], 64, sync_dir=str(tmp_path))
    assert isinstance(sender, DiskWeightSender) and isinstance(sender.clients[0], VllmClient)
    broadcast = make_weight_sender("vllm", "gloo", ["http://h:1"], 64)
    assert isinstance(broadcast, WeightSender) and broadcast.engine_kind == "vllm"
    with pytest.raises(ValueError, match="needs a directory"):
        make_weight_sender("sglang", "disk", ["http://h:1"], 64)
    # the cache is flushed after a push only where no request is at the engine during it
    flushes = {
        m: make_weight_sender("sglang", "nccl", ["http://h:1"], 64, pause_mode=m).flush_cache for m in PAUSE
    }
    assert flushes == {"retract": True, "drain": True, "in_place": False}
    disk = make_weight_sender(
        "sglang", "disk", ["http://h:1"], 64, sync_dir=str(tmp_path), pause_mode="in_place"
    )
    assert disk.flush_cache is False


def test_sglang_ipc_entries_name_the_gpu_by_uuid_for_sglang_and_stay_json_for_ours():
    """SGLang opens a pickle with its patched torch reductions (device UUIDs); the embedded engine and our
    vLLM worker extension take JSON descriptions only. A CPU tensor stands in for the CUDA one here: its
    reduction carries no device, so the pickle must load as plain tensors."""
    bucket = [("w", torch.arange(4.0))]
    raw = base64.b64decode(ipc_payload(bucket, "sglang"))
    assert raw[:1] == b"\x80"  # a pickle, as SGLang's MultiprocessingSerializer makes
    from multiprocessing.reduction import ForkingPickler

    ((name, tensor),) = ForkingPickler.loads(raw)
    assert name == "w" and torch.equal(tensor, torch.arange(4.0))


@pytest.mark.parametrize("protocol", range(3, pickle.HIGHEST_PROTOCOL + 1))  # 2 names builtins __builtin__
def test_the_fakes_pickle_reader_finds_the_globals_an_unpickler_loads(protocol):
    """tests/fake_sglang.py reads an entry's globals without loading it, to apply SGLang's SafeUnpickler
    rule: it finds what Python's own unpickler looks up, in order, at every protocol (memo included)."""
    obj = [ConfigError("x"), torch.float16, collections.OrderedDict(a=1), (ConfigError, ConfigError), eval]
    raw = pickle.dumps(obj, protocol=protocol)
    looked_up = []

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            looked_up.append((module, name))
            return super().find_class(module, name)

    Recording(io.BytesIO(raw)).load()
    assert pickle_globals(raw) == looked_up
    assert refused_globals(raw) == ["tandemrl.config.errors.ConfigError", "builtins.eval"]
    # tandem's own entry: torch's reductions and multiprocessing's fd sharing only
    ours = base64.b64decode(ipc_payload([("w", torch.arange(4.0).half())], "sglang"))
    assert ("torch.multiprocessing.reductions", "rebuild_tensor") in pickle_globals(ours)
    assert refused_globals(ours) == []


def test_embedded_engine_opens_json_ipc_entries_never_pickles():
    items = [{"name": "w", "tensor": {"size": [1]}}]
    assert decode_ipc_entries([base64.b64encode(json.dumps(items).encode()).decode()]) == items
    pickled = base64.b64encode(pickle.dumps(items)).decode()
    with pytest.raises(ValueError, match="unpickles nothing"):
        decode_ipc_entries([pickled])
    with pytest.raises(ValueError, match="not base64"):
        decode_ipc_entries(["***"])
    with pytest.raises(ValueError, match="non-empty list"):
        decode_ipc_entries([])
