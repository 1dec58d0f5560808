"""benchmarks/engine/speculative_h200.py reads what the runner writes: rows built by the runner's own
`spec_metrics` (tandemrl/runner/step_metrics.py) summarize to the figures issue 39's acceptance reads, and
its checks hold or fail with them."""

from __future__ import annotations

import pytest

from benchmarks.engine.speculative_h200 import checks, spec_summary
from tandemrl.runner.step_metrics import spec_metrics


def rows(
    num_steps: int,
    rows_per_step: float,
    emitted_per_step: float,
    draft: float,
    accepted: float,
    step_s: float,
    gen_s: float,
    val_em: list[float],
) -> list[dict]:
    out, wall = [], 0.0
    for step in range(1, num_steps + 1):
        wall += step_s
        delta = {
            "num_decode_rows": rows_per_step * step,  # a growing batch: the weighting matters
            "num_decode_emitted_tokens": emitted_per_step * step,
            "num_spec_draft_tokens": draft * step,
            "num_spec_accepted_tokens": accepted * step,
        }
        row = {
            "step": step,
            "time/step": step_s,
            "time/wait_data": gen_s,
            "time/wall": wall,
            **spec_metrics(delta),
        }
        row["rollout/spec/decode_steps_per_trajectory"] = rows_per_step * step / 256
        out.append(row)
    out.insert(
        0, {"step": 0, "val/em/all": val_em[0]}
    )  # before training: a row of its own, as the runner logs it
    for step, em in zip((num_steps // 2, num_steps), val_em[1:], strict=True):
        out[step]["val/em/all"] = em  # later validations share their step's row
    return sorted(out, key=lambda r: r["step"])


def test_summary_weights_steps_by_their_rows():
    spec = spec_summary(rows(6, 100, 250, 300, 150, 2.0, 1.0, [0.4, 0.5, 0.6]), warmup=0)
    assert spec["tokens_per_step"] == pytest.approx(2.5)
    assert spec["decode_steps_per_token"] == pytest.approx(0.4)
    assert spec["acceptance_rate"] == pytest.approx(0.5)
    assert spec["wait_data_s"] == pytest.approx(1.0) and spec["wall_s"] == pytest.approx(12.0)
    assert (spec["val_em_start"], spec["val_em_end"]) == (0.4, 0.6)
    plain = spec_summary(rows(6, 100, 100, 0, 0, 3.0, 2.0, [0.4, 0.5, 0.6]), warmup=0)
    assert plain["decode_steps_per_token"] == pytest.approx(1.0) and plain["acceptance_rate"] is None


def test_checks_hold_and_fail_on_the_issues_bars():
    without = spec_summary(rows(6, 100, 100, 0, 0, 3.0, 2.0, [0.4, 0.5, 0.62]), warmup=1)
    good = spec_summary(rows(6, 100, 250, 300, 150, 2.0, 1.4, [0.4, 0.5, 0.60]), warmup=1)
    result = checks(without, good)
    assert result["wait_data_with_over_without"] == pytest.approx(0.7)
    assert result["generation_at_most_0.75_without"] and result["decode_steps_per_token_at_most_0.7"]
    assert result["val_em_end_within_0.03"]
    slow = spec_summary(rows(6, 100, 130, 300, 30, 3.0, 1.8, [0.4, 0.5, 0.55]), warmup=1)
    result = checks(without, slow)
    assert not result["generation_at_most_0.75_without"]
    assert not result["decode_steps_per_token_at_most_0.7"]  # 100 / 130 rows a token
    assert not result["val_em_end_within_0.03"]
