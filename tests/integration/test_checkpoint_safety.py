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
from tandemrl.commands.preflight import check_startable
from tandemrl.config.loader import load_config
from tandemrl.config.schema import ConfigError
from tandemrl.trainer.actor import Actor
from tandemrl.trainer.checkpoint import checkpoint_dir
from tandemrl.trainer.checkpoint_check import CheckpointError, verify_checkpoint, write_manifest
from tests.integration.trainer_helpers import cpu_actor_setup, make_samples
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
    actor = Actor(cpu_actor_setup(tiny_llama_dir, *OVERRIDES))
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
        check_startable(load_config(ASYNC, [f"runner.resume_from={copy}"]))
    actor = Actor(cpu_actor_setup(tiny_llama_dir, *OVERRIDES))
    with pytest.raises(CheckpointError, match="would call .*system"):
        actor.load_checkpoint(copy)
    assert not marker.exists() and not (tmp_path / "exported").exists()


def test_a_shard_item_that_runs_code_is_refused(copy, tiny_llama_dir, tmp_path):
    marker = tmp_path / "created-by-the-shard"
    _craft_shard_item(copy, marker)
    with pytest.raises(ConfigError, match="optim.param_groups.0.lr.*would call .*system"):
        check_startable(load_config(ASYNC, [f"runner.resume_from={copy}"]))
    actor = Actor(cpu_actor_setup(tiny_llama_dir, *OVERRIDES))
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
    assert all(manifest["files"][rel]["size"] == (saved / rel).stat().st_size for rel in files)
    assert all(manifest["files"][rel]["sha256"] == _sha256(saved / rel) for rel in files)
    verify_checkpoint(saved)  # raises on any problem


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- every byte checked (issue 42, item 1) ----------------------------------------------------------


def _item(ckpt: Path, fqn: str):
    """(shard path, offset, length) of item `fqn` in the genuine .metadata."""
    metadata = _dcp_metadata(ckpt)
    info = next(s for i, s in metadata.storage_data.items() if i.fqn == fqn)
    return ckpt / "actor" / info.relative_path, info.offset, info.length


EMBED = "model.hf.model.embed_tokens.weight"  # 49152 x 64 float32: a 12 MB item


def _overwrite_inside(ckpt: Path, fqn: str, payload: bytes) -> Path:
    shard, offset, length = _item(ckpt, fqn)
    assert length > 1 << 20 and len(payload) < length // 2
    data = bytearray(shard.read_bytes())
    middle = offset + length // 2
    data[middle : middle + len(payload)] = payload
    _rewrite(shard, bytes(data))
    return shard


@pytest.mark.parametrize(
    "payload", [b"\xff\xff\xc0\x7f" * 256, bytes(range(256)) * 4], ids=["NaN floats", "garbage bytes"]
)
def test_damaged_bytes_inside_a_large_tensor_are_refused_by_resume_and_export(
    payload, copy, tmp_path, capsys
):
    shard = _overwrite_inside(copy, EMBED, payload)
    code = main(["config", "show", str(ASYNC), f"runner.resume_from={copy}"])
    err = capsys.readouterr().err
    assert (
        code == 2 and str(shard) in err and "sha256 differs" in err and len(err.strip().splitlines()) == 1
    ), err
    code = main(["export", str(copy), "--out", str(tmp_path / "exported")])
    err = capsys.readouterr().err
    assert code == 2 and str(shard) in err and "Traceback" not in err, err
    assert not (tmp_path / "exported").exists()


def _swap_entries(ckpt: Path, first: str, second: str) -> None:
    metadata = _dcp_metadata(ckpt)
    by_fqn = {i.fqn: i for i in metadata.storage_data}
    a, b = by_fqn[first], by_fqn[second]
    metadata.storage_data[a], metadata.storage_data[b] = metadata.storage_data[b], metadata.storage_data[a]
    _rewrite(ckpt / "actor" / ".metadata", pickle.dumps(metadata))


LAYER0_Q, LAYER1_Q = (f"model.hf.model.layers.{i}.self_attn.q_proj.weight" for i in (0, 1))
NORM = "model.hf.model.norm.weight"


def _manifest_sizes_to_match(ckpt: Path) -> None:
    """What the issue's attacker did: every size in the manifest made to match (the hashes left)."""
    import json

    manifest = json.loads((ckpt / "manifest.json").read_text())
    for rel, entry in manifest["files"].items():
        if isinstance(entry, dict):
            entry["size"] = (ckpt / rel).stat().st_size
        else:
            manifest["files"][rel] = (ckpt / rel).stat().st_size
    (ckpt / "manifest.json").unlink()
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


SWAPS = {
    # two tensors of one shape: only the hash of .metadata tells
    "same shape, manifest sizes to match": (LAYER0_Q, LAYER1_Q, _manifest_sizes_to_match, "actor/.metadata"),
    # a whole new manifest, hashes included: the shapes .metadata records tell
    "other shapes, whole manifest rewritten": (EMBED, NORM, _write_manifest, "records shape"),
    "optimizer state, whole manifest rewritten": (
        "optim.state.hf.model.norm.weight.exp_avg",
        "optim.state.hf.model.embed_tokens.weight.exp_avg",
        _write_manifest,
        "records shape",
    ),
}


@pytest.mark.parametrize("case", SWAPS)
def test_swapped_metadata_entries_are_refused(case, copy, capsys):
    first, second, manifest, named = SWAPS[case]
    _swap_entries(copy, first, second)
    manifest(copy)
    code = main(["config", "show", str(ASYNC), f"runner.resume_from={copy}"])
    err = capsys.readouterr().err
    assert code == 2 and named in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("fqn", [EMBED, "optim.param_groups.0.lr"])
def test_a_value_without_stored_bytes_is_refused(fqn, copy, tmp_path, capsys):
    metadata = _dcp_metadata(copy)
    del metadata.storage_data[next(i for i in metadata.storage_data if i.fqn == fqn)]
    _rewrite(copy / "actor" / ".metadata", pickle.dumps(metadata))
    _write_manifest(copy)  # the whole manifest made to match
    code = main(["export", str(copy), "--out", str(tmp_path / "exported")])
    err = capsys.readouterr().err
    assert code == 2 and f"{fqn!r} has no stored item" in err and "Traceback" not in err, err


def _old_manifest(ckpt: Path) -> None:
    import json

    files = {
        str(p.relative_to(ckpt)): p.stat().st_size
        for p in ckpt.rglob("*")
        if p.is_file() and p.name != "manifest.json"
    }
    (ckpt / "manifest.json").unlink()
    (ckpt / "manifest.json").write_text(json.dumps({"format": 1, "files": files}))


UNCHECKABLE = {
    # without hashes nothing would tell the damaged tensor: the checkpoint is refused whole
    "no manifest": lambda c: (c / "manifest.json").unlink(),
    "a sizes-only manifest": _old_manifest,
}


@pytest.mark.parametrize("case", UNCHECKABLE)
def test_a_checkpoint_whose_bytes_cannot_be_checked_is_refused(case, copy, tmp_path, capsys):
    _overwrite_inside(copy, EMBED, b"\x00" * 64)
    UNCHECKABLE[case](copy)
    code = main(["export", str(copy), "--out", str(tmp_path / "exported")])
    err = capsys.readouterr().err
    assert code == 2 and "manifest.json" in err and "cannot be checked" in err, err


def test_damage_to_a_file_nothing_parses_is_refused(copy, capsys):
    """The tokenizer files are copied into an export as they are: their bytes are checked too."""
    path = copy / "actor" / "hf" / "tokenizer.json"
    _rewrite(path, path.read_bytes().replace(b'"', b"'", 1))
    code = main(["config", "show", str(ASYNC), f"runner.resume_from={copy}"])
    err = capsys.readouterr().err
    assert code == 2 and "actor/hf/tokenizer.json" in err and "sha256" in err, err


def test_a_file_the_save_did_not_write_is_refused(copy, capsys):
    (copy / "actor" / "hf" / "added_tokens.json").write_text('{"<x>": 1}')
    code = main(["config", "show", str(ASYNC), f"runner.resume_from={copy}"])
    err = capsys.readouterr().err
    assert code == 2 and "added_tokens.json was not written at save" in err, err


def _manifest_of_what_is_there(ckpt: Path) -> None:
    """A manifest of every file as it reads now, links followed: an attacker's, made to match."""
    import json

    files = {
        str(p.relative_to(ckpt)): {"size": len(p.read_bytes()), "sha256": _sha256(p)}
        for p in sorted(ckpt.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }
    (ckpt / "manifest.json").unlink()
    (ckpt / "manifest.json").write_text(json.dumps({"format": 2, "hash": "sha256", "files": files}))


# ---- only regular files inside the checkpoint (item 4) -----------------------------------------------


def _link_tokenizer(ckpt: Path, outside: Path) -> None:
    outside.write_text('{"secret": "read through a link"}')
    (ckpt / "actor" / "hf" / "tokenizer.json").unlink()
    (ckpt / "actor" / "hf" / "tokenizer.json").symlink_to(outside)


def _link_hf_dir(ckpt: Path, outside: Path) -> None:
    shutil.copytree(ckpt / "actor" / "hf", outside)
    shutil.rmtree(ckpt / "actor" / "hf")
    (ckpt / "actor" / "hf").symlink_to(outside, target_is_directory=True)


def _fifo_data(ckpt: Path, outside: Path) -> None:
    (ckpt / "data" / "data.pt").unlink()
    os.mkfifo(ckpt / "data" / "data.pt")  # opened for reading, it would wait for a writer forever


SPECIAL = {
    "a tokenizer file linked outside": (_link_tokenizer, "actor/hf/tokenizer.json is a symbolic link"),
    "actor/hf linked outside": (_link_hf_dir, "actor/hf is a symbolic link"),
    "a FIFO for data.pt": (_fifo_data, "data/data.pt is a FIFO"),
}


@pytest.mark.parametrize("case", SPECIAL)
def test_links_and_special_files_are_refused_by_export_and_resume(case, copy, tmp_path, capsys):
    make, named = SPECIAL[case]
    make(copy, tmp_path / "outside")
    if "FIFO" not in case:
        _manifest_of_what_is_there(copy)
    for argv in (
        ["config", "show", str(ASYNC), f"runner.resume_from={copy}"],
        ["export", str(copy), "--out", str(tmp_path / "exported")],
    ):
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2 and named in err and len(err.strip().splitlines()) == 1, (argv[0], err)
    assert not (tmp_path / "exported").exists()


# ---- bounded expansion of data.pt and meta.pt (item 5) -------------------------------------------------


def _deflated(path: Path, payload_bytes: int) -> None:
    """The torch.save archive at `path` rewritten with its data.pkl deflated and grown to
    `payload_bytes` when inflated: a small file that expands (a zip bomb)."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        members = [(info.filename, archive.read(info)) for info in archive.infolist()]
    path.unlink()
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in members:
            if name.endswith("data.pkl"):
                data = pickle.dumps("a" * payload_bytes, protocol=2)
            archive.writestr(name, data)


@pytest.mark.parametrize("rel", ["data/data.pt", "actor/meta.pt"])
def test_a_compressed_archive_is_refused_before_it_expands(rel, copy, tmp_path, capsys):
    _deflated(copy / rel, 64 << 20)
    assert (copy / rel).stat().st_size < 1 << 20
    _manifest_of_what_is_there(copy)
    output_dir = tmp_path / "run"
    for argv in (
        ["config", "show", str(ASYNC), f"runner.resume_from={copy}"],
        ["train", str(ASYNC), f"runner.resume_from={copy}", f"runner.output_dir={output_dir}"],
        ["export", str(copy), "--out", str(tmp_path / "exported")],
    ):
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2 and rel in err and "is compressed" in err, (argv[0], err)
    assert not output_dir.exists() and not (tmp_path / "exported").exists()


def test_a_pickle_over_the_bound_is_refused_unread(copy, monkeypatch, capsys):
    import tandemrl.trainer.checkpoint_check as check

    (copy / "data" / "data.pt").unlink()
    torch.save({"step": 1, "ids": ["x" * 65536]}, copy / "data" / "data.pt")
    _manifest_of_what_is_there(copy)
    monkeypatch.setattr(check, "MAX_PICKLE_BYTES", 1 << 15)
    code = main(["config", "show", str(ASYNC), f"runner.resume_from={copy}"])
    err = capsys.readouterr().err
    assert code == 2 and "data/data.pt" in err and "over the 32768 bytes" in err, err


# ---- config.json against the weights (item 9) -----------------------------------------------------------


def _edit_config(**changes):
    def edit(ckpt: Path) -> None:
        import json

        path = ckpt / "actor" / "hf" / "config.json"
        config = {**json.loads(path.read_text()), **changes}
        _rewrite(path, json.dumps(config).encode())

    return edit


CONFIG_EDITS = {
    "narrower": (_edit_config(hidden_size=32, head_dim=8), "disagrees with the checkpoint's weights"),
    "deeper": (
        _edit_config(num_hidden_layers=3),
        "layers.2.self_attn.q_proj.weight is missing from the weights",
    ),
    "absurd sizes": (_edit_config(hidden_size=10**9, intermediate_size=10**9), "disagrees"),
    "unknown model type": (_edit_config(model_type="no-such-model"), "does not describe a model"),
}


@pytest.mark.parametrize("case", CONFIG_EDITS)
def test_export_refuses_a_config_that_disagrees_with_the_weights(case, copy, tmp_path, capsys):
    edit, named = CONFIG_EDITS[case]
    edit(copy)
    _manifest_of_what_is_there(copy)  # the config changed on purpose, its hash recorded to match
    code = main(["export", str(copy), "--out", str(tmp_path / "exported")])
    err = capsys.readouterr().err
    assert code == 2 and "config.json" in err and named in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "exported").exists()
