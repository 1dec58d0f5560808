"""Shared pieces of the runner and resume integration tests: a small KB with its index, a tiny-model
config, and the prompt ledger accounting."""

from __future__ import annotations

import json
from pathlib import Path

from tandemrl.runner.step import STEP_PARTS

DESIGN_METRICS = [  # docs/DESIGN.md, Metrics
    "rollout/buffer/inflight_groups",
    "rollout/buffer/size",
    "rollout/buffer/admission_wait_inflight_limit",
    "rollout/buffer/admission_wait_buffer_full",
    "rollout/buffer/dropped_groups",
    "rollout/data_staleness/mean",
    "rollout/version_span/mean",
    "rollout/queue_steps/mean",
    "rollout/reward/mean",
    "rollout/total_num_sequence",
    "rollout/response_length",
    "throughput",
    "time/step",
    "time/sync_weights",
    "train/actor/ratio_abs",
    "train/actor/clip_fraction",
    "train/actor/grad_norm",
    "train/actor/lr",
    "val/em/all",
]
STEP_TIME_METRICS = [
    "time/wait_data",
    "time/train",
    "time/sync_weights/pause",
    "time/sync_weights/push",
    "time/sync_weights/continue",
    "rollout/engine_busy_fraction",
    # how long the driver's and the engine server's event loops were held (host/loop_monitor.py)
    "driver/loop_late_s",
    "driver/loop_stalled_s",
    "driver/loop_max_late_ms",
    "rollout/engine_http_loop_late_s",
    "rollout/engine_http_loop_stalled_s",
]


_SMALL_KB: dict[str, tuple[Path, Path]] = {}


def small_kb_once(tmp_path_factory, minilm_dir: Path) -> tuple[Path, Path]:
    """`build_small_kb` once per test session, shared by the runner and resume tests."""
    if "kb" not in _SMALL_KB:
        _SMALL_KB["kb"] = build_small_kb(tmp_path_factory.mktemp("runner_kb"), minilm_dir)
    return _SMALL_KB["kb"]


def build_small_kb(root: Path, minilm_dir: Path) -> tuple[Path, Path]:
    """A 40-entity KB and its MiniLM index: (kb_dir, index_dir). The index names the MiniLM directory
    itself (the `minilm_dir` fixture's), so the retrieval servers of any test load it whatever their
    TANDEM_HOME."""
    from tandemrl.data.kb import generate_kb
    from tandemrl.retrieval.build import build_index

    kb_dir = generate_kb(root / "kb", seed=0, num_entities=40, num_train=60, num_val=6, num_test=4)
    index_dir = root / "index"
    build_index(kb_dir / "corpus.jsonl", index_dir, encoder=str(minilm_dir), show_progress=False)
    return kb_dir, index_dir


def tiny_overrides(model_dir: Path, kb_dir: Path, index_dir: Path, output_dir: Path) -> list[str]:
    """Tiny batches and short generations: rollout_batch_size 2, group_size 2, <= 40 response tokens."""
    return [
        f"rollout.model.model_path={model_dir}",
        f"actor.model.model_path={model_dir}",
        f"data.train_data_paths=[{kb_dir / 'train.jsonl'}]",
        f"data.val_data_paths=[{kb_dir / 'val.jsonl'}]",
        f"retrieval.index_dir={index_dir}",
        f"retrieval.corpus_path={kb_dir / 'corpus.jsonl'}",
        f"runner.output_dir={output_dir}",
        "runner.max_steps=4",
        "runner.save_interval=0",
        "runner.val_interval=4",
        "data.rollout_batch_size=2",
        "data.val_limit=4",
        "algorithm.group_size=2",
        "algorithm.n_minibatches=2",
        "agentloop.task_name=searchr1",
        "agentloop.max_turns=1",
        "agentloop.max_new_tokens_per_turn=12",
        "agentloop.max_response_tokens=40",
        "agentloop.max_info_tokens=24",
        "rollout.device=cpu",
        "rollout.dtype=float32",
        "rollout.max_running_requests=8",
        "rollout.max_context_len=1024",
        "actor.device=cpu",
        "actor.optim.lr=1.0e-4",
        "cluster.use_ray=false",
        "runner.engine_health_interval_s=0.5",
    ]


def read_ledger(output_dir: Path) -> list[dict]:
    path = Path(output_dir) / "prompts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def account(ledger: list[dict], unfinished_issue_ids: set[int]) -> dict[str, set]:
    """Every issued group ends exactly once (trained or dropped) or is still unfinished; returns the sets."""
    issued = [e["issue_id"] for e in ledger if e["event"] == "issued"]
    trained = [e["issue_id"] for e in ledger if e["event"] == "trained"]
    dropped = [e["issue_id"] for e in ledger if e["event"] == "dropped"]
    assert len(issued) == len(set(issued)), "a group was issued twice"
    ends = trained + dropped
    assert len(ends) == len(set(ends)), "a group was trained or dropped twice"
    assert not set(ends) & unfinished_issue_ids, "a finished group is still counted as unfinished"
    assert set(issued) == set(ends) | unfinished_issue_ids, "a group was lost"
    by_id = {e["issue_id"]: e["prompt_id"] for e in ledger if e["event"] == "issued"}
    return {
        "issued": set(issued),
        "trained": set(trained),
        "dropped": set(dropped),
        "trained_prompts": [by_id[i] for i in trained],
        "issued_prompts": [by_id[i] for i in issued],
    }


def check_startup_timeline(output_dir: Path, ray: bool) -> dict[tuple[str, str], float]:
    """startup.json after a run: the core phases of every process are there, in causal order; returns
    {(process, phase): seconds}. `ray`: the actor and the engine's supervisor are Ray actors."""
    report = json.loads((Path(output_dir) / "startup.json").read_text())
    at = {(row["process"], row["phase"]): row["s"] for row in report["phases"]}
    seconds = [row["s"] for row in report["phases"]]
    assert seconds == sorted(seconds), "the timeline is printed in time order"
    for chain in causal_chains(ray):
        missing = [key for key in chain if key not in at]
        assert not missing, f"phases missing from startup.json: {missing}"
        times = [at[key] for key in chain]
        # a process's start is known to a clock tick (10 ms), later than the mark of its launch
        late = [(chain[i], chain[i + 1]) for i in range(len(chain) - 1) if times[i + 1] < times[i] - 0.02]
        assert not late, f"phases out of causal order: {late} ({dict(zip(chain, times, strict=True))})"
    return at


def causal_chains(ray: bool) -> list[list[tuple[str, str]]]:
    """Sequences of (process, phase) that causality orders, for a run of one engine."""
    engine, retrieval, driver = "rollout engine 0", "retrieval server", "driver"
    actor = "actor rank 0" if ray else driver
    chains = [  # each a sequence of (process, phase) that causality orders
        [
            (driver, "config loaded, placement planned"),
            (driver, f"{engine} launch started") if not ray else (f"{engine} supervisor", "supervisor ready"),
            (engine, "process started"),
            (engine, "engine: model loaded"),
            (engine, "engine: KV cache allocated"),
            (engine, "engine ready"),
            (engine, "first /health answered"),
            (driver, f"{engine} healthy (seen by the driver)"),
            (driver, "all services ready"),
        ],
        [
            (driver, f"{retrieval} launch started"),
            (retrieval, "process started"),
            (retrieval, "retrieval: Qdrant index opened"),
            (retrieval, "retrieval: encoder loaded"),
            (retrieval, "warm-up search done"),
            (retrieval, "first /health answered"),
            (driver, f"{retrieval} healthy (seen by the driver)"),
            (driver, "all services ready"),
        ],
        [
            (driver, "actor submitted"),
            (actor, "actor: model weights loaded"),
            (actor, "actor built (model loaded, placed, optimizer)"),
            (driver, "actor ready"),
            (driver, "all services ready"),
            (driver, "weight sync connected"),
            (driver, "runner starting"),
            (driver, "first rollout request sent"),
            (driver, "first group done"),
            (driver, "step 1 generation done (hand-off taken)"),
            (driver, "step 1 train done"),
            (driver, "step 1 weight sync done"),
            (driver, "step 1 done"),
        ],
        [
            (driver, "driver: tokenizer loaded"),
            (driver, "driver: prompts loaded"),
            (driver, "runner starting"),
        ],
    ]
    if ray:
        chains.append(
            [
                (driver, "ray import and init started"),
                (driver, "ray initialized"),
                (driver, "actor submitted"),
            ]
        )
        chains.append(
            [
                (actor, "process started"),
                (actor, "actor worker init started"),
                (actor, "actor: model weights loaded"),
            ]
        )
    return chains


def check_wall_clock(
    scalars: dict, validated_steps: list[int], saved_steps: list[int], overlapped_steps: tuple[int, ...] = ()
) -> None:
    """The honest clock (docs/DESIGN.md, The step clock): the steps' times add up to the run's wall time
    from the first step's start (within 2 %), and the steps that validated or saved hold that time; a
    validation in `overlapped_steps` ran beside the next step instead, which waited for it before its sync."""
    by_step = dict(scalars["time/step"])
    wall_s = scalars["time/wall"][-1][1]
    assert abs(sum(by_step.values()) - wall_s) <= 0.02 * wall_s, (sum(by_step.values()), wall_s)
    for name, steps in (("time/validation", validated_steps), ("time/checkpoint", saved_steps)):
        assert [s for s, _ in scalars.get(name, [])] == steps, name
        assert all(0 < v <= by_step[s] for s, v in scalars[name]), (name, scalars[name], by_step)
    overlapped = scalars.get("time/validation_overlapped", [])
    assert [s for s, _ in overlapped] == list(overlapped_steps)
    assert all(v > 0 for _, v in overlapped)
    waited = dict(scalars.get("time/wait_validation", []))
    assert sorted(waited) == [s + 1 for s in overlapped_steps]  # the next step's sync waited for it
    assert all(v >= 0 for v in waited.values())
    # every step writes its ledger and trajectories: a step that saves inside its time, the others beside the
    # next step (runner/step.py `bookkeep`), whose wait for them is a part of its time
    records = dict(scalars["time/records"])
    overlapped_bookkeeping = dict(scalars.get("time/bookkeeping_overlapped", []))
    assert sorted(records) == saved_steps
    assert sorted([*records, *overlapped_bookkeeping]) == sorted(by_step)
    assert all(0 < v < by_step[s] for s, v in records.items()), records
    assert all(v > 0 for v in overlapped_bookkeeping.values()), overlapped_bookkeeping
    # the named parts and the rest add up to each step's time
    other = dict(scalars["time/other"])
    assert sorted(other) == sorted(by_step)
    for step, step_s in by_step.items():
        parts = sum(dict(scalars[name]).get(step, 0.0) for name in STEP_PARTS if name in scalars)
        # TensorBoard keeps float32: microseconds of rounding over a sum of seconds
        assert other[step] > -1e-4, (step, other[step])
        assert abs(parts + other[step] - step_s) < 1e-4, (step, parts, other[step], step_s)
