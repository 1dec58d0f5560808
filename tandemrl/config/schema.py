"""The typed configuration: one small dataclass per component, every key with its default
(docs/DESIGN.md, Configuration).

Invariant: every user-facing key lives here exactly once, with its default and its check in
`__post_init__` (user errors raise `ConfigError` naming the key, config/checks.py). The sections live
with their owner: config/rollout.py, config/actor.py, config/agent.py, config/engine.py; the run's own
(`runner`, `data`, `metrics`, `retrieval`, `cluster`) and the whole `TandemConfig` here. Cross-section
rules and derived values live in `derive.py`. Pure Python: no torch, no ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandemrl.config.actor import ActorConfig, AlgorithmConfig, DownSamplingConfig
from tandemrl.config.agent import AgentLoopConfig, RewardConfig, ToolsConfig
from tandemrl.config.checks import _check, _check_choice, _check_finite_positive, _check_positive
from tandemrl.config.engine import EngineOptions
from tandemrl.config.errors import ConfigError, value_summary
from tandemrl.config.rollout import RolloutBufferConfig, RolloutConfig

__all__ = ["ConfigError", "EngineOptions", "TandemConfig", "value_summary"]

COLOCATED_POLICIES = ("auto", "time_share", "concurrent")
CPU_PINNING = ("auto", "always", "never")  # not on/off: YAML reads those as booleans
MAX_RESERVED_CPUS = 64


MAX_WEIGHTS_CHECK_TOKENS = 256  # runner.weights_check_tokens: see its comment
MAX_WEIGHTS_CHECK_TIE_NATS = 2.0  # runner.weights_check_tie_nats: see its comment


@dataclass
class RunnerConfig:
    name: str = "searchr1"
    async_mode: bool = False
    max_steps: int = 10
    save_interval: int = 0  # 0: save only at the end
    val_interval: int = 0  # 0: no validation during training
    val_before_train: bool = False  # validate once before the first step (the starting val EM)
    # a validation before the last step runs beside the next step's generation and train step, and that
    # step's weight sync waits for it, so it still scores this step's weights (runner/step.py,
    # `finish_validation`); false, or under cluster.colocated_policy=time_share: the step waits for it
    overlap_validation: bool = True
    output_dir: str | None = None  # derived: runs/<name>-<time>
    resume_from: str | None = None
    # on resume, issue first the prompts that were in flight, buffered or prefetched at the save;
    # false: skip them until the loader's next epoch (the behaviour before re-issue existed)
    reissue_on_resume: bool = True
    seed: int = 1
    engine_health_interval_s: float = 1.0
    # steps whose actor train step is recorded by torch.profiler into <output_dir>/profiles/ (a Chrome
    # trace and the top kernels), e.g. [4, 5]: what a slow step spent its time on
    profile_steps: list[int] = field(default_factory=list)
    # > 0: after the last weight sync, every engine's greedy output (this many tokens) on probe prompts
    # is scored by the actor under the weights it pushed (runner/weights_check.py); the run fails
    # unless the actor ranks each of the engine's tokens within weights_check_tie_nats of its own top.
    # At most MAX_WEIGHTS_CHECK_TOKENS: a wrong weight shows within a few tokens
    weights_check_tokens: int = 0
    # how far below the actor's top token an engine's greedy token may be. Same weights, other forwards:
    # up to 0.2 nats on CPU; vLLM on an H100 read 0.5 under the old bf16-logit measure (its own argmax is
    # over bf16 logits). Wrong weights: the largest gap over the 4 probes was 6.8 nats or more in every
    # pair measured (trainer/greedy_gaps.py). 0: the engine's output must be the actor's greedy exactly
    weights_check_tie_nats: float = 1.0

    def __post_init__(self):
        _check_positive("runner.max_steps", self.max_steps)
        for step in self.profile_steps:
            _check(
                isinstance(step, int) and not isinstance(step, bool) and step >= 1,
                "runner.profile_steps",
                self.profile_steps,
                "must list step numbers >= 1",
                "Use e.g. runner.profile_steps=[4,5].",
            )
        _check(
            0 <= self.weights_check_tokens <= MAX_WEIGHTS_CHECK_TOKENS,
            "runner.weights_check_tokens",
            self.weights_check_tokens,
            f"must be from 0 to {MAX_WEIGHTS_CHECK_TOKENS}: a wrong weight shows within a few greedy tokens, and "
            "a long check keeps a finished run alive (5000 tokens, when the actor decoded them without a KV "
            "cache, ran on for more than 14 minutes after the last step)",
            "Use 0 for no check, or e.g. 16.",
        )
        _check(
            isinstance(self.weights_check_tie_nats, (int, float))
            and not isinstance(self.weights_check_tie_nats, bool)
            and math.isfinite(self.weights_check_tie_nats)
            and 0 <= self.weights_check_tie_nats <= MAX_WEIGHTS_CHECK_TIE_NATS,
            "runner.weights_check_tie_nats",
            self.weights_check_tie_nats,
            f"must be a number of nats from 0 to {MAX_WEIGHTS_CHECK_TIE_NATS} (a wider margin lets wrong weights "
            "pass: an engine that missed a real update parted from the actor on 19 of 20 prompts, by 1.17 to "
            "6.8 nats)",
            "Use 0 for exact greedy equality, or e.g. 1.0.",
        )
        _check_finite_positive("runner.engine_health_interval_s", self.engine_health_interval_s)
        _check(
            self.save_interval >= 0,
            "runner.save_interval",
            self.save_interval,
            "must be >= 0",
            "Use 0 to save only at the end of the run.",
        )
        _check(
            self.val_interval >= 0,
            "runner.val_interval",
            self.val_interval,
            "must be >= 0",
            "Use 0 to disable validation during training.",
        )


@dataclass
class DataConfig:
    train_data_paths: list[str] = field(default_factory=list)
    val_data_paths: list[str] = field(default_factory=list)
    rollout_batch_size: int = 8
    seed: int = 1
    shuffle: bool = True
    val_limit: int | None = None

    def __post_init__(self):
        _check_positive("data.rollout_batch_size", self.rollout_batch_size)
        _check_positive("data.val_limit", self.val_limit, allow_none=True)


TRACKERS = ("tensorboard", "wandb", "mlflow")


@dataclass
class WandbConfig:
    project: str = "tandemrl"
    entity: str | None = None
    run_name: str | None = None  # None: the name of runner.output_dir
    # online | offline | None: $WANDB_MODE, else online. offline writes <output_dir>/wandb only
    # (`wandb sync` uploads it later); that is how the tests and a machine without network run it
    mode: str | None = None
    tags: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.mode is not None:
            _check_choice("metrics.wandb.mode", self.mode, ("online", "offline"))


@dataclass
class MlflowConfig:
    # None: a local store in the run directory, sqlite:///<output_dir>/mlflow.db; or a server
    # (http://host:5000), or another database (sqlite:///path/mlflow.db, postgresql://...)
    tracking_uri: str | None = None
    experiment_name: str = "tandemrl"
    run_name: str | None = None  # None: the name of runner.output_dir

    def __post_init__(self):
        uri = self.tracking_uri
        _check(
            uri is None or ("://" in uri and not uri.startswith("file:")),
            "metrics.mlflow.tracking_uri",
            uri,
            "is MLflow's file-system store, which cannot hold a metric named like the prefix of another "
            "(time/sync_weights and time/sync_weights/pause)",
            "Use a database (sqlite:///path/to/mlflow.db), a tracking server (http://host:5000), or leave it "
            "unset for sqlite:///<runner.output_dir>/mlflow.db.",
        )


@dataclass
class MetricsConfig:
    """Where every step's metrics go besides metrics.jsonl (metrics/trackers.py): each tracker gets
    every metric under the same name, at the same step, with the resolved config attached."""

    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)

    def __post_init__(self):
        for tracker in self.trackers:
            _check_choice("metrics.trackers", tracker, TRACKERS)
        _check(
            len(set(self.trackers)) == len(self.trackers),
            "metrics.trackers",
            self.trackers,
            "names a tracker twice",
            "List each tracker once, e.g. [tensorboard, wandb].",
        )


@dataclass
class RetrievalConfig:
    launch: bool = True  # start the retrieval server for the run (False: use tools.search.server_addr)
    index_dir: str | None = None  # None: the default KB's index under $TANDEM_HOME
    corpus_path: str | None = None  # None: the default KB's corpus
    encoder: str = "minilm"  # minilm | e5 | a sentence-transformers directory
    mode: str | None = None  # dense | bm25 | hybrid; None: the index's own (hybrid when it has BM25)
    # the launched server's BLAS, OpenMP and torch thread pools (0: one thread per core). OpenBLAS's
    # threads spin between calls: at one pool thread per core the server used 11 of the H200 machine's
    # 16 cores beside a training run (docs/RETRIEVAL.md); raise it for a large corpus searched exactly
    num_threads: int = 4

    def __post_init__(self):
        if self.mode is not None:
            _check_choice("retrieval.mode", self.mode, ("dense", "bm25", "hybrid"))
        _check(
            isinstance(self.num_threads, int) and 0 <= self.num_threads <= 1024,
            "retrieval.num_threads",
            self.num_threads,
            "must be a whole number of threads from 0 (one per core) to 1024",
            "Use e.g. 4.",
        )


@dataclass
class ClusterConfig:
    num_nodes: int = 1
    num_gpus_per_node: int = 0
    component_placement: dict[str, str] = field(default_factory=dict)  # e.g. {actor: "0-7", rollout: "8-15"}
    # true: the actor ranks and the rollout engines run as Ray actors on their planned nodes and GPUs;
    # false: the actor in the runner's process and the engines as its child processes (one machine)
    use_ray: bool = True
    ray_address: str | None = None  # None: start a local Ray; "auto" or host:port: join a cluster
    retrieval_node: int = 0  # node rank that runs the retrieval server (retrieval.launch=true)
    gpu_resource: str = "GPU"  # the Ray resource that counts GPUs (tests stand a custom one in for GPUs)
    # a private CUDA MPS daemon for the run: processes sharing a GPU run kernels side by side instead of
    # in time slices (cluster/mps.py); needs a local Ray or use_ray false
    mps: bool = False
    # under mps, the share of the SMs (1-100) each side may use while the async runner overlaps them,
    # e.g. {actor: 70, rollout: 30}; the sync runner never overlaps them and leaves each the whole GPU
    mps_sm_percent: dict[str, int] = field(default_factory=dict)
    # how the async runner uses a GPU the actor and an engine share (docs/DESIGN.md, Sharing a GPU):
    # time_share: the engines stand down (rollout.pause_mode, keeping what they generated) while the actor
    # trains, and continue after the weight push; concurrent: both run at once (under MPS and its SM caps
    # when cluster.mps is true); auto: time_share on a shared GPU, concurrent otherwise (cluster/placement.py)
    colocated_policy: str = "auto"
    # cores kept for the processes whose host thread paces the run (cluster/cpus.py): each actor rank
    # and each engine runs on its own cores, and every other process of the run (driver, retrieval
    # server, Ray) stays off them. always: on one node, whatever the placement; auto: when the actor and
    # an engine share a GPU and the node has the cores to spare; never: the OS schedules everything anywhere
    cpu_pinning: str = "auto"
    cpus_per_actor_rank: int = 2
    # 0: the engines share the rest of the run's cores. None: derived, 2 for the embedded engine (one host
    # thread paces it) and 0 for vLLM and SGLang, whose API server, engine core and compile workers are
    # processes of their own: pinned to 2 cores on an H100, vLLM's first start took 247 s
    cpus_per_engine: int | None = None

    def __post_init__(self):
        _check_positive("cluster.num_nodes", self.num_nodes)
        _check_choice("cluster.colocated_policy", self.colocated_policy, COLOCATED_POLICIES)
        _check_choice("cluster.cpu_pinning", self.cpu_pinning, CPU_PINNING)
        for key, value, low in (
            ("cpus_per_actor_rank", self.cpus_per_actor_rank, 1),
            ("cpus_per_engine", self.cpus_per_engine, 0),
        ):
            if value is None and key == "cpus_per_engine":
                continue  # derived from rollout.backend (config/derive.py)
            _check(
                isinstance(value, int) and low <= value <= MAX_RESERVED_CPUS,
                f"cluster.{key}",
                value,
                f"must be a whole number of cores from {low} to {MAX_RESERVED_CPUS}",
                "Use e.g. 2.",
            )
        _check(
            self.num_gpus_per_node >= 0,
            "cluster.num_gpus_per_node",
            self.num_gpus_per_node,
            "must be >= 0",
            "Use the number of GPUs of each node, or 0 on a CPU-only machine.",
        )
        _check(
            self.retrieval_node >= 0,
            "cluster.retrieval_node",
            self.retrieval_node,
            "must be >= 0",
            "Use a node rank, e.g. 0.",
        )
        for component, percent in self.mps_sm_percent.items():
            _check(
                component in ("actor", "rollout") and 1 <= percent <= 100,
                f"cluster.mps_sm_percent.{component}",
                percent,
                "must name actor or rollout with a percentage from 1 to 100",
                "Use e.g. {actor: 70, rollout: 30}.",
            )
        _check(
            self.mps or not self.mps_sm_percent,
            "cluster.mps_sm_percent",
            self.mps_sm_percent,
            "caps SM shares under MPS, and cluster.mps is false",
            "Set cluster.mps=true, or remove cluster.mps_sm_percent.",
        )
        _check(
            not (self.mps and self.ray_address),
            "cluster.mps",
            self.mps,
            f"starts an MPS daemon on this machine for a local Ray, and cluster.ray_address="
            f"{self.ray_address!r} joins a running cluster",
            "Start nvidia-cuda-mps-control -d on every node before `ray start` and set cluster.mps=false.",
        )
        for component in self.component_placement:
            _check(
                component in ("actor", "rollout", "actor,rollout"),
                "cluster.component_placement",
                component,
                "names an unknown component",
                "Use the components actor and rollout.",
            )
        named = [part for key in self.component_placement for part in key.split(",")]
        _check(  # the plan reads the first key naming a component; a second would be silently ignored
            len(set(named)) == len(named),
            "cluster.component_placement",
            self.component_placement,
            "places a component under two keys",
            "Name each of actor and rollout once, e.g. {actor: 0-3, rollout: 4-7} or {'actor,rollout': 0}.",
        )
        if self.retrieval_node >= self.num_nodes:  # before any plan, so `config show` refuses it too
            raise ConfigError(
                f"cluster.retrieval_node={self.retrieval_node} but cluster.num_nodes={self.num_nodes}. "
                f"Use a node rank in 0-{self.num_nodes - 1}."
            )
        _check(
            self.use_ray or self.ray_address is None,
            "cluster.ray_address",
            self.ray_address,
            "joins a Ray cluster, and cluster.use_ray=false runs without Ray, so it would be ignored",
            "Remove cluster.ray_address, or set cluster.use_ray=true.",
        )


# keys that moved: old name -> new name (the loader says so instead of "unknown key")
MOVED_KEYS = {
    "rollout.chunked_prefill_size": "rollout.engine.max_prefill_tokens",
    "rollout.kv_cache_gb": "rollout.engine.kv_cache_gb",
}


@dataclass
class TandemConfig:
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    agentloop: AgentLoopConfig = field(default_factory=AgentLoopConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rollout_buffer: RolloutBufferConfig = field(default_factory=RolloutBufferConfig)
    down_sampling: DownSamplingConfig = field(default_factory=DownSamplingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    # key -> how its value was derived; filled by derive.derive_and_validate, never read from YAML
    derived: dict[str, str] = field(default_factory=dict, init=False, repr=False)
