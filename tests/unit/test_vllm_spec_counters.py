"""rollout/spec/* for launched vLLM: its Prometheus counters (/metrics) become the embedded engine's
counter names (rollout/vllm_client.py `prometheus_counters`), and the runner's step window turns them into
the same metrics (runner/step_metrics.py `launched_spec_reads`), as it does SGLang's (rollout/client.py
`count_speculation`, tests/integration/test_sglang_conformance.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tandemrl.rollout.vllm_client import prometheus_counters
from tandemrl.runner.step_metrics import launched_spec_reads

METRICS = """# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",model_name="m"}} {emitted}
vllm:generation_tokens_total{{engine="1",model_name="m"}} {emitted}
vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} 7.0
vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {draft}
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} 99.0
vllm:prompt_tokens_total{{engine="0",model_name="m"}} 5000.0
"""


def test_counters_are_summed_over_label_sets_and_rows_derived():
    counters = prometheus_counters(METRICS.format(emitted=150.0, draft=80.0, accepted=40.0))
    assert counters["num_decode_emitted_tokens"] == 300.0  # two engines' label sets
    assert counters["num_spec_draft_tokens"] == 80.0 and counters["num_spec_accepted_tokens"] == 40.0
    assert counters["num_decode_rows"] == 260.0  # every row emits one token, plus the drafts it accepted
    assert prometheus_counters("")["num_decode_rows"] == 0.0  # a server without them


class FakeVllmCounters:
    """Stands in for a VllmClient's `counters()` (the /metrics read over HTTP)."""

    def __init__(self):
        self.texts = [
            METRICS.format(emitted=e, draft=d, accepted=a) for e, d, a in [(100, 40, 10), (250, 140, 60)]
        ]

    async def counters(self):
        return prometheus_counters(self.texts.pop(0))


@pytest.mark.parametrize("backend", ["vllm", "sglang"])  # SGLang's client sums its counts under these names
def test_step_window_gives_the_embedded_engines_spec_metrics(backend):
    rollout = SimpleNamespace(backend=backend, engine=SimpleNamespace(speculative="ngram"))
    ctx = SimpleNamespace(
        config=SimpleNamespace(rollout=rollout), engines=[FakeVllmCounters()], launched_spec_mark=None
    )
    assert asyncio.run(launched_spec_reads(ctx)) == {}  # the first read only sets the mark
    metrics = asyncio.run(launched_spec_reads(ctx))
    # window: 300 tokens emitted (both label sets), 100 drafted, 50 accepted, so 250 rows
    assert metrics["rollout/spec/acceptance_rate"] == pytest.approx(0.5)
    assert metrics["rollout/spec/tokens_per_step"] == pytest.approx(300 / 250)
    assert metrics["rollout/engine_decode_rows"] == pytest.approx(250)
    rollout.engine.speculative = "none"
    assert asyncio.run(launched_spec_reads(ctx)) == {}  # no /metrics read without speculation
