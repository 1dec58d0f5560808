"""The kernel-tuning cache on a real engine (engine/tuning_cache.py): the first engine times its kernels
and files the choices under $TANDEM_HOME/cache/kernel_tuning; a second engine of the same shapes reads
them without timing anything and, running the same kernels, generates the same greedy tokens; another
batch limit is timed again. The start-up timeline records which it was."""

from __future__ import annotations

import random

import pytest
import torch

from tests.gpu.test_engine_fast_paths import _model_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _spy_tuners(monkeypatch) -> dict[str, int]:
    """Count the calls of the real timing functions (each still runs)."""
    from tandemrl.engine import kernel_tuning

    calls = {"tune_decode": 0, "tune_prefill": 0, "tune_down_split": 0}
    for name in calls:
        real = getattr(kernel_tuning, name)

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(kernel_tuning, name, counted)
    return calls


def _engine(model_dir, max_running_requests: int = 16):
    from tandemrl.engine.engine import Engine, EngineConfig

    return Engine(
        EngineConfig(
            str(model_dir),
            device="cuda",
            dtype="bfloat16",
            max_running_requests=max_running_requests,
            max_context_len=512,
        )
    )


def _greedy(engine, prompts: list[list[int]]) -> list[list[int]]:
    from tandemrl.engine.sequence import SamplingParams

    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    outputs = {}
    while engine.has_work():
        for seq in engine.step():
            outputs[int(seq.rid)] = seq.output_ids
    return [outputs[i] for i in range(len(prompts))]


def test_a_second_engine_reads_its_kernel_choices_from_the_cache(tmp_path, monkeypatch):
    from tandemrl.engine import tuning_cache
    from tandemrl.host import startup

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(tuning_cache.CACHE_ENV, raising=False)
    monkeypatch.delenv(tuning_cache.CACHE_DIR_ENV, raising=False)  # the session's (tests/gpu/conftest.py)
    monkeypatch.setenv(startup.STARTUP_LOG_ENV, str(tmp_path / "marks.jsonl"))
    calls = _spy_tuners(monkeypatch)
    model_dir = _model_dir(tmp_path / "model")
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 2048) for _ in range(rng.randrange(5, 60))] for _ in range(8)]

    first = _engine(model_dir)
    assert calls == {"tune_decode": 1, "tune_prefill": 1, "tune_down_split": 1}
    files = sorted(p.name.split("-")[0] for p in (tmp_path / "home" / "cache" / "kernel_tuning").iterdir())
    assert files == ["decode", "down_split", "prefill"]
    first_tokens = _greedy(first, prompts)
    del first
    hits = tuning_cache.stats["hits"]

    second = _engine(model_dir)
    assert calls == {"tune_decode": 1, "tune_prefill": 1, "tune_down_split": 1}, "the cache was not read"
    assert tuning_cache.stats["hits"] == hits + 3
    assert _greedy(second, prompts) == first_tokens  # the same kernels, so the same greedy tokens
    del second

    _engine(model_dir, max_running_requests=32)  # other batch sizes: decode and splits timed again
    assert calls == {"tune_decode": 2, "tune_prefill": 1, "tune_down_split": 2}

    phases = [m["phase"] for m in startup.read_marks(tmp_path / "marks.jsonl")]
    assert phases.count("engine: decode attention tuned") == 2
    assert phases.count("engine: decode attention read from cache") == 1
    assert phases.count("engine: CUDA graphs captured") == 3
    first_graphs = phases.index("engine: CUDA graphs captured")
    assert (
        phases.index("engine: KV cache allocated")
        < phases.index("engine: decode attention tuned")
        < first_graphs
    )
