"""The typed configuration: one small dataclass per component, every key with its default
(docs/DESIGN.md, Configuration).

Invariant: every user-facing key lives here exactly once, with its default and its check in
`__post_init__` (user errors raise `ConfigError` naming the key). Cross-section rules and derived
values live in `derive.py`. This module is pure Python: no torch, no ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandemrl.config.errors import ConfigError, value_summary
from tandemrl.engine.config import EngineOptions

__all__ = ["ConfigError", "EngineOptions", "TandemConfig", "value_summary"]

PAUSE_MODES = ("retract", "in_place", "drain")
ROLLOUT_BACKENDS = ("embedded", "sglang", "vllm")
SGLANG_BACKEND_TYPES = ("server", "engine")
OFF_POLICY_CORRECTIONS = ("none", "decoupled", "tis")
COLOCATED_POLICIES = ("auto", "time_share", "concurrent")
HANDOFF_ORDERS = ("issue", "finish")


def _check(ok: bool, key: str, value: object, why: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value_summary(value)}: {why}. {fix}")


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, key, value, f"must be one of {', '.join(choices)}", f"Set {key} to one of them.")


def _check_positive(key: str, value: int | float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    _check(value is not None and value > 0, key, value, "must be > 0", f"Set {key} to a positive number.")


def _check_finite_positive(key: str, value: float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    _check(
        value is not None and math.isfinite(value) and value > 0,
        key,
        value,
        "must be a finite number > 0",
        f"Set {key} to a positive number of seconds.",
    )


MAX_WEIGHTS_CHECK_TOKENS = 256  # runner.weights_check_tokens: see its comment


@dataclass
class RunnerConfig:
    name: str = "searchr1"
    async_mode: bool = False
    max_steps: int = 10
    save_interval: int = 0  # 0: save only at the end
    val_interval: int = 0  # 0: no validation during training
    val_before_train: bool = False  # validate once before the first step (the starting val EM)
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
    # must equal the actor's (runner/weights_check.py); the run fails otherwise. At most
    # MAX_WEIGHTS_CHECK_TOKENS: a wrong weight changes the greedy output within a few tokens, and the
    # actor's reference decode recomputes the whole sequence per token (its cost grows with the square)
    weights_check_tokens: int = 0

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
            "the actor's reference decode (no KV cache) costs the square of the length, so 5000 tokens ran on "
            "for more than 14 minutes after the last step",
            "Use 0 for no check, or e.g. 16.",
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
class AgentLoopConfig:
    task_name: str | None = None
    max_turns: int = 4
    max_actor_accept_staleness: int | None = None  # None: unlimited
    # model + tool tokens after the prompt. A 2-hop KB question takes ~370 tokens when all goes well
    # (two model turns, two information blocks, the answer); on real text (Wikipedia summaries) one
    # block of 3 passages is ~400 tokens, so max_turns searches need ~2k (docs/LEARNING.md, Budgets)
    max_response_tokens: int = 2048
    max_new_tokens_per_turn: int = 256
    # per information block; documents are truncated to fit. 512 cut no answer-bearing real-text block
    # (256 lost 12 % of them); KB blocks are under 160 (benchmarks/results/info_budget.json)
    max_info_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    format_reward: bool = False  # Search-R1's structure score on top of exact match

    def __post_init__(self):
        _check(
            1 <= self.max_turns <= self.max_response_tokens,
            "agentloop.max_turns",
            self.max_turns,
            f"must be >= 1 and at most agentloop.max_response_tokens ({self.max_response_tokens}): it counts "
            "the searches of a trajectory, and the Search-R1 prompt tells the model to search (with 0 every "
            "search would be answered 'answer now'); every turn takes at least one token of the response",
            "Use e.g. 4 (Search-R1's setting).",
        )
        if self.max_actor_accept_staleness is not None:
            _check(
                self.max_actor_accept_staleness >= 0,
                "agentloop.max_actor_accept_staleness",
                self.max_actor_accept_staleness,
                "must be >= 0",
                "Use null for unlimited staleness.",
            )
        for key in ("max_response_tokens", "max_new_tokens_per_turn", "max_info_tokens"):
            _check_positive(f"agentloop.{key}", getattr(self, key))
        _check(
            self.temperature >= 0,
            "agentloop.temperature",
            self.temperature,
            "must be >= 0",
            "Use 0 for greedy decoding.",
        )
        _check(0 < self.top_p <= 1, "agentloop.top_p", self.top_p, "must be in (0, 1]", "Use 1.0 to disable.")
        _check(
            math.isfinite(self.temperature),
            "agentloop.temperature",
            self.temperature,
            "must be finite",
            "Use e.g. 1.0, or 0 for greedy decoding.",
        )
        _check(
            self.top_k == -1 or self.top_k >= 1,
            "agentloop.top_k",
            self.top_k,
            "must be -1 (disabled) or >= 1",
            "Use -1 to disable top-k sampling.",
        )
        _check(
            self.max_new_tokens_per_turn <= self.max_response_tokens,
            "agentloop.max_new_tokens_per_turn",
            self.max_new_tokens_per_turn,
            f"is larger than agentloop.max_response_tokens={self.max_response_tokens}, so one turn could "
            "never use it",
            "Lower max_new_tokens_per_turn or raise max_response_tokens.",
        )


@dataclass
class ModelConfig:
    model_path: str | None = None  # None: the embedded SmolLM2 directory under $TANDEM_HOME


@dataclass
class SglangConfig:
    """The SGLang servers tandem launches (`rollout.backend: sglang` without `rollout.server_addrs`):
    `python -m sglang.launch_server` on each instance's node and GPUs, see rollout/sglang_process.py."""

    backend_type: str = "server"
    mem_fraction_static: float = 0.85  # --mem-fraction-static: GPU memory for weights + KV cache
    host: str | None = None  # --host; None: the node's address (127.0.0.1 on a one-node run)
    port: int = 30000  # --port of a node's first instance; the next ones on that node count up
    extra_args: list[str] = field(
        default_factory=list
    )  # appended verbatim, e.g. ["--attention-backend", "fa3"]
    # the interpreter that runs the server (None: tandem's own), and directories put first on its
    # PYTHONPATH for that process only (an engine installed with `pip --target`, docs/BACKENDS.md)
    python: str | None = None
    pythonpath: list[str] = field(default_factory=list)

    def __post_init__(self):
        _check_choice("rollout.sglang.backend_type", self.backend_type, SGLANG_BACKEND_TYPES)
        _check(
            0 < self.mem_fraction_static <= 1,
            "rollout.sglang.mem_fraction_static",
            self.mem_fraction_static,
            "must be in (0, 1]",
            "Use e.g. 0.85.",
        )
        _check(
            0 < self.port < 65536, "rollout.sglang.port", self.port, "is not a TCP port", "Use e.g. 30000."
        )


@dataclass
class VllmConfig:
    """The vLLM servers tandem launches (`rollout.backend: vllm` without `rollout.server_addrs`):
    `python -m vllm.entrypoints.openai.api_server` on each instance's node and GPUs (or CPU), see
    rollout/vllm_server.py."""

    gpu_memory_utilization: float = 0.85  # --gpu-memory-utilization: GPU memory for weights + KV cache
    host: str | None = None  # --host; None: the node's address (127.0.0.1 on a one-node run)
    port: int | None = None  # --port of a node's first instance, counting up; None: a free port
    cpu_kv_cache_gb: int = (
        1  # VLLM_CPU_KVCACHE_SPACE (whole GiB) on CPU; vLLM takes most of the RAM otherwise
    )
    extra_args: list[str] = field(default_factory=list)  # appended verbatim, e.g. ["--enforce-eager"]
    python: str | None = None  # as rollout.sglang.python
    pythonpath: list[str] = field(default_factory=list)  # as rollout.sglang.pythonpath

    def __post_init__(self):
        _check(
            0 < self.gpu_memory_utilization <= 1,
            "rollout.vllm.gpu_memory_utilization",
            self.gpu_memory_utilization,
            "must be in (0, 1]",
            "Use e.g. 0.85 (less when the actor shares the GPU).",
        )
        _check(
            self.port is None or 0 < self.port < 65536,
            "rollout.vllm.port",
            self.port,
            "is not a TCP port",
            "Use e.g. 8000, or null for a free port.",
        )
        _check_positive("rollout.vllm.cpu_kv_cache_gb", self.cpu_kv_cache_gb)


@dataclass
class RolloutConfig:
    pause_mode: str | None = None  # derived: retract (in_place on vLLM, which has no retract)
    backend: str = "embedded"
    sglang: SglangConfig = field(default_factory=SglangConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    max_running_requests: int = 64
    instances: int | None = None  # None: 1, or derived from cluster.component_placement
    tensor_parallel_size: int = 1
    server_addrs: list[str] = field(default_factory=list)  # external engines (sglang/vllm backends)
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_context_len: int = 4096
    weight_sync: str = "auto"  # auto | gloo | nccl | cuda_ipc | disk (safetensors the engines reload)
    weight_sync_dir: str | None = (
        None  # disk sync: a directory the engines can read; None: <output_dir>/weight_sync
    )
    sync_bucket_mb: int = 256
    startup_timeout_s: float = 300.0
    # the embedded engine's own settings, whole and under their engine names (tandemrl/engine/config.py)
    engine: EngineOptions = field(default_factory=EngineOptions)
    # an announced weight update whose tensors do not arrive within this is aborted (old weights kept)
    weight_update_timeout_s: float = 600.0
    # key of external engines (rollout.server_addrs); None: $TANDEM_ENGINE_API_KEY or $SGLANG_API_KEY.
    # Engines the run launches get a fresh key of their own.
    api_key: str | None = None

    def __post_init__(self):
        _check_finite_positive("rollout.weight_update_timeout_s", self.weight_update_timeout_s)
        _check_finite_positive("rollout.startup_timeout_s", self.startup_timeout_s)
        if self.pause_mode is not None:
            _check_choice("rollout.pause_mode", self.pause_mode, PAUSE_MODES)
        _check_choice("rollout.backend", self.backend, ROLLOUT_BACKENDS)
        _check_choice("rollout.device", self.device, ("auto", "cpu", "cuda"))
        _check_choice("rollout.dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        _check_choice("rollout.weight_sync", self.weight_sync, ("auto", "gloo", "nccl", "cuda_ipc", "disk"))
        _check_positive("rollout.max_running_requests", self.max_running_requests)
        _check_positive("rollout.instances", self.instances, allow_none=True)
        _check_positive("rollout.tensor_parallel_size", self.tensor_parallel_size)
        _check_positive("rollout.max_context_len", self.max_context_len)
        _check_positive("rollout.sync_bucket_mb", self.sync_bucket_mb)
        _check(
            self.engine.speculative == "none" or self.backend == "embedded",
            "rollout.engine.speculative",
            self.engine.speculative,
            f"the embedded engine's n-gram speculation; rollout.backend={self.backend} gets no speculative flags",
            "Set rollout.engine.speculative to none (passing it through to vLLM/SGLang is not done yet).",
        )


@dataclass
class RolloutBufferConfig:
    max_inflight_groups: int | None = None  # derived when unset
    max_buffered_groups: int | None = None  # derived: 2 x rollout_batch_size
    max_dropped_groups_per_step: int | None = None  # derived: 10 x rollout_batch_size
    # AReaL's staleness control at admission: groups are issued only while those issued and not dropped
    # stay within (weight versions so far + 1 + this) x rollout_batch_size. 0: no overlap, the sync
    # runner's schedule in the async runner; None: unlimited (only the limits above bound admission)
    max_head_offpolicyness: int | None = None
    # the order of a hand-off's groups, which the trainer cuts into contiguous minibatches. issue: the
    # loader's; finish: the order they finished in, which sorts a sync step by trajectory length (the
    # behaviour before issue 27, kept for the ablation)
    handoff_order: str = "issue"

    def __post_init__(self):
        for key in ("max_inflight_groups", "max_buffered_groups", "max_dropped_groups_per_step"):
            _check_positive(f"rollout_buffer.{key}", getattr(self, key), allow_none=True)
        _check_choice("rollout_buffer.handoff_order", self.handoff_order, HANDOFF_ORDERS)
        if self.max_head_offpolicyness is not None:
            _check(
                self.max_head_offpolicyness >= 0,
                "rollout_buffer.max_head_offpolicyness",
                self.max_head_offpolicyness,
                "must be >= 0 (weight versions a group may be issued ahead of training)",
                "Use 0 for the sync schedule in the async runner, or null for no limit.",
            )


@dataclass
class DownSamplingRulesConfig:
    reject_equal_reward: bool = False


@dataclass
class DownSamplingConfig:
    down_sampling_config: DownSamplingRulesConfig = field(default_factory=DownSamplingRulesConfig)


@dataclass
class AlgorithmConfig:
    group_size: int = 4
    n_minibatches: int = 4
    # None: derived (true when off_policy_correction needs the proximal logprobs, else false)
    recompute_logprobs: bool | None = None
    # none | decoupled (AReaL's decoupled PPO) | tis (truncated importance sampling); see trainer/loss.py
    off_policy_correction: str = "none"
    tis_cap: float = 2.0  # tis: the importance weight is truncated at this value
    # decoupled: tokens whose importance weight exceeds this are left out of the gradient
    decoupled_weight_cap: float = 5.0
    ratio_clip_eps: float = 0.2
    ratio_clip_eps_high: float | None = None  # None: same as ratio_clip_eps
    dual_clip_c: float | None = None  # e.g. 3.0; None disables the dual clip
    norm_adv_by_std: bool = True
    kl_coef: float = 0.0  # low-variance KL to the reference model; 0 disables it

    def __post_init__(self):
        _check_positive("algorithm.group_size", self.group_size)
        _check_positive("algorithm.n_minibatches", self.n_minibatches)
        _check_positive("algorithm.ratio_clip_eps", self.ratio_clip_eps)
        _check_positive("algorithm.ratio_clip_eps_high", self.ratio_clip_eps_high, allow_none=True)
        if self.dual_clip_c is not None:
            _check(
                self.dual_clip_c > 1,
                "algorithm.dual_clip_c",
                self.dual_clip_c,
                "must be > 1",
                "Use e.g. 3.0, or null to disable the dual clip.",
            )
        _check(self.kl_coef >= 0, "algorithm.kl_coef", self.kl_coef, "must be >= 0", "Use 0 to disable.")
        _check_choice("algorithm.off_policy_correction", self.off_policy_correction, OFF_POLICY_CORRECTIONS)
        for key, cap in (("tis_cap", self.tis_cap), ("decoupled_weight_cap", self.decoupled_weight_cap)):
            _check(
                cap >= 1, f"algorithm.{key}", cap, "must be >= 1", "Use e.g. 2.0 (tis) or 5.0 (decoupled)."
            )
        _check(
            self.recompute_logprobs is not False or self.off_policy_correction == "none",
            "algorithm.recompute_logprobs",
            self.recompute_logprobs,
            f"contradicts algorithm.off_policy_correction={self.off_policy_correction!r}, whose importance "
            "weight needs the actor's own logprobs recomputed before the update",
            "Leave algorithm.recompute_logprobs unset (or true), or set algorithm.off_policy_correction=none.",
        )


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0  # in parameter updates
    lr_schedule: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 1.0

    def __post_init__(self):
        _check(
            math.isfinite(self.lr) and self.lr >= 0,
            "actor.optim.lr",
            self.lr,
            "must be a finite number >= 0",
            "Set a non-negative learning rate, e.g. 1e-6.",
        )
        for key in ("weight_decay", "min_lr_ratio", "max_grad_norm"):
            value = getattr(self, key)
            _check(
                math.isfinite(value) and value >= 0,
                f"actor.optim.{key}",
                value,
                "must be a finite number >= 0",
                f"Set actor.optim.{key} to a non-negative number.",
            )
        _check_choice("actor.optim.lr_schedule", self.lr_schedule, ("constant", "cosine"))
        _check(
            self.warmup_steps >= 0,
            "actor.optim.warmup_steps",
            self.warmup_steps,
            "must be >= 0 (parameter updates of linear warm-up)",
            "Use 0 for no warm-up.",
        )
        _check(
            len(self.betas) == 2,
            "actor.optim.betas",
            self.betas,
            "must hold two numbers",
            "Use e.g. [0.9, 0.999].",
        )


@dataclass
class SftConfig:
    """`tandem sft`: the supervised cold start on knowledge-base demonstrations."""

    init_model_path: str | None = None  # the model the cold start fine-tunes; None: the embedded SmolLM2
    demos_path: str | None = None  # None: demos.jsonl of the default KB under $TANDEM_HOME
    rendered_path: str | None = None  # jsonl of {"input_ids", "loss_mask"}: skip rendering (no retriever)
    num_demos: int | None = None  # seeded subset of the demos (the cold-start size knob); None: all
    # seeded subset per data_source instead, e.g. {kb_1hop: 250, kb_2hop: 1250}: the mix decides which
    # behaviours the cold start teaches (docs/LEARNING.md); sources left out get no demonstrations
    num_demos_per_source: dict[str, int] = field(default_factory=dict)
    num_epochs: int = 1
    batch_size: int = 16  # demonstrations per parameter update
    lr: float = 1e-5
    skip_on_miss: bool = True  # drop demos whose searches miss the fact they rely on
    # None: $TANDEM_HOME/models/SmolLM2-135M-Instruct-coldstart (what `model_path: coldstart` names) when
    # fine-tuning the embedded SmolLM2, else <runner.output_dir>/sft_model; an HF directory either way
    out_dir: str | None = None

    def __post_init__(self):
        _check_positive("actor.sft.num_demos", self.num_demos, allow_none=True)
        for source, count in self.num_demos_per_source.items():
            _check(
                count >= 0,
                f"actor.sft.num_demos_per_source.{source}",
                count,
                "must be >= 0",
                "Give each data_source a count of demonstrations, 0 to leave it out.",
            )
        _check(
            not (self.num_demos is not None and self.num_demos_per_source),
            "actor.sft.num_demos",
            self.num_demos,
            f"cannot be combined with actor.sft.num_demos_per_source={self.num_demos_per_source!r}",
            "Set one of the two: a total (num_demos) or a count per data_source (num_demos_per_source).",
        )
        _check_positive("actor.sft.num_epochs", self.num_epochs)
        _check_positive("actor.sft.batch_size", self.batch_size)
        _check(
            math.isfinite(self.lr) and self.lr >= 0,
            "actor.sft.lr",
            self.lr,
            "must be finite and >= 0",
            "Use e.g. 1e-5.",
        )


@dataclass
class ActorConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    # tokens per forward/backward (padding included); None: auto (trainer/policy.py
    # `resolve_micro_batch_tokens`: 8192 on CPU, on CUDA sized from the model's activations and free memory)
    micro_batch_tokens: int | None = None
    gradient_checkpointing: bool = False
    # torch.compile each decoder layer (dynamic shapes): fuses the norm/rotary/activation/cast kernels
    # around the matmuls; costs compile time at the first steps (trainer/policy.py `compile_layers`)
    compile_layers: bool = False
    # HF's eager RMSNorm of Llama/Qwen models through F.rms_norm (trainer/policy.py `fuse_rms_norms`);
    # off until it is measured on a GPU (CPU tests show the same loss and gradients)
    fused_rms_norm: bool = False
    device: str = "auto"
    dtype: str = "auto"  # auto: bf16 on GPU, fp32 on CPU
    num_ranks: int = 1
    # the actor trains rollout.model.model_path (the weights the engines serve); true: actor.model.model_path
    # may name other weights on purpose (same architecture and tokenizer; the engines get them at step 0)
    allow_different_model: bool = False
    # auto (CUDA, bf16): flash_attention_2 when flash_attn is installed, else varlen (torch's own flash
    # varlen kernel, trainer/varlen.py) when it works, else sdpa; CPU: sdpa. flash/varlen pack
    # micro-batches into one row, sdpa/eager use length-sorted padded rows
    attn_implementation: str = "auto"

    def __post_init__(self):
        _check_positive("actor.micro_batch_tokens", self.micro_batch_tokens, allow_none=True)
        _check_positive("actor.num_ranks", self.num_ranks)
        _check_choice("actor.device", self.device, ("auto", "cpu", "cuda"))
        _check_choice("actor.dtype", self.dtype, ("auto", "float32", "bfloat16"))
        _check_choice(
            "actor.attn_implementation",
            self.attn_implementation,
            ("auto", "sdpa", "eager", "varlen", "flash_attention_2", "flash_attention_3"),
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


@dataclass
class SearchToolConfig:
    server_addr: str = "127.0.0.1:8000"
    topk: int = 3
    timeout_s: float = 10.0
    max_retries: int = 3
    backoff_s: float = 0.5
    # a step whose failed searches (after retries) pass this fraction of its searches logs a warning
    warn_error_fraction: float = 0.05
    api_key: str | None = None  # None: $TANDEM_RETRIEVAL_API_KEY (a server launched by the run needs none)

    def __post_init__(self):
        _check(
            0 <= self.warn_error_fraction <= 1,
            "tools.search.warn_error_fraction",
            self.warn_error_fraction,
            "must be in [0, 1]",
            "Use e.g. 0.05.",
        )
        _check_finite_positive("tools.search.timeout_s", self.timeout_s)
        _check(
            math.isfinite(self.backoff_s) and self.backoff_s >= 0,
            "tools.search.backoff_s",
            self.backoff_s,
            "must be a finite number >= 0",
            "Use 0 to retry at once.",
        )
        _check(1 <= self.topk <= 50, "tools.search.topk", self.topk, "must be in 1..50", "Use e.g. 3.")
        _check(
            ":" in self.server_addr,
            "tools.search.server_addr",
            self.server_addr,
            "must be host:port",
            "Use e.g. 127.0.0.1:8000.",
        )
        _check(
            self.max_retries >= 0,
            "tools.search.max_retries",
            self.max_retries,
            "must be >= 0",
            "Use 0 to disable retries.",
        )


# tags the agent loop already gives a meaning to: a plug-in tool may not take them
RESERVED_TOOL_TAGS = ("search", "answer", "think", "information")
_TAG_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def _check_tag(key: str, tag: str) -> None:
    _check(
        bool(tag) and tag[0].isalpha() and set(tag) <= _TAG_CHARS,
        key,
        tag,
        "must be a tag name: a letter, then letters, digits, '_' or '-'",
        "Use e.g. calculator (the model writes <calculator> ... </calculator>).",
    )


@dataclass
class CustomToolConfig:
    """`tools.<name>`: a plug-in tool (agent/tools.py). The model writes `<tag> input </tag>`; the
    callable's output goes back as `<result_tag>output</result_tag>`, masked from the loss."""

    function: str | None = None  # "module.path:callable" or "path/to/file.py:callable"; required
    tag: str | None = None  # None: the tool's name
    result_tag: str = "result"
    max_tokens: int = 256  # one result block, tags included; the output is cut to fit
    timeout_s: float = 10.0  # per call; a call past it returns an error text to the model


@dataclass
class ToolsConfig:
    search: SearchToolConfig = field(default_factory=SearchToolConfig)
    # plug-in tools by name, written as tools.<name>.function etc. (the loader files every key of
    # `tools` other than `search` here; `tandem config show` prints them back at tools.<name>)
    custom: dict[str, CustomToolConfig] = field(default_factory=dict)

    EXTRA_KEYS_FIELD = "custom"  # config/loader.py: unknown keys of this section are entries of `custom`

    def __post_init__(self):
        taken: dict[str, str] = {}  # tool tag -> the key that took it
        for name, tool in self.custom.items():
            _check(
                tool.function is not None,
                f"tools.{name}.function",
                None,
                "is required for a plug-in tool",
                f'Set tools.{name}.function to "module.path:callable" or "path/to/file.py:callable".',
            )
            _check_positive(f"tools.{name}.max_tokens", tool.max_tokens)
            _check_finite_positive(f"tools.{name}.timeout_s", tool.timeout_s)
            if tool.tag is None:
                _check_tag(f"tools.{name}", name)
                tool.tag = name
            _check_tag(f"tools.{name}.tag", tool.tag)
            owner = "the Search-R1 format" if tool.tag in RESERVED_TOOL_TAGS else taken.get(tool.tag)
            _check(
                owner is None,
                f"tools.{name}.tag",
                tool.tag,
                f"is already taken (by {owner})",
                "Give each tool a tag of its own.",
            )
            taken[tool.tag] = f"tools.{name}.tag"
        for name, tool in self.custom.items():  # results may share a tag, never with a tool or the format
            _check_tag(f"tools.{name}.result_tag", tool.result_tag)
            owner = (
                "the Search-R1 format"
                if tool.result_tag in RESERVED_TOOL_TAGS
                else taken.get(tool.result_tag)
            )
            _check(
                owner is None,
                f"tools.{name}.result_tag",
                tool.result_tag,
                f"is already taken (by {owner})",
                "Use a result tag no tool uses, e.g. result.",
            )


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
class RewardConfig:
    """The trajectory reward (agent/reward.py). None: exact match (+ Search-R1's format score under
    agentloop.format_reward); built-ins: tandemrl.agent.reward:exact_match, tandemrl.agent.reward:f1."""

    function: str | None = None  # "module.path:callable" or "path/to/file.py:callable"


@dataclass
class RetrievalConfig:
    launch: bool = True  # start the retrieval server for the run (False: use tools.search.server_addr)
    index_dir: str | None = None  # None: the default KB's index under $TANDEM_HOME
    corpus_path: str | None = None  # None: the default KB's corpus
    encoder: str = "minilm"  # minilm | e5 | a sentence-transformers directory
    mode: str | None = None  # dense | bm25 | hybrid; None: the index's own (hybrid when it has BM25)

    def __post_init__(self):
        if self.mode is not None:
            _check_choice("retrieval.mode", self.mode, ("dense", "bm25", "hybrid"))


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

    def __post_init__(self):
        _check_positive("cluster.num_nodes", self.num_nodes)
        _check_choice("cluster.colocated_policy", self.colocated_policy, COLOCATED_POLICIES)
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
