"""Learning parity across seeds: sync, async and async + `tis`, several seeds each, on one machine.

    python -m benchmarks.learning.learning_parity [--prepare] [--steps 60] [--seeds 1 2 3] [--concurrency N]
        [--variants sync async async_tis] [--check-steps 10] [--check-seeds 1 2 3 | --no-check] [--deadline-s S]
        [--sync-config C] [--async-config C] [--runs-dir DIR] [--out JSON]
        [--realtext DIR [--realtext-split test] [--realtext-limit 200]] [key=value ...]
    python -m benchmarks.learning.learning_parity --summarize --runs-dir DIR [--out JSON]

A seed sets `data.seed` (the prompt order) and `runner.seed` (the engines' sampling seed: engine i
draws with runner.seed + i); the cold start is the same for all. Each run is its own `tandem train`
process with its own output directory (`RUNS_DIR/<variant>/seed<N>`, whose metrics.jsonl is kept),
engine port and Ray. They share one retrieval server that this script starts, over its own copy of the
index: Qdrant's local mode lets one process open an index, so runs that each launched their own would
fail on its lock (as would this server, on an index another process holds). With
`--concurrency` above 1 on a GPU the runs also get `SHARED_GPU_OVERRIDES`: a fixed KV cache and
micro-batch, since each would size its own from the free memory at its start; no MPS daemon of their own but
one this script starts for all of them (`shared_mps`, where the driver's tools have one), whose clients they
are; and the policy the recipe's `auto` picks under MPS, `concurrent`, set outright (`auto` would read
`cluster.mps=false` as no MPS and time-share, a different staleness). Timings of concurrent runs are not
comparable: this measures learning only, and `staleness_vs_solo` in the JSON says whether the async seeds'
staleness matches the recipe's alone.

The staleness-0 check: an async run with `rollout_buffer.max_head_offpolicyness=0` (no overlap, the
sync schedule) for `--check-steps`, seeded as the first seed; its mean reward and searches per
trajectory over those steps must lie inside the range of the sync seeds' means over the same steps.
That one run is the check the acceptance reads. `--check-seeds` adds runs of the check with other seeds
(the first of them stays the one decided on): they show how far the check scatters from seed to seed,
beside the sync seeds, which a single run cannot.

Held-out real text (`--realtext DIR`, the directory `python -m benchmarks.retrieval.realtext_data --out DIR`
writes: FanOutQA questions over Wikipedia summaries, text no run trained or validated on): as soon as a
run's training is done, in the same slot while the others train, its final policy (its last checkpoint,
exported with `tandem export`) answers the split's questions through `tandem eval`, over an index of that
corpus built once under the runs directory (`tandem index build`) and served by one retrieval server for
every evaluation; the EM lands in `<run>/realtext_eval/val_summary.json` and in the JSON as `realtext_em`
per seed, with mean and sd per mode. The check run is not evaluated.

The runs start in this order: sync and async seed by seed, the check, then `async_tis` (so that a session
cut short has whole seeds of the pair the acceptance compares).

An earlier batch's runs (`--import-runs <stem>_runs.tgz`, from another session or machine) count as done
when complete and configured as this plan would configure them; each seed in the JSON names its `gpu`.

A run whose metrics.jsonl reaches its last step is not run again, so the same command can be repeated
until every run is done: `--deadline-s` stops the runs still going in time, and the next invocation
resumes each from its newest checkpoint (`--save-every` steps; only the newest is kept, and none once
the run is done). A resumed run continues its metrics.jsonl; its sampling stream restarts, which
perturbs a seed no more than a different engine batch would.

Every invocation ends by writing, from the runs done so far (`complete` says whether all are): the
JSON; next to it `<stem>_plots/` (every seed and the band), `<stem>_samples.json` (a digest of trained
trajectories: searches and rewards per source, a few transcripts) and `<stem>_runs.tgz` (each run's
metrics.jsonl, config, log tail, and the plots): the three files to bring back from a GPU machine.
Exit status 0 when every run is done, 3 when some are left for the next invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import write_json
from benchmarks.learning.learning_parity_summary import SAMPLES_DIGEST, summarize, write_plots, write_samples

ROOT = Path(__file__).resolve().parents[2]

CONFIG_DIR = ROOT / "examples" / "searchr1" / "config"
# the async recipe timed alone on one H200, three seeds (issue 35): the staleness the side-by-side seeds should match
SOLO_RUNS = [
    ROOT / "benchmarks/results/runner" / name / "async_defaults"
    for name in ("colocated_h200_issue35", "colocated_h200_issue35_seed2", "colocated_h200_issue35_seed3")
]
SEED_KEYS = ("data.seed", "runner.seed")
VARIANTS = {  # name -> (which config, extra overrides)
    "sync": ("sync", []),
    "async": ("async", []),
    "async_tis": ("async", ["algorithm.off_policy_correction=tis"]),
    # the ablation of the hand-off order: sync as before issue 27 (minibatches sorted by length)
    "sync_finish_order": ("sync", ["rollout_buffer.handoff_order=finish"]),
}
DEFAULT_VARIANTS = ["sync", "async", "async_tis"]
PAIR = ["sync", "async"]  # the modes the acceptance compares: they run first
CHECK = "staleness0"
CHECK_OVERRIDES = ["rollout_buffer.max_head_offpolicyness=0"]
SHARED_GPU_OVERRIDES = [
    "rollout.engine.kv_cache_gb=12",
    "actor.micro_batch_tokens=16384",
    "cluster.mps=false",  # one daemon for all the runs instead (shared_mps)
    "cluster.colocated_policy=concurrent",  # what `auto` picks for the recipe under MPS
]
# one run's peak GPU memory under SHARED_GPU_OVERRIDES (2026-12-06, an H100 of 79 GiB: two runs side by
# side peaked at 60 GB; three reached 77.7 GB and two of them ran out of memory)
RUN_PEAK_GIB = 30
MAX_AUTO_CONCURRENCY = 3
STOP_GRACE_S = 30.0
LOG_TAIL_LINES = 300
INDEX_COPY_MAX_BYTES = 4 * 2**30  # the KB's index is ~90 MB; a wiki-18 one is served in place


@dataclass
class RunSpec:
    variant: str  # a VARIANTS key or CHECK
    seed: int
    config: str
    steps: int
    overrides: list[str] = field(default_factory=list)

    def run_dir(self, runs_dir: Path) -> Path:
        return runs_dir / self.variant / f"seed{self.seed}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sync-config", default=str(CONFIG_DIR / "smollm2_h200_sync.yaml"))
    parser.add_argument("--async-config", default=str(CONFIG_DIR / "smollm2_h200_async.yaml"))
    parser.add_argument("--steps", type=int, default=60, help="runner.max_steps of every run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=DEFAULT_VARIANTS)
    parser.add_argument("--check-steps", type=int, default=10, help="steps of the staleness-0 check run")
    parser.add_argument(
        "--check-seeds",
        type=int,
        nargs="+",
        default=None,
        help="seeds of the staleness-0 check (default: the first of --seeds); the first is the one decided on",
    )
    parser.add_argument("--no-check", action="store_true", help="leave the staleness-0 check out")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="runs at a time (default: as many as the GPU's memory holds, at most 3; 1 without a GPU)",
    )
    parser.add_argument(
        "--shared-gpu",
        choices=["auto", "on", "off"],
        default="auto",
        help="SHARED_GPU_OVERRIDES: auto = when concurrency > 1 and the runs use a GPU",
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="stop starting runs, and stop those still going, after this many seconds",
    )
    parser.add_argument(
        "--save-every",
        type=int,
        default=10,
        help="runner.save_interval of the runs, so that one stopped at the deadline resumes",
    )
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep a finished run's last one")
    parser.add_argument(
        "--prepare",
        action="store_true",
        help="first `tandem prepare all` and, if the config's model is missing, `tandem sft`",
    )
    parser.add_argument("--summarize", action="store_true", help="only write the JSON from the runs there")
    parser.add_argument("--runs-dir", default="runs/learning_parity")
    parser.add_argument(
        "--out", default=None, help="default: benchmarks/results/learning/learning_parity_<gpu>.json"
    )
    parser.add_argument(
        "--realtext",
        default=None,
        help="a directory of benchmarks.retrieval.realtext_data: evaluate every final policy on it",
    )
    parser.add_argument("--realtext-split", choices=["dev", "test"], default="test")
    parser.add_argument("--realtext-limit", type=int, default=200, help="questions per evaluation")
    parser.add_argument(
        "--import-runs",
        nargs="*",
        default=[],
        metavar="RUNS_TGZ",
        help="an earlier batch's <stem>_runs.tgz (with its <stem>.json beside it): its complete runs count as done "
        "here, when their config is the one this plan would run",
    )
    parser.add_argument(
        "--solo-runs",
        nargs="*",
        default=[str(p) for p in SOLO_RUNS],
        help="solo runs of the async recipe (directories with a metrics.jsonl) whose staleness the async "
        "seeds, run side by side, should match (default: issue 35's timed runs on one H200)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides applied to every run")
    args = parser.parse_args(argv)
    for run_dir in args.solo_runs:
        if not (Path(run_dir) / "metrics.jsonl").is_file():
            parser.error(f"--solo-runs {run_dir}: no metrics.jsonl there (a run directory of `tandem train`)")
    if args.realtext is not None:
        missing = [
            n
            for n in ("corpus.jsonl", f"{args.realtext_split}.jsonl")
            if not (Path(args.realtext) / n).is_file()
        ]
        if missing:
            parser.error(
                f"--realtext {args.realtext}: no {', '.join(missing)} there; build it with "
                "`python -m benchmarks.retrieval.realtext_data --out DIR`"
            )
    for bundle_path in args.import_runs:
        if not Path(bundle_path).is_file():
            parser.error(f"--import-runs {bundle_path}: no such file (a <stem>_runs.tgz this script wrote)")
    if args.realtext_limit < 1:
        parser.error("--realtext-limit must be >= 1")
    if (args.concurrency is not None and args.concurrency < 1) or args.steps < 1 or args.check_steps < 1:
        parser.error("--concurrency, --steps and --check-steps must be >= 1")
    if args.check_seeds is None:
        args.check_seeds = args.seeds[:1]
    elif args.no_check:
        parser.error("--check-seeds and --no-check contradict each other")
    elif len(set(args.check_seeds)) != len(args.check_seeds):
        parser.error(f"--check-seeds {args.check_seeds}: a seed is repeated")
    return args


def run_specs(args: argparse.Namespace) -> list[RunSpec]:
    """The runs in the order they start: sync and async seed by seed (the acceptance's pair, so a session cut
    short still has whole seeds of both), then the short staleness-0 check, then the other variants."""
    configs = {"sync": args.sync_config, "async": args.async_config}

    def specs_of(names: list[str]) -> list[RunSpec]:
        chosen = [n for n in names if n in args.variants]
        return [RunSpec(n, seed, configs[VARIANTS[n][0]], args.steps, VARIANTS[n][1])
                for seed in args.seeds for n in chosen]  # fmt: skip

    specs = specs_of(PAIR)
    if not args.no_check:
        specs += [RunSpec(CHECK, seed, args.async_config, args.check_steps, CHECK_OVERRIDES)
                  for seed in args.check_seeds]  # fmt: skip
    return specs + specs_of([n for n in VARIANTS if n not in PAIR])


def train_command(spec: RunSpec, run_dir: Path, shared: list[str]) -> list[str]:
    seeds = [f"{key}={spec.seed}" for key in SEED_KEYS]
    return [
        sys.executable, "-m", "tandemrl.cli", "train", spec.config,
        f"runner.output_dir={run_dir}", f"runner.max_steps={spec.steps}", *seeds, *spec.overrides, *shared,
    ]  # fmt: skip


def is_complete(run_dir: Path, steps: int) -> bool:
    from tandemrl.metrics.logger import read_history

    rows = read_history(run_dir / "metrics.jsonl")
    return any(row["step"] == steps and "time/step" in row for row in rows)


def uses_gpu(config_path: str, overrides: list[str]) -> bool:
    from tandemrl.config.loader import load_config

    config = load_config(config_path, overrides)
    if "cuda" in (config.rollout.device, config.actor.device):
        return True
    if "auto" in (config.rollout.device, config.actor.device):
        import torch

        return torch.cuda.is_available()
    return False


def auto_concurrency(is_gpu: bool) -> int:
    """Runs at a time when `--concurrency` is not given: as many as the GPU's memory holds at
    `RUN_PEAK_GIB` each, at most `MAX_AUTO_CONCURRENCY` (the cores are shared too); 1 without a GPU."""
    import torch

    if not is_gpu or not torch.cuda.is_available():  # e.g. --summarize of GPU runs on another machine
        return 1

    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    return max(1, min(MAX_AUTO_CONCURRENCY, int(total_gib // RUN_PEAK_GIB)))


def shared_mps(runs_dir: Path):
    """One MPS daemon whose clients are every run's processes (they inherit its pipe directory from this
    process's environment), as each run's own daemon would make them; None where the driver's tools have
    no MPS control (the runs then share the GPU in time slices, and the JSON's setup says so)."""
    from tandemrl.cluster.mps import CONTROL, MpsDaemon

    if shutil.which(CONTROL) is None:
        print(f"no {CONTROL} here: the runs share the GPU without MPS", flush=True)
        return None
    root = Path(tempfile.mkdtemp(prefix="lp-mps-"))  # short: the socket path stays under 108 bytes
    daemon = MpsDaemon(root).start()
    os.environ.update(daemon.env)
    print(f"one MPS daemon for every run (pipe {daemon.env['CUDA_MPS_PIPE_DIRECTORY']})", flush=True)
    return daemon


def gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - the results are still worth writing without a GPU name
        return "unknown"


def default_out(gpu: str) -> Path:
    known = [tag for tag in ("h200", "h100") if tag in gpu.lower()]  # the device kinds lent here
    tag = known[0] if known else "".join(c if c.isalnum() else "_" for c in gpu.lower())
    return ROOT / "benchmarks" / "results" / "learning" / f"learning_parity_{tag}.json"


def prepare(args: argparse.Namespace) -> None:
    """The embedded defaults, then the cold start the configs name, if it is not there yet."""
    from tandemrl.config.loader import load_config

    tandem = [sys.executable, "-m", "tandemrl.cli"]
    print("$ tandem prepare all", flush=True)
    subprocess.run([*tandem, "prepare", "all"], check=True, cwd=ROOT)
    model = Path(load_config(args.sync_config, args.overrides).rollout.model.model_path)
    if not (model / "config.json").is_file():
        print(f"$ tandem sft {args.sync_config}  (no model at {model} yet)", flush=True)
        subprocess.run([*tandem, "sft", args.sync_config, *args.overrides], check=True, cwd=ROOT)


def private_index(index_dir: Path, runs_dir: Path) -> Path:
    """A copy of a small local index under the runs directory, served by this script alone: Qdrant's
    local mode lets one process open an index, and another run or server may hold the original."""
    if (index_dir / "index.json").is_file() and not (index_dir / "qdrant").is_dir():
        return index_dir  # a Qdrant server's collection, no local files to lock
    size = sum(f.stat().st_size for f in index_dir.rglob("*") if f.is_file())
    if size > INDEX_COPY_MAX_BYTES:
        print(
            f"index {index_dir} ({size / 2**30:.1f} GiB) served in place: nothing else may open it",
            flush=True,
        )
        return index_dir
    copy = runs_dir / "index"
    if not (copy / "index.json").is_file():
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(index_dir, copy, ignore=shutil.ignore_patterns(".lock"))
    return copy


def shared_threads(num_threads: int, runs: int) -> int:
    """The thread pools of one retrieval server for `runs` runs at a time: as many as their own servers
    would have had (`retrieval.num_threads` each), at most one per core; 0 (one per core) stays 0. At one
    per core a server took 11 of the H200 machine's 16 cores beside one run (docs/RETRIEVAL.md)."""
    if num_threads == 0:
        return 0
    return min(num_threads * max(1, runs), os.cpu_count() or 1)


def start_retrieval(
    config_path: str,
    overrides: list[str],
    runs_dir: Path,
    runs: int,
    index: Path | None = None,
    name: str = "retrieval",
):
    """One retrieval server for every run (`retrieval.launch=false`, `runs` at a time), in the configs'
    retrieval mode: over (a copy of) the configs' index, or over `index` (the real text's, for the
    evaluations)."""
    from tandemrl.config.loader import load_config
    from tandemrl.host.home import default_index_dir
    from tandemrl.retrieval.server_process import RetrievalServerProcess

    retrieval = load_config(config_path, overrides).retrieval
    if index is None:
        index = private_index(Path(retrieval.index_dir or default_index_dir()), runs_dir)
    log_path = runs_dir / f"{name}.log"
    threads = shared_threads(retrieval.num_threads, runs)
    server = RetrievalServerProcess(index, mode=retrieval.mode, log_path=log_path, num_threads=threads)
    server.launch()
    server.wait_healthy()
    print(f"{name} server for all runs at {server.addr} over {index} (log {log_path})", flush=True)
    return server


def stop_run(proc: subprocess.Popen) -> None:
    """SIGTERM to the run's process group (`tandem train` stops its services), SIGKILL after a grace."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def start_run(spec: RunSpec, runs_dir: Path, shared: list[str], save_every: int) -> subprocess.Popen:
    """`tandem train` for `spec` in its own process group: resumed from its newest checkpoint when an
    earlier invocation stopped it, else afresh."""
    from tandemrl.trainer.checkpoint import latest_checkpoint

    run_dir = spec.run_dir(runs_dir)
    checkpoint = latest_checkpoint(run_dir) if run_dir.is_dir() else None
    extra = [f"runner.save_interval={save_every}"] if save_every else []
    if checkpoint is not None:  # its validation at the start step is in the metrics already
        extra += [f"runner.resume_from={checkpoint}", "runner.val_before_train=false"]
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return launch(train_command(spec, run_dir, [*shared, *extra]), spec, runs_dir)


def launch(command: list[str], spec: RunSpec, runs_dir: Path) -> subprocess.Popen:
    """`command` in a process group of its own (a deadline or an interrupt stops it with `stop_run`), its
    output appended to the run's log, `RUNS_DIR/<variant>/seed<N>.log`."""
    print("$", " ".join(command), flush=True)
    log = (spec.run_dir(runs_dir).parent / f"seed{spec.seed}.log").open("a")
    return subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def prune_checkpoints(run_dir: Path, keep_latest: bool) -> None:
    """Only the newest checkpoint is needed (to resume); a finished run needs none."""
    from tandemrl.trainer.checkpoint import latest_checkpoint

    latest = latest_checkpoint(run_dir) if keep_latest else None
    for path in (run_dir / "checkpoints").glob("global_step_*"):
        if path != latest:
            shutil.rmtree(path, ignore_errors=True)


@dataclass
class Slot:
    """One run's work in progress: its training, then (with `--realtext`) its final policy's export and
    evaluation, each a process of its own started when the one before exits."""

    spec: RunSpec
    phase: str  # "train" | "export" | "eval"
    proc: subprocess.Popen
    began_s: float
    following: list[str] | None = None  # the export's: the evaluation to start once it succeeds


def run_all(
    specs: list[RunSpec],
    args: argparse.Namespace,
    runs_dir: Path,
    shared: list[str],
    realtext: tuple[tuple[Path, Path, Path], str] | None = None,
) -> list[str]:
    """Run what is not complete, `args.concurrency` at a time, until done or `args.deadline_s`; returns
    the runs left undone. With `realtext` ((questions, corpus, index), the address of a retrieval server
    over that index), a run's real-text evaluation follows its training in the same slot, while the
    other runs train."""
    pending = [s for s in specs if not is_done(s, runs_dir, args)]
    for spec in (s for s in specs if s not in pending):
        print(f"{spec.variant}/seed{spec.seed}: complete, not run again", flush=True)
    running: list[Slot] = []
    start_s = time.monotonic()
    try:
        while pending or running:
            for slot in list(running):
                if slot.proc.poll() is None:
                    if slot.phase == "train":
                        prune_checkpoints(slot.spec.run_dir(runs_dir), keep_latest=True)
                    continue
                running.remove(slot)
                following = finish_phase(slot, args, runs_dir, shared, realtext)
                if following is not None:
                    running.append(following)
            if args.deadline_s is not None and time.monotonic() - start_s >= args.deadline_s:
                for slot in running:
                    name = f"{slot.spec.variant}/seed{slot.spec.seed}"
                    print(f"{name}: {slot.phase} stopped at the deadline; resumed next time", flush=True)
                    stop_run(slot.proc)
                break
            while pending and len(running) < args.concurrency:
                spec = pending.pop(0)
                if is_complete(spec.run_dir(runs_dir), spec.steps):  # only its evaluation is left
                    running.append(start_evaluation(spec, runs_dir, args, shared, realtext))
                else:
                    proc = start_run(spec, runs_dir, shared, args.save_every)
                    running.append(Slot(spec, "train", proc, time.monotonic()))
            time.sleep(2.0)
    finally:  # an interrupt too (Ctrl-C, SIGTERM): the runs sit in sessions of their own
        for slot in running:
            if slot.proc.poll() is None:
                stop_run(slot.proc)
    return [
        f"{s.variant}/seed{s.seed}"
        + (" (real-text eval)" if is_complete(s.run_dir(runs_dir), s.steps) else "")
        for s in specs
        if not is_done(s, runs_dir, args)
    ]


def is_done(spec: RunSpec, runs_dir: Path, args: argparse.Namespace) -> bool:
    run_dir = spec.run_dir(runs_dir)
    return is_complete(run_dir, spec.steps) and not needs_realtext_eval(spec, run_dir, args)


def start_evaluation(
    spec: RunSpec,
    runs_dir: Path,
    args: argparse.Namespace,
    shared: list[str],
    realtext: tuple[tuple[Path, Path, Path], str] | None,
) -> Slot:
    """The export of a trained run's final policy, with its evaluation on the real text to follow."""
    if realtext is None:
        raise RuntimeError("a real-text evaluation needs --realtext")
    run_dir = spec.run_dir(runs_dir)
    shutil.rmtree(run_dir / "final_hf", ignore_errors=True)  # one a deadline cut short
    inputs, addr = realtext
    export, evaluate = realtext_commands(spec, run_dir, inputs, args.realtext_limit, shared, addr)
    return Slot(spec, "export", launch(export, spec, runs_dir), time.monotonic(), evaluate)


def finish_phase(
    slot: Slot,
    args: argparse.Namespace,
    runs_dir: Path,
    shared: list[str],
    realtext: tuple[tuple[Path, Path, Path], str] | None,
) -> Slot | None:
    """Record what the exited process did; returns the run's next phase, if it has one now."""
    spec, rc = slot.spec, slot.proc.returncode
    run_dir, name = spec.run_dir(runs_dir), f"{spec.variant}/seed{spec.seed}"
    wall_s = time.monotonic() - slot.began_s
    print(f"{name}: {slot.phase} exit {rc} after {wall_s:.0f} s", flush=True)
    if slot.phase == "train":
        record = {"rc": rc, "wall_s": wall_s, "gpu": gpu_name()}
        (run_dir / "run.json").write_text(json.dumps(record) + "\n")
        is_trained = is_complete(run_dir, spec.steps)
        wants_eval = is_trained and needs_realtext_eval(spec, run_dir, args)
        if wants_eval and realtext is not None:
            return start_evaluation(spec, runs_dir, args, shared, realtext)
        prune_checkpoints(run_dir, keep_latest=not is_trained or args.keep_checkpoints or wants_eval)
        return None
    if rc != 0:  # the checkpoint stays: the next invocation evaluates it again
        print(
            f"{name}: real-text {slot.phase} failed (rc {rc}); its output is in {run_dir.parent}", flush=True
        )
        return None
    if slot.phase == "export" and slot.following is not None:
        return Slot(spec, "eval", launch(slot.following, spec, runs_dir), time.monotonic())
    shutil.rmtree(run_dir / "final_hf", ignore_errors=True)
    prune_checkpoints(run_dir, keep_latest=args.keep_checkpoints)
    summary = json.loads((run_dir / REALTEXT_EVAL / "val_summary.json").read_text())["summary"]
    print(f"{name}: real-text EM {summary['overall']['em']:.3f}", flush=True)
    return None


REALTEXT_EVAL = "realtext_eval"  # under a run's directory: trajectories.jsonl and val_summary.json


def needs_realtext_eval(spec: RunSpec, run_dir: Path, args: argparse.Namespace) -> bool:
    """A training run (not the check) whose final policy has no real-text summary yet."""
    return (
        args.realtext is not None
        and spec.variant != CHECK
        and not (run_dir / REALTEXT_EVAL / "val_summary.json").is_file()
    )


def realtext_inputs(args: argparse.Namespace, runs_dir: Path) -> tuple[Path, Path, Path]:
    """(questions, corpus, index): the split's questions under a name that becomes their data source
    (`realtext_<split>`), and the corpus's index, built once with `tandem index build`."""
    source = Path(args.realtext).resolve()
    questions = runs_dir / f"realtext_{args.realtext_split}.jsonl"
    if not questions.is_file():
        shutil.copyfile(source / f"{args.realtext_split}.jsonl", questions)
    index = runs_dir / "realtext_index"
    if not (index / "index.json").is_file():
        shutil.rmtree(index, ignore_errors=True)
        command = [sys.executable, "-m", "tandemrl.cli", "index", "build",
                   "--corpus", str(source / "corpus.jsonl"), "--index", str(index)]  # fmt: skip
        print("$", " ".join(command), flush=True)
        subprocess.run(command, check=True, cwd=ROOT)
    return questions, source / "corpus.jsonl", index


def realtext_commands(
    spec: RunSpec,
    run_dir: Path,
    inputs: tuple[Path, Path, Path],
    limit: int,
    shared: list[str],
    server_addr: str,
) -> list[list[str]]:
    """`tandem export` of the run's final checkpoint, then `tandem eval` of that policy on the real-text
    questions, searching through `server_addr`: the one retrieval server over the real-text index that
    every evaluation shares (Qdrant's local mode lets one process open an index; the runs' shared server
    serves the KB)."""
    from tandemrl.trainer.checkpoint import latest_checkpoint

    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None or checkpoint.name != f"global_step_{spec.steps}":
        raise RuntimeError(
            f"{run_dir}: no checkpoint of step {spec.steps} to evaluate (found {checkpoint}); the last step "
            "always saves one: was it pruned? Run it again, or leave --realtext out"
        )
    questions, corpus, index = inputs
    final = run_dir / "final_hf"
    tandem = [sys.executable, "-m", "tandemrl.cli"]
    kept = [o for o in shared if not o.startswith(("retrieval.", "tools.search.server_addr"))]
    return [
        [*tandem, "export", str(checkpoint), "--out", str(final)],
        [*tandem, "eval", spec.config, "--split", "val", "--limit", str(limit),
         "--out", str(run_dir / REALTEXT_EVAL / "trajectories.jsonl"),
         f"rollout.model.model_path={final}", f"actor.model.model_path={final}",
         f"data.val_data_paths=[{questions}]", f"retrieval.index_dir={index}", f"retrieval.corpus_path={corpus}",
         "retrieval.launch=false", f"tools.search.server_addr={server_addr}",
         f"runner.output_dir={run_dir / REALTEXT_EVAL}",
         *[f"{key}={spec.seed}" for key in SEED_KEYS], *spec.overrides, *kept],
    ]  # fmt: skip


# keys of a run's config.yaml that may differ between batches of the same plan: where it ran and how it was
# resumed, not what it trained
IMPORT_IGNORED_KEYS = {
    "runner.output_dir",
    "runner.resume_from",
    "runner.val_before_train",
    "runner.save_interval",
    "retrieval.launch",
    "tools.search.server_addr",
}


def config_mismatch(spec: RunSpec, saved_config: Path, shared: list[str]) -> list[str]:
    """The keys where a run's saved config.yaml differs from the config this plan would give it (paths
    compared by their last part: another machine's home holds the same model under another root)."""
    import yaml

    from tandemrl.commands.show import render
    from tandemrl.config.loader import flatten_keys, load_config

    command = train_command(spec, Path("/run"), shared)
    where = command.index("train")
    config = load_config(command[where + 1], command[where + 2 :])
    # through the YAML `tandem train` wrote config.yaml with, so that both sides read back alike
    planned = flatten_keys(yaml.safe_load(render(config)))
    saved = flatten_keys(yaml.safe_load(saved_config.read_text()))
    differ = []
    for key in sorted(set(planned) | set(saved)):
        a, b = planned.get(key), saved.get(key)
        if key in IMPORT_IGNORED_KEYS or a == b:
            continue
        if isinstance(a, str) and isinstance(b, str) and a.startswith("/") and b.startswith("/"):
            if Path(a).name == Path(b).name:
                continue
        differ.append(f"{key}: {b!r} there, {a!r} here")
    return differ


def import_runs(bundle_path: Path, specs: list[RunSpec], runs_dir: Path, shared: list[str]) -> list[str]:
    """Unpack the complete runs of an earlier batch's bundle into `runs_dir`, where this plan has the same
    run and it is not complete here; each keeps the GPU it ran on (from the bundle's JSON) in its run.json.
    A run whose config differs from this plan's is refused by name. Returns the runs imported."""
    import tarfile

    source_json = bundle_path.with_name(bundle_path.name.removesuffix("_runs.tgz") + ".json")
    gpu = json.loads(source_json.read_text()).get("gpu") if source_json.is_file() else None
    imported = []
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(bundle_path) as tar:
        tar.extractall(tmp, filter="data")
        for spec in specs:
            there, here = spec.run_dir(Path(tmp)), spec.run_dir(runs_dir)
            if not is_complete(there, spec.steps) or is_complete(here, spec.steps):
                continue
            differ = config_mismatch(spec, there / "config.yaml", shared)
            if differ:
                raise SystemExit(
                    f"--import-runs {bundle_path}: {spec.variant}/seed{spec.seed} ran another config than this "
                    f"plan's ({'; '.join(differ[:5])}); leave it out, or run with the same configs and overrides"
                )
            shutil.rmtree(here, ignore_errors=True)
            shutil.copytree(there, here)
            record = json.loads((here / "run.json").read_text()) if (here / "run.json").is_file() else {}
            record.update({"imported_from": str(bundle_path), "gpu": record.get("gpu") or gpu})
            (here / "run.json").write_text(json.dumps(record) + "\n")
            imported.append(f"{spec.variant}/seed{spec.seed}")
    print(f"imported from {bundle_path}: {', '.join(imported) or 'nothing'}", flush=True)
    return imported


def bundle(specs: list[RunSpec], runs_dir: Path, extra_files: list[Path], path: Path) -> Path:
    """What to bring back from the GPU machine besides the JSON: each run's metrics.jsonl, config.yaml,
    run.json, startup.json, real-text summary and samples digest, the last lines of its log, and
    `extra_files` (the plots)."""
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as tar:
        for spec in specs:
            run_dir, name = spec.run_dir(runs_dir), f"{spec.variant}/seed{spec.seed}"
            for file in (
                "metrics.jsonl",
                "config.yaml",
                "run.json",
                "startup.json",
                f"{REALTEXT_EVAL}/val_summary.json",
                SAMPLES_DIGEST,
            ):
                if (run_dir / file).is_file():
                    tar.add(run_dir / file, arcname=f"{name}/{file}")
            log = run_dir.parent / f"seed{spec.seed}.log"
            if log.is_file():
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]).encode()
                info = tarfile.TarInfo(f"{name}/train.log.tail")
                info.size = len(tail)
                tar.addfile(info, io.BytesIO(tail))
        for file in extra_files:
            tar.add(file, arcname=f"plots/{file.name}")
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, through run_all's stop of the runs and the servers' and daemon's stop
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    runs_dir = Path(args.runs_dir).resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    specs = run_specs(args)
    gpu = gpu_name()
    shared = list(args.overrides)
    is_gpu = uses_gpu(args.sync_config, args.overrides)
    if args.concurrency is None:
        args.concurrency = auto_concurrency(is_gpu)
    is_shared_gpu = args.shared_gpu == "on" or (args.shared_gpu == "auto" and args.concurrency > 1 and is_gpu)
    if is_shared_gpu:
        shared = [*SHARED_GPU_OVERRIDES, *shared]  # the user's overrides come last and win
    left, mps = [], None
    imported = {path: import_runs(Path(path), specs, runs_dir, shared) for path in args.import_runs}
    if not args.summarize:
        if args.prepare:
            prepare(args)
        mps = shared_mps(runs_dir) if is_shared_gpu else None
        servers, realtext = [], None
        try:
            runs = args.concurrency
            servers.append(start_retrieval(args.sync_config, args.overrides, runs_dir, runs))
            search = ["retrieval.launch=false", f"tools.search.server_addr={servers[0].addr}"]
            # the real-text index and server only when a run still needs its evaluation (none when every
            # run is imported with its real-text summary)
            if any(needs_realtext_eval(spec, spec.run_dir(runs_dir), args) for spec in specs):
                inputs = realtext_inputs(args, runs_dir)
                servers.append(
                    start_retrieval(
                        args.sync_config, args.overrides, runs_dir, runs, inputs[2], "realtext_retrieval"
                    )
                )
                realtext = (inputs, servers[1].addr)
            left = run_all(specs, args, runs_dir, [*search, *shared], realtext)
        finally:
            for server in servers:
                server.stop()
            if mps is not None:
                mps.stop()
    out = Path(args.out) if args.out else default_out(gpu)
    setup = {
        "gpu": gpu,
        "steps": args.steps,
        "seeds": args.seeds,
        "check_seeds": None if args.no_check else args.check_seeds,
        "seed_keys": list(SEED_KEYS),
        "configs": {"sync": args.sync_config, "async": args.async_config},
        "concurrency": args.concurrency,
        "shared_gpu": is_shared_gpu,
        "shared_mps": None if args.summarize else mps is not None,
        "overrides": shared,
        "variant_overrides": {name: extra for name, (_, extra) in VARIANTS.items()}
        | {CHECK: CHECK_OVERRIDES},
        "command": " ".join(sys.argv),
        "solo_runs": args.solo_runs,
        "imported_runs": imported,
        "realtext": None
        if args.realtext is None
        else {"dir": args.realtext, "split": args.realtext_split, "limit": args.realtext_limit},
    }
    result = summarize(specs, runs_dir, setup, [Path(p).resolve() for p in args.solo_runs])
    write_json(out, result, indent=1)
    plots = write_plots(result, out.parent / f"{out.stem}_plots")
    write_samples(specs, runs_dir, out.parent / f"{out.stem}_samples.json")
    runs = bundle(specs, runs_dir, plots, out.parent / f"{out.stem}_runs.tgz")
    print(json.dumps({"acceptance": result["acceptance"], "complete": result["complete"]}, indent=1))
    # write_json printed both JSON paths; the bundle and the plots are announced here
    print(f"wrote {runs} and {len(plots)} plots in {out.parent / f'{out.stem}_plots'}")
    if left:
        print(f"not done yet: {', '.join(left)}; run the same command again", flush=True)
        return 3
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
