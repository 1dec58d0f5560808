"""benchmarks/learning/coldstart_choice.py: which evaluated cold start RL starts from (the recipe's band rule)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ["-m", "benchmarks.learning.coldstart_choice"]  # run from ROOT, as the recipe runs it


def write_candidate(results: Path, tag: str, overall: float, one: float, two: float) -> None:
    path = results / f"sft_{tag}" / "eval" / "val_summary.json"
    path.parent.mkdir(parents=True)
    summary = {"overall": {"em": overall}, "kb_1hop": {"em": one}, "kb_2hop": {"em": two}}
    path.write_text(json.dumps({"summary": summary}))


def choose(results: Path) -> tuple[str, dict]:
    out = results / "choice.json"
    done = subprocess.run(
        [sys.executable, *SCRIPT, str(results), "--out", str(out)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return done.stdout.strip(), json.loads(out.read_text())


@pytest.mark.parametrize(
    ("candidates", "chosen", "in_band"),
    [
        # in the band, the best weakest source wins; a higher overall outside the band does not
        ({"a": (0.40, 0.62, 0.08), "b": (0.44, 0.60, 0.20), "c": (0.55, 0.80, 0.30)}, "b", True),
        # a source at 0.05 or below is out of the band: the other one, though its overall is lower
        ({"a": (0.38, 0.65, 0.01), "b": (0.25, 0.35, 0.10)}, "b", True),
        # none in the band: the best weakest source at or under 0.45 overall
        ({"a": (0.30, 0.52, 0.00), "b": (0.42, 0.70, 0.03), "c": (0.60, 0.9, 0.2)}, "b", False),
        # all above 0.45: the lowest overall
        ({"a": (0.50, 0.8, 0.1), "b": (0.47, 0.7, 0.2)}, "b", False),
    ],
)
def test_choice_follows_the_band_rule(tmp_path, candidates, chosen, in_band):
    for tag, ems in candidates.items():
        write_candidate(tmp_path, tag, *ems)
    tag, record = choose(tmp_path)
    assert tag == chosen and record["chosen"] == chosen and record["chosen_in_band"] is in_band
    assert set(record["candidates"]) == set(candidates)
    assert record["chosen_val"]["kb_2hop"] == candidates[chosen][2]


def test_no_candidate_is_an_error(tmp_path):
    done = subprocess.run([sys.executable, *SCRIPT, str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode != 0 and "no candidate has an evaluation summary" in done.stderr
