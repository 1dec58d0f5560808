"""A checkpoint cannot run code, and a damaged one is refused whole before anything starts
(docs/RELIABILITY.md, rows 14 and 15). One real checkpoint of a tiny actor is saved once; each test
alters a copy (hard links, every altered file written anew) the way an attacker or a full disk would.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from tandemrl.cli import main
from tandemrl.config.loader import load_config
from tandemrl.config.schema import ConfigError
from tandemrl.trainer.actor import Actor
from tandemrl.trainer.checkpoint import checkpoint_dir
from tandemrl.trainer.checkpoint_check import CheckpointError, verify_checkpoint, write_manifest
from tests.integration.trainer_helpers import actor_config, make_samples
from tests.unit.test_config import ASYNC

OVERRIDES = ("actor.optim.lr=0.001", "algorithm.n_minibatches=2", "actor.micro_batch_tokens=96")


class RunsCode:
    """Unpickling this runs `touch <marker>`: what a crafted checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def saved(tiny_llama_dir, tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    actor = Actor(actor_config(tiny_llama_dir, *OVERRIDES))
    actor.train_step(make_samples(seed=0, num_samples=4))
    root = tmp_path_factory.mktemp("saved")
    return actor.save_checkpoint(checkpoint_dir(root, 1), extra={"data/data.pt": {"step": 1, "ids": ["a"]}})


@pytest.fixture
def copy(saved, tmp_path) -> Path:
    """A copy of the saved checkpoint whose files are hard links: alter files only through `_rewrite`."""
    target = tmp_path / "global_step_1"
    shutil.copytree(saved, target, copy_function=os.link)
    return target


def _rewrite(path: Path, data: bytes) -> None:
    path.unlink()  # break the hard link: the saved checkpoint stays as it was
    path.write_bytes(data)


def _write_manifest(ckpt: Path) -> None:
    (ckpt / "manifest.json").unlink(missing_ok=True)  # a hard link too
    write_manifest(ckpt)


def _dcp_metadata(ckpt: Path):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(ckpt / "actor")).read_metadata()  # the genuine file: safe to load here


def _craft_metadata(ckpt: Path, marker: Path) -> None:
    """Genuine DCP metadata with one more attribute, an object that runs code when unpickled."""
    metadata = _dcp_metadata(ckpt)
    metadata.planner_data = RunsCode(marker)
    _rewrite(ckpt / "actor" / ".metadata", pickle.dumps(metadata))
    _write_manifest(ckpt)  # an attacker writes a matching manifest too


def _craft_shard_item(ckpt: Path, marker: Path) -> None:
    """An optimizer hyperparameter item (read with weights_only=False by DCP) pointed at a pickle that
    runs code, appended to the shard."""
    metadata = _dcp_metadata(ckpt)
    (index, info) = next(
        (i, s) for i, s in metadata.storage_data.items() if i.fqn == "optim.param_groups.0.lr"
    )
    shard = ckpt / "actor" / info.relative_path
    payload = pickle.dumps(RunsCode(marker))
    data = shard.read_bytes()
    _rewrite(shard, data + payload)
    info.offset, info.length = len(data), len(payload)
    _rewrite(ckpt / "actor" / ".metadata", pickle.dumps(metadata))
    _write_manifest(ckpt)


def test_metadata_that_runs_code_is_refused_by_export_resume_and_load(copy, tiny_llama_dir, tmp_path, capsys):
    marker = tmp_path / "created-by-the-checkpoint"
    _craft_metadata(copy, marker)
    code = main(["export", str(copy), "--out", str(tmp_path / "exported")])
    err = capsys.readouterr().err
    assert code == 2 and "os.system" in err.replace("posix.system", "os.system") and "Refused" in err, err
    with pytest.raises(ConfigError, match="would call .*system when unpickled"):
        load_config(ASYNC, [f"runner.resume_from={copy}"])
    actor = Actor(actor_config(tiny_llama_dir, *OVERRIDES))
    with pytest.raises(CheckpointError, match="would call .*system"):
        actor.load_checkpoint(copy)
    assert not marker.exists() and not (tmp_path / "exported").exists()


def test_a_shard_item_that_runs_code_is_refused(copy, tiny_llama_dir, tmp_path):
    marker = tmp_path / "created-by-the-shard"
    _craft_shard_item(copy, marker)
    with pytest.raises(ConfigError, match="optim.param_groups.0.lr.*would call .*system"):
        load_config(ASYNC, [f"runner.resume_from={copy}"])
    actor = Actor(actor_config(tiny_llama_dir, *OVERRIDES))
    with pytest.raises(CheckpointError, match="would call .*system"):
        actor.load_checkpoint(copy)
    assert not marker.exists()


def _truncate(rel: str):
    def damage(ckpt: Path, marker: Path) -> None:
        path = ckpt / rel
        _rewrite(path, path.read_bytes()[: path.stat().st_size // 2])

    return damage


def _pickled_data(ckpt: Path, marker: Path) -> None:
    _rewrite(ckpt / "data" / "data.pt", pickle.dumps(RunsCode(marker)))


def _pickled_data_and_manifest(ckpt: Path, marker: Path) -> None:
    """As an attacker would: the manifest rewritten to match, so only the restricted unpickler stands."""
    _pickled_data(ckpt, marker)
    _write_manifest(ckpt)


def _garbage_meta(ckpt: Path, marker: Path) -> None:
    _rewrite(ckpt / "actor" / "meta.pt", os.urandom(1499))


def _missing_shard(ckpt: Path, marker: Path) -> None:
    (ckpt / "actor" / "__0_0.distcp").unlink()


def _grown_data(ckpt: Path, marker: Path) -> None:
    path = ckpt / "data" / "data.pt"
    _rewrite(path, path.read_bytes() + b"\0" * 16)


def _truncated_shard_without_manifest(ckpt: Path, marker: Path) -> None:
    """A checkpoint from before manifests: the extents .metadata records still catch it."""
    (ckpt / "manifest.json").unlink()
    _truncate("actor/__0_0.distcp")(ckpt, marker)


DAMAGE = {
    "truncated data.pt": (_truncate("data/data.pt"), "data/data.pt"),
    "pickled data.pt": (_pickled_data, "data/data.pt"),
    "pickled data.pt, manifest to match": (_pickled_data_and_manifest, "data.pt would call posix.system"),
    "truncated shard": (_truncate("actor/__0_0.distcp"), "__0_0.distcp"),
    "garbage meta.pt": (_garbage_meta, "actor/meta.pt"),
    "missing shard": (_missing_shard, "__0_0.distcp"),
    "grown data.pt": (_grown_data, "data/data.pt"),
    "truncated rng state": (_truncate("actor/rng_rank0.pt"), "rng_rank0.pt"),
    "truncated .metadata": (_truncate("actor/.metadata"), ".metadata"),
    "truncated shard, no manifest": (_truncated_shard_without_manifest, "__0_0.distcp"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_checkpoint_is_refused_at_load_naming_the_file(case, copy, tmp_path, capsys):
    damage, named = DAMAGE[case]
    marker = tmp_path / "created"
    damage(copy, marker)
    code = main(["config", "show", str(ASYNC), f"runner.resume_from={copy}"])
    err = capsys.readouterr().err
    assert code == 2 and named in err and "runner.resume_from" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "weights_only=False" not in err and not marker.exists()


def test_train_refuses_a_damaged_checkpoint_before_anything_starts(copy, tmp_path, capsys):
    _truncate("actor/__0_0.distcp")(copy, tmp_path / "unused")
    output_dir = tmp_path / "run"
    code = main(["train", str(ASYNC), f"runner.resume_from={copy}", f"runner.output_dir={output_dir}"])
    err = capsys.readouterr().err
    assert code == 2 and "__0_0.distcp" in err and "truncated" in err, err
    assert not output_dir.exists()  # nothing was started: the run did not even make its directory


def test_a_saved_checkpoint_records_every_file_and_passes_the_check(saved):
    import json

    manifest = json.loads((saved / "manifest.json").read_text())
    files = {str(p.relative_to(saved)) for p in saved.rglob("*") if p.is_file() and p.name != "manifest.json"}
    assert set(manifest["files"]) == files and {"actor/.metadata", "data/data.pt"} <= files
    assert all(manifest["files"][rel] == (saved / rel).stat().st_size for rel in files)
    verify_checkpoint(saved)  # raises on any problem
