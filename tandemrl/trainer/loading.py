"""The actor's model loading: shards filled from the checkpoint, never a full fp32 copy per rank.

One rank: `from_pretrained` in the weights' dtype (`actor.param_dtype`: fp32 masters, or bf16, which halves
the host copy) on the host, then onto the device: one copy.
Several ranks (FSDP2): every rank builds the model with its parameters on the meta device (shapes and ties,
no memory) and its buffers real (the rotary embedding's inverse frequencies are computed at construction,
not stored), shards it (`policy.shard_policy`) and gives its shards empty storage on the device
(`to_empty`, the buffers put back). Then rank 0 reads the checkpoint's safetensors tensor by tensor, in
chunks of rows of about `CHUNK_BYTES` (cast to fp32; each read through a handle of its own, so the file's
pages do not stay mapped), and broadcasts each chunk; every rank copies the rows of its own shard (a bf16
shard rounds them to nearest as it copies). So a node's host memory holds the shards (where they live on the host) and one chunk per rank, whatever the
model and the number of ranks: on the CPU, 2 ranks loading a 34.6 M-parameter model peaked at 1.58 fp32
copies in all, where each rank loading the whole model took 2.27 (`tests/integration/test_actor_ranks_ray.py`). Rank 0 reads and broadcasts rather than each rank reading its own rows: a sharded or converted
checkpoint need not store a rank's rows in one file, and one reader keeps the file access simple; the
broadcast is one pass over the model, once per run.
A checkpoint whose tensor names are not the model's own (transformers renames some on load) takes the
fallback: rank 0 loads the whole model with `from_pretrained` (one copy in param_dtype on its node) and broadcasts it
the same way. The reference model (`algorithm.kl_coef > 0`) is built and filled the same way, never
deep-copied per rank.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

CHUNK_BYTES = 64 * 2**20  # fp32 bytes of one broadcast: rows of one tensor, read by rank 0 on demand


def check_model_dir(model_path: str | Path) -> Path:
    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"actor model directory {str(path)!r} has no config.json. Set "
            "actor.model.model_path to a Hugging Face model directory, or run "
            "`tandem prepare model` for the embedded default."
        )
    return path


def load_hf_model(
    model_path: str | Path, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32
):
    """The HF model in `dtype` (the actor's param_dtype) on the host (one rank, and the fallback's rank 0)."""
    from transformers import AutoModelForCausalLM

    from tandemrl.host.hf import hf_load_kwargs

    path = check_model_dir(model_path)
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, **hf_load_kwargs()
    )


def build_on_meta(config, attn_implementation: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The HF model of `config` (a transformers config), its parameters in `dtype` on the meta device (shapes
    and ties, no memory) and its buffers real on the host: they are computed at construction (the rotary
    embedding's inverse frequencies, fp32 whatever `dtype`), not stored in a checkpoint."""
    from transformers import AutoModelForCausalLM

    with _parameters_on_meta():
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)


@contextmanager
def _parameters_on_meta():
    """Every parameter a module registers moves to the meta device as it is registered (its initialisation
    then runs on meta, at no cost); a parameter already there (a tie) is kept as it is."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def read_config(model_path: str | Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(check_model_dir(model_path))


class CheckpointSource:
    """Where a sharded model's weights come from, on rank 0: a model directory (its safetensors read a chunk
    of rows at a time, or the fallback's whole model), or a model already in memory (tests)."""

    def __init__(
        self,
        model_path: str | Path | None = None,
        model: nn.Module | None = None,
        attn_implementation: str = "sdpa",
        dtype: torch.dtype = torch.float32,
    ):
        """`dtype`: the actor's param_dtype, the fallback's whole model's (what it is rounded to anyway)."""
        assert (model_path is None) != (model is None), "a source is a model directory or a model"
        self.model_path, self.model, self.attn_implementation = model_path, model, attn_implementation
        self.dtype = dtype
        self._fallback: nn.Module | None = None

    def tensors(self, names: set[str], tied: set[str]) -> Iterator[tuple[str, torch.Size, RowReader]]:
        """(name, shape, rows(start, end) -> fp32 host tensor) for the model's `names` the source holds.
        `tied`: names that share another name's parameter and may be absent from a checkpoint."""
        if self.model is not None:
            yield from _in_memory(self.model.state_dict(), names)
            return
        files = safetensors_files(Path(self.model_path))
        stored = _stored_tensors(files)
        if files and names - tied <= set(stored):
            for name, (file, shape) in stored.items():
                if name in names:
                    yield name, shape, _file_rows(file, name)
            return
        # names the checkpoint does not store as the model does: transformers' own loading converts them
        if self._fallback is None:
            self._fallback = load_hf_model(self.model_path, self.attn_implementation, self.dtype)
        yield from _in_memory(self._fallback.state_dict(), names)

    def close(self) -> None:
        self._fallback = None


RowReader = Callable[[int, int], torch.Tensor]


def safetensors_files(path: Path) -> list[Path]:
    """The model's safetensors files: the index's shards, or the one `model.safetensors`; [] if neither."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    single = path / "model.safetensors"
    return [single] if single.is_file() else []


def _stored_tensors(files: list[Path]) -> dict[str, tuple[Path, torch.Size]]:
    """Every stored tensor's file and shape, from the files' headers (no tensor is read)."""
    from safetensors import safe_open

    stored: dict[str, tuple[Path, torch.Size]] = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                stored[name] = (file, torch.Size(handle.get_slice(name).get_shape()))
    return stored


def _file_rows(file: Path, name: str) -> RowReader:
    """Rows of a stored tensor, read through a handle of their own: a handle maps its file, and the pages it
    read stay resident (counted in the process's memory) until it closes."""
    from safetensors import safe_open

    def rows(start: int, end: int) -> torch.Tensor:
        with safe_open(file, framework="pt") as handle:
            part = handle.get_slice(name)
            tensor = part[start:end] if part.get_shape() else handle.get_tensor(name)
        return tensor.to(torch.float32)

    return rows


def _in_memory(
    state: dict[str, torch.Tensor], names: set[str]
) -> Iterator[tuple[str, torch.Size, RowReader]]:
    for name, tensor in state.items():
        if name in names:
            held = tensor.detach()
            yield (
                name,
                held.shape,
                lambda start, end, held=held: _rows(held, start, end).to("cpu", torch.float32),
            )


def _rows(tensor: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return tensor[start:end] if tensor.dim() else tensor


def tied_names(hf: nn.Module) -> set[str]:
    """State-dict names whose parameter another, earlier name already holds (tied embeddings)."""
    seen: set[int] = set()
    tied: set[str] = set()
    for name, param in hf.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.add(id(param))
    return tied


def to_empty_keeping_buffers(model: nn.Module, device: torch.device) -> None:
    """`model.to_empty(device=device)` (fresh, uninitialised storage for every tensor), its buffers' values
    put back: a `build_on_meta` model computed them at construction, and no checkpoint stores them."""
    buffers = {name: buffer.detach().to("cpu", copy=True) for name, buffer in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])


def materialize(
    model: nn.Module, hf: nn.Module, source: CheckpointSource | None, device: torch.device
) -> None:
    """Give sharded `model` (whose HF module is `hf`, from `build_on_meta`) real storage on `device`, keeping
    its buffers, then rank 0's weights (`source`; None on the other ranks), each tensor broadcast in chunks
    of rows and each rank keeping the rows of its own shard."""
    to_empty_keeping_buffers(model, device)
    targets = dict(hf.state_dict(keep_vars=True))
    tied = tied_names(hf)
    # gloo sends host tensors, NCCL device ones
    wire = torch.device("cpu") if dist.get_backend() == "gloo" else device
    tensors = source.tensors(set(targets), tied) if dist.get_rank() == 0 else iter(())
    loaded: set[str] = set()
    while True:
        item = next(tensors, None)
        header = [None if item is None else (item[0], tuple(item[1]))]  # rank 0 names the next tensor
        dist.broadcast_object_list(header, src=0)
        if header[0] is None:
            break
        name, shape = header[0]
        _scatter_rows(targets[name], torch.Size(shape), item[2] if item is not None else None, wire)
        loaded.add(name)
    missing = [sorted(set(targets) - loaded - tied)[:5]]
    dist.broadcast_object_list(missing, src=0)  # every rank fails alike, none waits on the others
    if missing[0]:
        where = source.model_path if source is not None else "rank 0's model directory"
        raise ValueError(f"the actor's checkpoint ({where}) holds no {missing[0]}: it is not this model's")


def _scatter_rows(
    target: torch.Tensor, shape: torch.Size, rows: RowReader | None, wire: torch.device
) -> None:
    """Broadcast a full tensor of `shape` from rank 0 (`rows` reads it there) in chunks of about
    CHUNK_BYTES, and copy into `target` (an FSDP2 parameter sharded on dim 0, or a plain tensor) the rows
    that fall in this rank's part."""
    if tuple(target.shape) != tuple(shape):
        raise ValueError(
            f"the checkpoint's tensor of shape {tuple(shape)} does not fit the model's {tuple(target.shape)}"
        )
    local, first = _local_rows(target)
    num_rows = shape[0] if len(shape) else 1
    row_numel = max(1, math.prod(shape[1:])) if len(shape) else 1
    step = max(1, CHUNK_BYTES // (4 * row_numel))
    with torch.no_grad():
        for start in range(0, num_rows, step):
            end = min(num_rows, start + step)
            chunk_shape = (end - start, *shape[1:]) if len(shape) else ()
            if dist.get_rank() == 0:
                chunk = rows(start, end).to(wire).contiguous()
            else:
                chunk = torch.empty(chunk_shape, dtype=torch.float32, device=wire)
            dist.broadcast(chunk, src=0)
            if not len(shape):
                local.copy_(chunk)
                continue
            lo, hi = max(start, first), min(end, first + local.shape[0])
            if lo < hi:
                local[lo - first : hi - first].copy_(chunk[lo - start : hi - start])


def _local_rows(target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's part of `target`, the global index of its first row). FSDP2 shards dim 0 as
    `torch.chunk` does: ceil(rows / ranks) rows each, the last ranks fewer or none."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(target, DTensor):
        return target.data, 0
    if tuple(target.placements) != (Shard(0),):
        raise ValueError(
            f"a sharded parameter placed {target.placements}; the loader expects FSDP2's Shard(0)"
        )
    local = target.to_local()
    rank, world = target.device_mesh.get_local_rank(), target.device_mesh.size()
    per_rank = -(-target.shape[0] // world)
    first = min(rank * per_rank, target.shape[0])
    assert local.shape[0] == max(0, min(per_rank, target.shape[0] - first)), "FSDP2 sharded dim 0 otherwise"
    return local, first
