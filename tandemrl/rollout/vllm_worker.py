"""A vLLM worker extension (`--worker-extension-cls tandemrl.rollout.vllm_worker.WeightLoader`): the
methods the vLLM backend calls on every worker through POST /collective_rpc to take new weights, as
vLLM's RLHF examples extend the worker (examples/offline_inference/rlhf_utils.py), with our own
transport on both sides so the trainer needs no vLLM:

- `tandem_init_weight_group`: join the trainer's weight group (gloo on CPU, NCCL between GPUs) as
  rank `rank_offset + worker rank`, keyed as SGLang keys it (engine/weight_transport.py);
- `tandem_receive_weights`: one bucket, broadcast from rank 0 in the announced order, kept until
- `tandem_finish_update`: load everything received through vLLM's `reload_weights` (layer by layer
  onto fresh parameters, then each layer's weight processing, e.g. the CPU backend's repacking);
- `tandem_load_ipc`: CUDA IPC handles (this worker's `serialized_named_tensors` entry: base64 JSON
  descriptions, never a pickle), opened on the GPU the trainer named by UUID, loaded the same way;
- `tandem_load_safetensors`: a directory of safetensors (the disk fallback).

Every argument is a string, as vLLM's /collective_rpc passes only strings. After any load a tied
`lm_head` is re-tied: the reload rebuilds `lm_head` as a parameter of its own and skips it (tied
checkpoints have no `lm_head.weight`), so without the re-tie the head keeps the old embedding and
greedy output no longer matches the trainer's (seen with SmolLM2); the head's weight processing then
runs again (on CPU it packs a copy of the weight). Invariant: after a finished update the model holds
exactly the pushed weights, and a tied head is the embedding tensor itself.
"""

from __future__ import annotations

import json
from pathlib import Path


class WeightLoader:
    """Mixed into vLLM's worker class (`self` is the worker: `rank`, `device`, `model_runner`)."""

    def tandem_rank(self) -> dict:
        return {"rank": int(self.rank)}

    def tandem_init_weight_group(self, spec_json: str) -> dict:
        from tandemrl.engine.weight_transport import new_process_group

        spec = json.loads(spec_json)
        rank = int(spec["rank_offset"]) + int(self.rank)
        groups = self.__dict__.setdefault("_tandem_groups", {})
        groups[spec["group_name"]] = (
            new_process_group(
                spec["master_address"],
                int(spec["master_port"]),
                rank,
                int(spec["world_size"]),
                spec["group_name"],
                spec["backend"],
            ),
            spec["backend"],
        )
        return {"rank": rank}

    def tandem_receive_weights(self, spec_json: str) -> dict:
        import torch

        from tandemrl.engine.weight_transport import broadcast, parse_dtype

        spec = json.loads(spec_json)
        group, backend = self.__dict__.get("_tandem_groups", {})[spec["group_name"]]
        device = self.device if backend == "nccl" else torch.device("cpu")
        pending = self.__dict__.setdefault("_tandem_pending", [])
        for name, dtype, shape in zip(spec["names"], spec["dtypes"], spec["shapes"], strict=True):
            tensor = torch.empty(shape, dtype=parse_dtype(dtype), device=device)
            broadcast(group, tensor, root=0)
            pending.append((name, tensor))
        return {"num_tensors": len(spec["names"])}

    def tandem_load_ipc(self, entries_json: str) -> dict:
        from tandemrl.engine.weight_transport import rebuild_cuda_tensor
        from tandemrl.engine.weight_updates import decode_ipc_entries

        entries = json.loads(entries_json)
        rank = int(self.rank)
        if rank >= len(entries):
            raise ValueError(f"{len(entries)} serialized_named_tensors entries for worker rank {rank}")
        items = decode_ipc_entries([entries[rank]])
        pending = self.__dict__.setdefault("_tandem_pending", [])
        pending += [(item["name"], rebuild_cuda_tensor(item["tensor"]).clone()) for item in items]
        return {"num_tensors": len(items)}

    def tandem_finish_update(self) -> dict:
        pending = self.__dict__.pop("_tandem_pending", [])
        if pending:
            self.reload_weights(weights_iterator=iter(pending), is_checkpoint_format=True)
        return {"num_tensors": len(pending), "tied": self._tandem_retie()}

    def tandem_load_safetensors(self, path: str) -> bool:
        if not any(Path(path).glob("*.safetensors")):
            raise FileNotFoundError(f"{path!r} holds no *.safetensors file")
        self.reload_weights(weights_path=path, is_checkpoint_format=True)
        return self._tandem_retie()

    def _tandem_retie(self) -> bool:
        model = self.model_runner.get_model()
        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        head, inner = getattr(model, "lm_head", None), getattr(model, "model", None)
        embed = getattr(inner, "embed_tokens", None)
        if tied and head is not None and embed is not None:
            head.weight = embed.weight
            # the head's GEMM was prepared from the old tensor (on CPU: a packed copy); prepare it again
            head.quant_method.process_weights_after_loading(head)
        return bool(tied)
