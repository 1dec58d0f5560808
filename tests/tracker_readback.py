"""Read metrics back from what the trackers wrote: the wandb offline run files and the MLflow local store.

MLflow: its client over the store. A `.wandb` file is wandb's transaction log: a 7-byte header, then LevelDB-log records (32 KiB blocks,
each record a 7-byte header: CRC32, length, type FULL/FIRST/MIDDLE/LAST) holding `Record` protobufs of
wandb's own schema (`wandb.proto.wandb_internal_pb2`). wandb 0.31 ships no Python reader for it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

_HEADER, _BLOCK, _RECORD_HEADER = 7, 32768, 7
_FULL, _LAST = 1, 4


def wandb_offline_run(output_dir: Path) -> dict:
    """{"project", "name", "config": {key: value}, "history": {metric: [(step, value)]}} of the one
    offline run under `<output_dir>/wandb`."""
    from wandb.proto import wandb_internal_pb2

    files = sorted(Path(output_dir, "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"expected one offline wandb run, found {files}"
    run: dict = {"config": {}, "history": {}}
    for payload in _log_records(files[0].read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["project"], run["name"] = record.run.project, record.run.display_name
            run["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            run["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            step = int(items.pop("_step", record.history.step.num))
            for key, value in items.items():
                if not key.startswith("_"):
                    run["history"].setdefault(key, []).append((step, float(value)))
    return run


def _log_records(data: bytes) -> list[bytes]:
    assert data[1:4] == b"W&B", "not a wandb transaction log"
    records, pending, pos = [], b"", _HEADER
    while pos + _RECORD_HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _RECORD_HEADER:  # block trailer padding
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _RECORD_HEADER])
        if kind == 0 and length == 0:
            break
        pending += data[pos + _RECORD_HEADER : pos + _RECORD_HEADER + length]
        pos += _RECORD_HEADER + length
        if kind in (_FULL, _LAST):
            records.append(pending)
            pending = b""
    return records


def mlflow_run(output_dir: Path, experiment_name: str = "tandemrl") -> dict:
    """{"params": {...}, "history": {metric: [(step, value)]}, "status"} of the one run of the MLflow
    store a run writes by default, `sqlite:///<output_dir>/mlflow.db`."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(Path(output_dir) / 'mlflow.db').resolve()}")
    experiment = client.get_experiment_by_name(experiment_name)
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, f"expected one mlflow run, found {len(runs)}"
    run = runs[0]
    history = {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        for key in run.data.metrics
    }
    return {
        "params": run.data.params,
        "history": history,
        "status": run.info.status,
        "run_id": run.info.run_id,
        "artifact_uri": run.info.artifact_uri,
        "artifacts": [a.path for a in client.list_artifacts(run.info.run_id)],
    }


def offline_wandb(monkeypatch, root: Path) -> None:
    """wandb offline, silent, with its config, cache and data dirs under `root` (never the user's home);
    MLflow's telemetry off (it writes ~/.config/mlflow and reports over the network)."""
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(root / "wandb_config"),
        "WANDB_CACHE_DIR": str(root / "wandb_cache"),
        "WANDB_DATA_DIR": str(root / "wandb_data"),
        "WANDB_DISABLE_GIT": "true",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }.items():
        monkeypatch.setenv(name, value)
