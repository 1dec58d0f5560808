"""Pick the cold start RL starts from, among candidates evaluated by benchmarks/learning/learning_h200.sh.

    python3 -m benchmarks.learning.coldstart_choice RESULTS_DIR [--out JSON]

Reads RESULTS_DIR/sft_<tag>/eval/val_summary.json for every candidate, prints the chosen tag and writes
every candidate's val EM (overall and per data source) with the rule to --out. The rule is the recipe's
(docs/LEARNING.md): overall EM within [0.2, 0.45] and every data source above 0.05, so that each kind of
question has reward variance within its groups; among those, the most EM on the weakest source. When
none is in the band: the one whose weakest source is best among those at or under 0.45 overall, else
the lowest overall.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BAND = (0.2, 0.45)
MIN_SOURCE_EM = 0.05


def in_band(em: dict[str, float]) -> bool:
    sources = [v for k, v in em.items() if k != "overall"]
    return BAND[0] <= em["overall"] <= BAND[1] and all(v > MIN_SOURCE_EM for v in sources)


def weakest(em: dict[str, float]) -> float:
    return min((v for k, v in em.items() if k != "overall"), default=0.0)


def choose(candidates: dict[str, dict[str, float]]) -> str:
    """The tag of the chosen candidate ({tag: {"overall": em, source: em, ...}})."""
    if not candidates:
        raise ValueError("no candidate has an evaluation summary")
    good = [t for t, em in candidates.items() if in_band(em)]
    if good:
        return max(good, key=lambda t: (weakest(candidates[t]), -candidates[t]["overall"]))
    under = [t for t, em in candidates.items() if em["overall"] <= BAND[1]]
    if under:
        return max(under, key=lambda t: weakest(candidates[t]))
    return min(candidates, key=lambda t: candidates[t]["overall"])


def read_candidates(results: Path) -> dict[str, dict[str, float]]:
    found = {}
    for path in sorted(results.glob("sft_*/eval/val_summary.json")):
        summary = json.loads(path.read_text())["summary"]
        found[path.parent.parent.name.removeprefix("sft_")] = {k: v["em"] for k, v in summary.items()}
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    candidates = read_candidates(Path(args.results))
    tag = choose(candidates)
    if args.out:
        record = {
            "rule": f"overall val EM in {list(BAND)} and every source > {MIN_SOURCE_EM}; then best weakest source",
            "candidates": candidates,
            "chosen": tag,
            "chosen_val": candidates[tag],
            "chosen_in_band": in_band(candidates[tag]),
        }
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
