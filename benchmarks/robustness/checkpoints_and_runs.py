"""Hostile-input probe for checkpoints and concurrent runs (issue 42, items 1-5 and 9).

- every byte checked (1): NaN, garbage and zeros inside the largest tensor, a changed byte in a file
  nothing parses (tokenizer.json), in config.json, meta.pt and an RNG file, `.metadata` entries
  swapped (the manifest's sizes made to match, or the whole manifest rewritten), or removed, the manifest removed,
  a sizes-only manifest, a file added after the save, a nested-JSON and a 70 MB manifest;
- runs that cannot collide (2, 3): a second `tandem train` on a running run's output directory, and on
  the index its retrieval server has open; a run killed with -9, then a new run on its directory;
- only regular files inside the checkpoint (4): a tokenizer file, `actor/hf/` and a shard linked
  outside, `meta.pt` linked to /dev/zero, a FIFO as data.pt and as an extra tokenizer file, a socket;
- bounded expansion (5): deflated archives that inflate to 3 GB as data.pt (config show, train,
  export), meta.pt, an RNG file and a shard item, under a 4 GB address-space cap;
- config.json against the weights (9): narrower, deeper, another vocabulary, absurd sizes, an unknown
  model type, a JSON list, a 100,000-level nesting.

Every case runs in a real process (`tandem config show`, `tandem train`, `tandem export`), with the
classification of pickles_indexes_and_limits.py (whose harness this reuses): refused in a message naming
the expected file or key is clear; a traceback or a killed process is a crash; no answer in time a
hang; exit 0 an accepted input. A loss is anything already written that a refused command changed:
the model an export would replace, the running run's metrics and config, the checkpoint itself.

    python -m benchmarks.robustness.checkpoints_and_runs [--out benchmarks/results/robustness/hostile_checkpoints_and_runs.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from pathlib import Path

from benchmarks import write_json
from benchmarks.robustness import (
    pickles_indexes_and_limits as base,  # the harness: record, classify, tandem, checkpoints
)

ROOT = Path(__file__).resolve().parents[2]

CONFIG = base.CONFIG
losses: list[str] = []
EMBED = "model.hf.model.embed_tokens.weight"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree_digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): _sha(p)
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def _manifest_as_now(ckpt: Path) -> None:
    """The attacker's manifest: every file as it reads now (links followed), hashes included, in the
    format the tree under test writes (an older one records sizes only)."""
    try:
        is_sizes_only = json.loads((ckpt / "manifest.json").read_text()).get("format") == 1
    except (OSError, ValueError):
        is_sizes_only = False
    files = {}
    for path in sorted(ckpt.rglob("*")):
        if path.name == "manifest.json" or not (path.is_file() or path.is_symlink()):
            continue
        try:
            data = path.read_bytes() if path.is_file() else b""
        except OSError:
            data = b""
        files[str(path.relative_to(ckpt))] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if is_sizes_only:
        manifest = {"format": 1, "files": {rel: entry["size"] for rel, entry in files.items()}}
    else:
        manifest = {"format": 2, "hash": "sha256", "files": files}
    (ckpt / "manifest.json").unlink(missing_ok=True)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _item(ckpt: Path, fqn: str):
    metadata = base._metadata(ckpt)
    info = next(s for i, s in metadata.storage_data.items() if i.fqn == fqn)
    return ckpt / "actor" / info.relative_path, info.offset, info.length


# ---- item 1: bytes ----------------------------------------------------------------------------------


def _inside_tensor(payload: bytes):
    def damage(ckpt: Path) -> None:
        shard, offset, length = _item(ckpt, EMBED)
        data = bytearray(shard.read_bytes())
        middle = offset + length // 2
        data[middle : middle + len(payload)] = payload
        shard.write_bytes(bytes(data))

    return damage


def _flip_byte(rel: str, at: float = 0.5):
    def damage(ckpt: Path) -> None:
        path = ckpt / rel
        data = bytearray(path.read_bytes())
        data[int(len(data) * at)] ^= 0x01
        path.write_bytes(bytes(data))

    return damage


def _swap(first: str, second: str, manifest):
    def damage(ckpt: Path) -> None:
        metadata = base._metadata(ckpt)
        by_fqn = {i.fqn: i for i in metadata.storage_data}
        a, b = by_fqn[first], by_fqn[second]
        metadata.storage_data[a], metadata.storage_data[b] = (
            metadata.storage_data[b],
            metadata.storage_data[a],
        )
        (ckpt / "actor" / ".metadata").write_bytes(pickle.dumps(metadata))
        manifest(ckpt)

    return damage


def _drop_entry(fqn: str):
    def damage(ckpt: Path) -> None:
        metadata = base._metadata(ckpt)
        del metadata.storage_data[next(i for i in metadata.storage_data if i.fqn == fqn)]
        (ckpt / "actor" / ".metadata").write_bytes(pickle.dumps(metadata))
        _manifest_as_now(ckpt)

    return damage


def _sizes_to_match(ckpt: Path) -> None:
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for rel, entry in manifest["files"].items():
        if isinstance(entry, dict):
            entry["size"] = (ckpt / rel).stat().st_size
        else:  # an older tree's sizes-only manifest
            manifest["files"][rel] = (ckpt / rel).stat().st_size
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _sizes_only(ckpt: Path) -> None:
    _inside_tensor(b"\x00" * 256)(ckpt)
    files = {str(p.relative_to(ckpt)): p.stat().st_size for p in ckpt.rglob("*") if p.is_file()}
    files.pop("manifest.json")
    (ckpt / "manifest.json").write_text(json.dumps({"format": 1, "files": files}))


def _no_manifest(ckpt: Path) -> None:
    _inside_tensor(b"\x00" * 256)(ckpt)
    (ckpt / "manifest.json").unlink()


Q0, Q1 = (f"model.hf.model.layers.{i}.self_attn.q_proj.weight" for i in (0, 1))
BYTE_CASES = {
    "NaN inside the largest tensor": (_inside_tensor(b"\xff\xff\xc0\x7f" * 1024), "__0_0.distcp"),
    "garbage inside the largest tensor": (_inside_tensor(os.urandom(4096)), "__0_0.distcp"),
    "zeros inside the largest tensor": (_inside_tensor(b"\x00" * 4096), "__0_0.distcp"),
    "a byte of tokenizer.json": (_flip_byte("actor/hf/tokenizer.json"), "tokenizer.json"),
    "a byte of config.json": (_flip_byte("actor/hf/config.json", 0.3), "config.json"),
    "a byte of meta.pt": (_flip_byte("actor/meta.pt", 0.9), "meta.pt"),
    "a byte of the RNG state": (_flip_byte("actor/rng_rank0.pt", 0.9), "rng_rank0.pt"),
    "same-shape entries swapped, sizes to match": (_swap(Q0, Q1, _sizes_to_match), ".metadata"),
    "entries swapped, whole manifest rewritten": (
        _swap(EMBED, "model.hf.model.norm.weight", _manifest_as_now),
        "records shape",
    ),
    "optimizer entries swapped, whole manifest rewritten": (
        _swap(
            "optim.state.hf.model.norm.weight.exp_avg",
            "optim.state.hf.model.embed_tokens.weight.exp_avg",
            _manifest_as_now,
        ),
        "records shape",
    ),
    "a tensor's entry removed, whole manifest rewritten": (_drop_entry(EMBED), "has no stored item"),
    "manifest removed, a tensor damaged": (_no_manifest, "manifest.json"),
    "sizes-only manifest, a tensor damaged": (_sizes_only, "manifest.json"),
    "a file added after the save": (
        lambda c: (c / "actor" / "hf" / "added_tokens.json").write_text("{}"),
        "added_tokens.json",
    ),
    "a 100,000-level manifest": (lambda c: (c / "manifest.json").write_text("[" * 100000), "manifest.json"),
    "a 70 MB manifest": (
        lambda c: (c / "manifest.json").write_text(" " * (70 << 20) + "{}"),
        "manifest.json",
    ),
}


# ---- item 4: special files ------------------------------------------------------------------------


def _link(rel: str, target_of):
    def damage(ckpt: Path) -> None:
        path = ckpt / rel
        target = target_of(ckpt, path)
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
        path.symlink_to(target)
        _manifest_as_now(ckpt)

    return damage


def _outside_copy(ckpt: Path, path: Path) -> Path:
    outside = ckpt.parent / f"outside-{path.name}"
    (shutil.copytree if path.is_dir() else shutil.copy)(path, outside)
    return outside


def _secret(ckpt: Path, path: Path) -> Path:
    outside = ckpt.parent / "secret.json"
    outside.write_text('{"secret": "not part of the checkpoint"}')
    return outside


def _fifo(rel: str):
    def damage(ckpt: Path) -> None:
        (ckpt / rel).unlink(missing_ok=True)
        os.mkfifo(ckpt / rel)

    return damage


def _socket_file(ckpt: Path) -> None:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(ckpt / "actor" / "hf" / "vocab.json.sock"))
    sock.close()


SPECIAL_CASES = {
    "tokenizer.json linked outside": (_link("actor/hf/tokenizer.json", _secret), "symbolic link"),
    "actor/hf linked outside": (_link("actor/hf", _outside_copy), "symbolic link"),
    "a shard linked outside": (_link("actor/__0_0.distcp", _outside_copy), "symbolic link"),
    "meta.pt linked to /dev/zero": (_link("actor/meta.pt", lambda c, p: Path("/dev/zero")), "symbolic link"),
    "a FIFO as data.pt": (_fifo("data/data.pt"), "FIFO"),
    "a FIFO as tokenizer.model": (_fifo("actor/hf/tokenizer.model"), "FIFO"),
    "a socket in actor/hf": (_socket_file, "socket"),
}


# ---- item 5: expansion ----------------------------------------------------------------------------


def _bomb_archive(path: Path, inflated: int) -> None:
    """Rewrite the torch.save archive at `path`: its members deflated, data.pkl a string pickle that
    inflates to `inflated` bytes (a few MB on disk)."""
    with zipfile.ZipFile(path) as archive:
        members = [(i.filename, archive.read(i)) for i in archive.infolist()]
    path.unlink()
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in members:
            if not name.endswith("data.pkl"):
                archive.writestr(name, data)
                continue
            with archive.open(name, "w", force_zip64=True) as member:
                member.write(b"\x80\x02X" + (inflated).to_bytes(4, "little"))
                chunk = b"a" * (1 << 24)
                for _ in range(inflated // len(chunk)):
                    member.write(chunk)
                member.write(b"a" * (inflated % len(chunk)) + b".")


def _bomb(rel: str):
    def damage(ckpt: Path) -> None:
        _bomb_archive(ckpt / rel, 3 * 10**9)
        _manifest_as_now(ckpt)

    return damage


def _bomb_in_shard(ckpt: Path) -> None:
    metadata = base._metadata(ckpt)
    info = next(s for i, s in metadata.storage_data.items() if i.fqn == "optim.param_groups.0.lr")
    shard = ckpt / "actor" / info.relative_path
    item = ckpt.parent / "item.pt"
    item.write_bytes(shard.read_bytes()[info.offset : info.offset + info.length])
    _bomb_archive(item, 3 * 10**9)
    data = shard.read_bytes()
    shard.write_bytes(data + item.read_bytes())
    info.offset, info.length = len(data), item.stat().st_size
    (ckpt / "actor" / ".metadata").write_bytes(pickle.dumps(metadata))
    _manifest_as_now(ckpt)


BOMB_CASES = {
    "deflated data.pt (3 GB inflated)": (_bomb("data/data.pt"), "data.pt"),
    "deflated meta.pt (3 GB inflated)": (_bomb("actor/meta.pt"), "meta.pt"),
    "deflated RNG state (3 GB inflated)": (_bomb("actor/rng_rank0.pt"), "rng_rank0.pt"),
    "deflated shard item (3 GB inflated)": (_bomb_in_shard, "optim.param_groups.0.lr"),
}


# ---- item 9: config.json ----------------------------------------------------------------------------


def _config(change):
    def damage(ckpt: Path) -> None:
        path = ckpt / "actor" / "hf" / "config.json"
        path.write_text(change(json.loads(path.read_text())))
        _manifest_as_now(ckpt)

    return damage


def _edited(**changes):
    return _config(lambda c: json.dumps({**c, **changes}))


CONFIG_CASES = {
    "config.json narrower": (_edited(hidden_size=32, head_dim=8), "config.json"),
    "config.json deeper": (_edited(num_hidden_layers=3), "config.json"),
    "config.json another vocabulary": (_edited(vocab_size=1000), "config.json"),
    "config.json absurd sizes": (_edited(hidden_size=10**9, intermediate_size=10**12), "config.json"),
    "config.json unknown model type": (_edited(model_type="no-such-model"), "config.json"),
    "config.json a list": (_config(lambda c: "[1, 2]"), "config.json"),
    "config.json 100,000 levels": (_config(lambda c: "[" * 100000 + "]" * 100000), "config.json"),
}


def checkpoint_cases(model_dir: Path, tmp: Path) -> None:
    saved = base.make_checkpoint(model_dir, tmp / "saved")
    before = _tree_digest(saved)
    groups = [
        (BYTE_CASES, ("resume", "export")),
        (SPECIAL_CASES, ("resume", "export")),
        (BOMB_CASES, ("resume", "train", "export")),
        (CONFIG_CASES, ("export",)),
    ]
    for cases, commands in groups:
        for name, (damage, field) in cases.items():
            case_dir = tmp / "ckpt" / name.replace(" ", "_").replace("/", "-")
            template = case_dir / "template" / "global_step_1"
            if cases is not SPECIAL_CASES:  # damaged once (a bomb takes a while), then copied per command
                shutil.copytree(saved, template)
                damage(template)
            for command in commands:
                ckpt = case_dir / command / "global_step_1"
                if cases is SPECIAL_CASES:  # a FIFO cannot be copied: each command gets its own
                    shutil.copytree(saved, ckpt)
                    damage(ckpt)
                else:
                    shutil.copytree(template, ckpt, symlinks=True)
                _run_on(ckpt, command, f"checkpoint {name} ({command})", field, tmp)
    if _tree_digest(saved) != before:
        losses.append("the saved checkpoint changed")


def _run_on(ckpt: Path, command: str, label: str, field: str, tmp: Path) -> None:
    if command == "resume":
        code, text = base.tandem("config", "show", str(CONFIG), f"runner.resume_from={ckpt}", timeout=60)
    elif command == "train":
        out = ckpt.parent / "run"
        code, text = base.tandem(
            "train", str(CONFIG), f"runner.resume_from={ckpt}", f"runner.output_dir={out}", timeout=60
        )
        if out.exists():
            losses.append(f"{label}: the refused run made its output directory")
    else:
        out = ckpt.parent / "exported"
        out.mkdir()
        (out / "config.json").write_text('{"model": "exported before"}')  # a model an export would replace
        code, text = base.tandem("export", str(ckpt), "--out", str(out), timeout=60)
        if code != 0 and (out / "config.json").read_text() != '{"model": "exported before"}':
            losses.append(f"{label}: the refused export replaced the model at --out")
    base.classify(label, code, text, field)
    if code is not None and code != 0 and len(text.strip().splitlines()) > 1:
        base.record(label, "unclear", f"{len(text.strip().splitlines())} lines: " + text.strip()[:120])


# ---- items 2 and 3: concurrent runs ------------------------------------------------------------------


class Run:
    def __init__(self, name: str, overrides: list[str], env: dict):
        self.name, self.run_id = name, uuid.uuid4().hex
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandemrl.cli", "train", str(CONFIG), *overrides],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**env, "TANDEM_RUN_ID": self.run_id},
        )

    def finish(self, timeout: float = 600) -> tuple[int | None, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            return None, err + out
        return self.proc.returncode, err + out


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False


def run_cases(model_dir: Path, tmp: Path, minilm_dir: Path) -> None:
    from benchmarks.robustness.fixtures import build_small_kb, tiny_overrides
    from tandemrl.cluster.reaper import tagged_pids

    kb_dir, index_dir = build_small_kb(tmp / "kb", minilm_dir)
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))}  # an older tree: its own

    def overrides(output_dir: Path, steps: int) -> list[str]:
        return [
            *tiny_overrides(model_dir, kb_dir, index_dir, output_dir),
            f"runner.max_steps={steps}",
            "runner.val_interval=0",
        ]

    first_dir = tmp / "runs" / "first"
    first = Run("first", overrides(first_dir, 3), env)
    metrics = first_dir / "metrics.jsonl"
    if not _wait_for(lambda: metrics.exists() and metrics.read_text().strip(), 300):
        base.record("runs: the first run reached no step", "crash", first.finish(5)[1][-200:])
        return
    second = Run("second", overrides(first_dir, 3), env)  # the same output directory
    code, text = second.finish(120)
    base.classify("a second run on a running run's output directory", code, text, "runner.output_dir")
    other = Run("other", overrides(tmp / "runs" / "other", 3), env)  # another directory, the same index
    code, text = other.finish(120)
    base.classify("a second run on the index a running run serves", code, text, "retrieval.index_dir")
    if (tmp / "runs" / "other" / "startup_marks.jsonl").exists():
        losses.append("the run refused for the index started its services first")
    code, text = first.finish()
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]
    if code != 0 or steps != [1, 2, 3] or str(first_dir) not in (first_dir / "config.yaml").read_text():
        losses.append(f"the first run's own files: exit {code}, steps {steps}")

    killed_dir = tmp / "runs" / "killed"
    killed = Run("killed", overrides(killed_dir, 20), env)
    if _wait_for(lambda: (killed_dir / "metrics.jsonl").exists(), 300):
        killed.proc.send_signal(signal.SIGKILL)
        killed.finish(30)
        _wait_for(lambda: not tagged_pids(killed.run_id), 60)
        after = Run("after", overrides(killed_dir, 1), env)
        code, text = after.finish()
        label = "a run on the directory of a run killed with -9"
        base.record(
            label,
            "clear" if code == 0 else ("hang" if code is None else "crash"),
            "" if code == 0 else text[-160:],
        )
    else:
        base.record(
            "a run on the directory of a run killed with -9", "crash", "the run to kill never stepped"
        )


def main() -> None:
    from benchmarks.engine.model_shapes import make_tiny_model_dir
    from tandemrl.data.prepare_model import prepare_model, prepare_retriever

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/robustness/hostile_checkpoints_and_runs.json")
    parser.add_argument("--skip-runs", action="store_true", help="checkpoint cases only (no real runs)")
    args = parser.parse_args()
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        os.environ["TANDEM_HOME"] = str(tmp / "home")  # prepared here, never the user's
        model_dir = make_tiny_model_dir(tmp / "tiny", prepare_model())
        checkpoint_cases(model_dir, tmp)
        if not args.skip_runs:
            run_cases(model_dir, tmp, prepare_retriever())
    report = base.summary()
    report["silent_accepts"] = report.pop("accepted")
    report["losses"] = losses
    report["cases"] = {name: outcome for name, (outcome, _) in base.cases.items()}
    report["seconds"] = round(time.monotonic() - start, 1)
    print(json.dumps(report, indent=1))
    write_json(args.out, report, indent=1)


if __name__ == "__main__":
    main()
