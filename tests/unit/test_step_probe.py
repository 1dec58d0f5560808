"""trainer/step_probe.py: what a train step waited on, read on CPU (the GPU adds the allocator's counts)."""

from __future__ import annotations

import gc
import time

import torch

from tandemrl.trainer.step_probe import StepProbe


def test_the_probe_splits_host_work_from_waits_and_counts_gc_pauses():
    probe = StepProbe(torch.device("cpu")).start()
    with probe.waiting():
        time.sleep(0.05)  # stands in for a host sync on the GPU
    junk = [[i] for i in range(200_000)]
    junk.append(junk)  # a cycle: the collection below has work to do
    del junk
    gc.collect()
    busy_until = time.perf_counter() + 0.02
    while time.perf_counter() < busy_until:  # host work: CPU seconds, not a wait
        pass
    metrics = probe.metrics()
    assert metrics["perf/actor/wait_gpu_s"] >= 0.05
    assert metrics["perf/actor/host_s"] >= 0.02
    assert metrics["perf/actor/cpu_s"] > 0 and metrics["perf/actor/involuntary_switches"] >= 0
    assert metrics["perf/actor/gc_s"] > 0
    assert not any("alloc" in key for key in metrics)  # no caching allocator on CPU


def test_a_train_step_reports_its_probe(tiny_llama_dir):
    from tandemrl.config.derive import actor_setup
    from tandemrl.config.loader import load_config
    from tandemrl.trainer.actor import Actor
    from tandemrl.trainer.batching import TrainSample

    config = load_config(None, [f"actor.model.model_path={tiny_llama_dir}", "actor.device=cpu"])
    actor = Actor(actor_setup(config))
    samples = [
        TrainSample([1, 2, 3, 4, 5], [0, 0, 1, 1, 1], [0.0, 0.0, -1.0, -1.0, -1.0], 1.0) for _ in range(4)
    ]
    metrics = actor.train_step(samples)
    probe = {key: value for key, value in metrics.items() if key.startswith("perf/actor/")}
    assert set(probe) == {
        "perf/actor/wait_gpu_s",
        "perf/actor/host_s",
        "perf/actor/cpu_s",
        "perf/actor/involuntary_switches",
        "perf/actor/gc_s",
    }
    assert probe["perf/actor/wait_gpu_s"] > 0 and probe["perf/actor/host_s"] > 0  # 4 updates' syncs, launches
