"""Knowledge-base generation benchmark: wall time and sizes of `generate_kb` at the default size
(5,000 entities, 20,000 / 500 / 500 questions), and a byte-identity check of a second generation.

    python -m benchmarks.retrieval.kb_generation [--num-entities 5000] [--seed 0] [--out benchmarks/results/retrieval/kb_generation.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import tempfile
import time
from pathlib import Path

from benchmarks import write_json
from tandemrl.data.kb import generate_kb


def digest(kb_dir: Path) -> str:
    sha = hashlib.sha256()
    for path in sorted(kb_dir.iterdir()):
        sha.update(path.name.encode() + path.read_bytes())
    return sha.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-entities", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the figures as json here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        timings, digests = [], []
        for run in range(2):
            start = time.perf_counter()
            out = generate_kb(Path(tmp) / f"kb{run}", seed=args.seed, num_entities=args.num_entities)
            timings.append(time.perf_counter() - start)
            digests.append(digest(out))
        meta = json.loads((out / "kb_meta.json").read_text())
        sizes_mb = {p.name: round(p.stat().st_size / 1e6, 2) for p in sorted(out.glob("*.jsonl"))}
    figures = {
        "seconds": [round(t, 2) for t in timings],
        "byte_identical": digests[0] == digests[1],
        "num_passages": meta["num_passages"],
        "num_questions": meta["num_questions"],
        "num_demos": meta["num_demos"],
        "sizes_mb": sizes_mb,
        "machine": platform.processor() or platform.machine(),
    }
    print(json.dumps(figures, indent=2))
    if args.out:
        write_json(args.out, figures)


if __name__ == "__main__":
    main()
