"""Actor checkpoints with torch.distributed.checkpoint (DCP), written atomically.

Layout of `global_step_N/` (written as `.tmp-global_step_N/`, then renamed, so a crash mid-save leaves
the previous checkpoint untouched and no half-written `global_step_*`):
    actor/           DCP shards of {"model", "optim"} (sharded FQN state dicts, reshardable on load)
    actor/meta.pt    scheduler state, num_updates, weight_version, world_size (rank 0)
    actor/rng_rank{r}.pt   torch (CPU + CUDA) and Python RNG state of rank r
    actor/hf/        config.json, generation config and tokenizer files, for `tandem export`
    <extra files>    e.g. data/data.pt from the runner, written by torch.save before the rename
    manifest.json    the size and SHA-256 of every file above, written last, before the rename
                     (trainer/checkpoint_manifest.py)

Loading unpickles nothing but through a restricted unpickler: DCP's `.metadata` through
`checkpoint_check.RestrictedUnpickler` (DCP's own metadata classes only), its plain-value items and
every .pt file through torch's `weights_only`; and a checkpoint is checked whole before it is loaded
(`verify_checkpoint`, also run at config load for `runner.resume_from` and by `tandem export`).
"""

from __future__ import annotations

import io
import pickle
import random
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tandemrl.trainer.checkpoint_check import (
    CheckpointError,
    load_dcp_metadata,
    verify_checkpoint,
    write_manifest,
)
from tandemrl.trainer.policy import reshard

# the flattened names of the optimizer's param-group hyperparameters (lr, betas, amsgrad, ...)
OPTIM_GROUP_PREFIX = "optim.param_groups."
STEP_DIR_RE = re.compile(r"^global_step_(\d+)$")
# DCP writes a rank's shards as this many files, one thread each (its default is one): a 135M-parameter
# actor with its Adam state (1.6 GB) took 1.3-4.6 s on one thread and 0.8-1.8 s on four, three and four saves on a
# 2-core CPU box (the manifest's hashes, on four threads over the files, 1.0 -> 0.5 s)
WRITE_THREADS = 4
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "added_tokens.json",
)


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"global_step_{step}"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under `output_dir/checkpoints`, or None."""
    root = Path(output_dir) / "checkpoints"
    steps = [(int(m.group(1)), p) for p in root.glob("global_step_*") if (m := STEP_DIR_RE.match(p.name))]
    return max(steps)[1] if steps else None


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_checkpoint(actor, ckpt_dir: str | Path, extra: dict[str, object] | None = None) -> Path:
    """Write the actor (and `extra`: relative path -> object for torch.save) to `ckpt_dir` atomically."""
    final = Path(ckpt_dir)
    tmp = final.parent / f".tmp-{final.name}"
    if actor.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed save
        (tmp / "actor").mkdir(parents=True)
    _barrier()
    reshard(actor.policy)
    model_sd, optim_sd = get_state_dict(actor.policy, actor.optimizer)
    dcp.save(
        {"model": model_sd, "optim": optim_sd},
        storage_writer=FileSystemWriter(str(tmp / "actor"), thread_count=WRITE_THREADS),
    )
    torch.save(_rng_state(), tmp / "actor" / f"rng_rank{actor.rank}.pt")
    if actor.rank == 0:
        torch.save(
            {
                "scheduler": actor.scheduler.state_dict(),
                "num_updates": actor.num_updates,
                "weight_version": actor.weight_version,
                "world_size": actor.world_size,
            },
            tmp / "actor" / "meta.pt",
        )
        _save_hf_files(actor, tmp / "actor" / "hf")
        for rel_path, obj in (extra or {}).items():
            (tmp / rel_path).parent.mkdir(parents=True, exist_ok=True)
            torch.save(obj, tmp / rel_path)
    _barrier()
    if actor.rank == 0:
        write_manifest(tmp)  # every rank's files are written: record their sizes, then commit
        _commit(tmp, final)
    _barrier()
    return final


def _commit(tmp: Path, final: Path) -> None:
    """Rename into place; an existing checkpoint of the same step is replaced only once the new one is whole."""
    old = final.parent / f".old-{final.name}"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _save_hf_files(actor, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    actor.policy.hf.config.save_pretrained(out)
    generation_config = getattr(actor.policy.hf, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(out)
    if actor.model_path is not None:
        for name in TOKENIZER_FILES:
            if (Path(actor.model_path) / name).is_file():
                shutil.copy2(Path(actor.model_path) / name, out / name)


class SafeReader(FileSystemReader):
    """DCP's file reader, its `.metadata` pickle read through the restricted unpickler."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as handle:
            metadata = load_dcp_metadata(handle, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class PlainValuesPlanner(DefaultLoadPlanner):
    """DCP's planner, except that non-tensor items (optimizer hyperparameters) are read with torch's
    weights_only unpickler (DCP's own planner reads them with weights_only=False), and a hyperparameter
    the checkpoint lacks keeps the new optimizer's value: a run saved with `actor.param_dtype=bfloat16`
    (trainer/low_precision.py's AdamW) resumes in fp32 under torch's AdamW, whose groups also hold
    `amsgrad`, `foreach` and the like. Any other missing key (a weight, a moment) still fails the load."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is None:
            return
        saved = metadata.state_dict_metadata
        for fqn in [k for k in self.state_dict if k.startswith(OPTIM_GROUP_PREFIX) and k not in saved]:
            del self.state_dict[fqn]

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = load_plain(value, f"checkpoint item {read_item.dest_index.fqn!r}")
        again = io.BytesIO()
        torch.save(obj, again)  # plain values only now: DCP's own load of them runs nothing
        again.seek(0)
        super().load_bytes(read_item, again)


def load_plain(file, where: str):
    """torch.load(weights_only=True), its refusal worded for a checkpoint (torch's suggests turning
    the protection off)."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{where} holds objects other than tensors and plain values ({str(error).splitlines()[0][:200]}); "
            "refused, nothing was loaded. Use a checkpoint written by `tandem train`."
        ) from None
    except (RuntimeError, EOFError, ValueError) as error:
        raise CheckpointError(f"{where} cannot be read ({type(error).__name__}): it is damaged.") from None


def dcp_load(state: dict, actor_dir: Path) -> None:
    """dcp.load of `state` from `actor_dir`, unpickling nothing unrestricted."""
    dcp.load(state, storage_reader=SafeReader(str(actor_dir)), planner=PlainValuesPlanner())


def load_checkpoint(actor, ckpt_dir: str | Path) -> None:
    """Restore model, optimizer, scheduler, counters and this rank's RNG from `ckpt_dir`."""
    actor_dir = Path(ckpt_dir) / "actor"
    if not (actor_dir / "meta.pt").is_file():
        raise FileNotFoundError(
            f"{str(ckpt_dir)!r} is not an actor checkpoint (no actor/meta.pt). Pass a "
            "global_step_N directory written by the actor, e.g. runs/<name>/checkpoints/"
            "global_step_10."
        )
    verify_checkpoint(ckpt_dir, need_data=False)
    reshard(actor.policy)
    model_sd, optim_sd = get_state_dict(actor.policy, actor.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp_load(state, actor_dir)
    set_state_dict(
        actor.policy, actor.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    meta = load_plain(actor_dir / "meta.pt", str(actor_dir / "meta.pt"))
    actor.scheduler.load_state_dict(meta["scheduler"])
    actor.num_updates = meta["num_updates"]
    actor.weight_version = meta["weight_version"]
    rng_file = actor_dir / f"rng_rank{actor.rank}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than saved: fresh RNG for the new ones
        _set_rng_state(load_plain(rng_file, str(rng_file)))


def load_extra(ckpt_dir: str | Path, rel_path: str) -> object:
    """An object written through `save_checkpoint(..., extra={rel_path: obj})` (plain data only)."""
    return load_plain(Path(ckpt_dir) / rel_path, str(Path(ckpt_dir) / rel_path))


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
