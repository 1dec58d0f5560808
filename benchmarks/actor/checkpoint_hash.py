"""What checking every byte of a checkpoint costs (issue 42, item 1): SHA-256 of every file at save
(`write_manifest`) and again before a resume or export (`check_hashes`), streamed 1 MiB at a time.

It saves `--gb` GiB of bf16 tensors of a 7B model's shapes (hidden 4096, MLP 11008) with
torch.distributed.checkpoint, as the actor does, then times both passes and extrapolates to a 7B
checkpoint at the measured rate: the bf16 weights alone (7e9 x 2 bytes = 14 GB) and the actor's
whole checkpoint (fp32 master weights + Adam's two moments: 7e9 x 12 bytes = 84 GB). CPU only. The
files were just written, so they are read from the page cache: the figure is the hashing rate; on a
cold cache the check costs max(hash time, size / the disk's read rate).

    python -m benchmarks.actor.checkpoint_hash [--gb 2] [--out benchmarks/results/actor/checkpoint_hash.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
import warnings
from pathlib import Path

from benchmarks import write_json

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # attention projection, MLP up, MLP down
PARAMS_7B = 7e9


def save_tensors(directory: Path, gib: float) -> int:
    import torch
    import torch.distributed.checkpoint as dcp

    target, state, total, index = int(gib * 2**30), {}, 0, 0
    while total < target:
        shape = SHAPES[index % len(SHAPES)]
        tensor = torch.randn(shape, dtype=torch.bfloat16)
        state[f"model.layers.{index // 3}.w{index % 3}"] = tensor
        total += tensor.numel() * tensor.element_size()
        index += 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's single-process warning
        dcp.save({"model": state}, checkpoint_id=str(directory / "actor"))
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def main() -> None:
    from tandemrl.trainer.checkpoint_manifest import check_hashes, read_manifest, write_manifest

    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=2.0, help="GiB of bf16 tensors to save and hash")
    parser.add_argument("--out", default="benchmarks/results/actor/checkpoint_hash.json")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tandem-hash-bench-"))
    try:
        size = save_tensors(root, args.gb)
        start = time.perf_counter()
        write_manifest(root)
        save_s = time.perf_counter() - start
        entries = read_manifest(root)
        start = time.perf_counter()
        check_hashes(root, entries)
        check_s = time.perf_counter() - start
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rate = size / check_s
    report = {
        "device": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), page cache warm",
        "hash": "sha256 (hashlib, OpenSSL), 1 MiB reads",
        "bytes_hashed": size,
        "manifest_at_save_s": round(save_s, 2),
        "check_before_use_s": round(check_s, 2),
        "check_rate_GB_per_s": round(rate / 1e9, 3),
        "extrapolated_7b_bf16_weights_14GB_s": round(PARAMS_7B * 2 / rate, 1),
        "extrapolated_7b_actor_checkpoint_84GB_s": round(PARAMS_7B * 12 / rate, 1),
    }
    print(json.dumps(report, indent=1))
    write_json(args.out, report, indent=1)


if __name__ == "__main__":
    main()
