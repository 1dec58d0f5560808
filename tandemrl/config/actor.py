"""The actor's sections: `algorithm.*` (GRPO, its loss and off-policy correction), `actor.*` (the model,
its precision, sharding and micro-batches), `actor.optim.*` and the cold start's `actor.sft.*`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandemrl.config.checks import _check, _check_choice, _check_positive
from tandemrl.config.rollout import ModelConfig

OFF_POLICY_CORRECTIONS = ("none", "decoupled", "tis")
PROXIMAL_LOGPROBS = ("recompute", "current", "loglinear")


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
    # none | decoupled (AReaL's decoupled PPO) | tis (truncated importance sampling); see trainer/loss.py.
    # None: derived from runner.async_mode (decoupled in async, where the data is older than the actor's
    # weights; none in sync), docs/LEARNING.md, Off-policy correction
    off_policy_correction: str | None = None
    # where a correction's proximal policy comes from (trainer/loss.py): recompute (AReaL's: one more forward
    # pass at the weights before the step's first update) | current (each minibatch's own forward, detached:
    # no extra pass; the ratio is 1 where it is taken, so nothing is clipped, and the weight
    # pi_theta / pi_behav, capped as the correction says, scales the gradient) | loglinear (AReaL's and
    # slime's approximation, no extra pass: the first minibatch's own forward is exact; a later one's
    # proximal logprob is interpolated in log space between the rollout's and its own forward's, by
    # alpha = lag / (lag + 1) for a token sampled `lag` weight versions before the step's)
    proximal_logprobs: str = "recompute"
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
        _check_choice("algorithm.proximal_logprobs", self.proximal_logprobs, PROXIMAL_LOGPROBS)
        for key, cap in (("tis_cap", self.tis_cap), ("decoupled_weight_cap", self.decoupled_weight_cap)):
            _check(
                cap >= 1, f"algorithm.{key}", cap, "must be >= 1", "Use e.g. 2.0 (tis) or 5.0 (decoupled)."
            )
        if self.off_policy_correction is not None:
            self.check_correction()

    def check_correction(self) -> None:
        """The correction against its proximal policy and recompute keys (config/derive.py calls it again once
        it has derived an unset correction)."""
        _check_choice("algorithm.off_policy_correction", self.off_policy_correction, OFF_POLICY_CORRECTIONS)
        _check(
            self.proximal_logprobs == "recompute" or self.off_policy_correction != "none",
            "algorithm.proximal_logprobs",
            self.proximal_logprobs,
            "needs an off-policy correction: with algorithm.off_policy_correction=none the rollout's logprobs "
            "are the PPO ratio's denominator and there is no proximal policy",
            "Set algorithm.off_policy_correction to tis or decoupled, or leave proximal_logprobs at recompute.",
        )
        _check(
            self.recompute_logprobs is not False
            or self.off_policy_correction == "none"
            or self.proximal_logprobs in ("current", "loglinear"),
            "algorithm.recompute_logprobs",
            self.recompute_logprobs,
            f"contradicts algorithm.off_policy_correction={self.off_policy_correction!r}, whose importance "
            "weight needs the actor's own logprobs recomputed before the update",
            "Leave algorithm.recompute_logprobs unset (or true), set algorithm.proximal_logprobs to current "
            "or loglinear, or "
            "set algorithm.off_policy_correction=none.",
        )


MAX_LR = 1.0  # AdamW moves each weight by about lr a step: beyond 1 no model survives a step


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0  # in parameter updates
    lr_schedule: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 1.0
    # AdamW's two moments: float32 (8 bytes a parameter) | bfloat16 (4 bytes, written back by stochastic
    # rounding, trainer/low_precision.py; round-to-nearest would freeze exp_avg_sq, which moves 0.1% a step)
    state_dtype: str = "float32"

    def __post_init__(self):
        _check(
            math.isfinite(self.lr) and 0 <= self.lr <= MAX_LR,
            "actor.optim.lr",
            self.lr,
            f"must be a finite number from 0 to {MAX_LR:g} (AdamW's step is about lr per weight)",
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
        _check_choice("actor.optim.state_dtype", self.state_dtype, ("float32", "bfloat16"))
        _check(
            self.warmup_steps >= 0,
            "actor.optim.warmup_steps",
            self.warmup_steps,
            "must be >= 0 (parameter updates of linear warm-up)",
            "Use 0 for no warm-up.",
        )
        _check(
            len(self.betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas),
            "actor.optim.betas",
            self.betas,
            "must hold two numbers in [0, 1) (AdamW's decay rates of its two moments)",
            "Use e.g. [0.9, 0.999].",
        )
        _check(
            self.min_lr_ratio <= 1,
            "actor.optim.min_lr_ratio",
            self.min_lr_ratio,
            "must be <= 1 (the cosine schedule's last learning rate as a fraction of actor.optim.lr)",
            "Use e.g. 0.1, or 0 to decay to zero.",
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
            math.isfinite(self.lr) and 0 <= self.lr <= MAX_LR,
            "actor.sft.lr",
            self.lr,
            f"must be a finite number from 0 to {MAX_LR:g} (AdamW's step is about lr per weight)",
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
    dtype: str = "auto"  # the compute dtype; auto: bf16 on GPU, fp32 on CPU (bf16 under param_dtype=bfloat16)
    # the stored weights and their gradients: float32 (fp32 masters, 16 bytes a parameter with AdamW's fp32
    # moments) | bfloat16 (12 bytes: the update is computed in fp32 and written back by stochastic rounding,
    # unbiased where round-to-nearest would drop every update below half a bf16 ulp (|w|/512 or more):
    # all of them at lr 1e-6; trainer/low_precision.py)
    param_dtype: str = "float32"
    num_ranks: int = 1
    # FSDP2's CPUOffloadPolicy (GPU actors only): the weights, gradients and AdamW moments (16 bytes a
    # parameter, 12 with bf16 weights) live in pinned host memory and each layer's weights are copied in for
    # its forward and backward; the optimizer steps on the CPU. Sharded even on one rank (trainer/policy.py `shard_policy`)
    cpu_offload: bool = False
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
        _check_choice("actor.param_dtype", self.param_dtype, ("float32", "bfloat16"))
        _check(
            not (self.param_dtype == "bfloat16" and self.dtype == "float32"),
            "actor.param_dtype",
            self.param_dtype,
            "contradicts actor.dtype=float32: bf16 weights compute in bf16 (nothing casts them up to fp32)",
            "Set actor.dtype=bfloat16 (or auto), or actor.param_dtype=float32 for fp32 compute.",
        )
        _check(
            not (self.cpu_offload and self.device == "cpu"),
            "actor.cpu_offload",
            self.cpu_offload,
            "offloads a GPU actor's weights, gradients and optimizer state to the host, where a CPU actor "
            "(actor.device=cpu) already keeps them",
            "Set actor.cpu_offload=false, or actor.device=cuda.",
        )
        _check_choice(
            "actor.attn_implementation",
            self.attn_implementation,
            ("auto", "sdpa", "eager", "varlen", "flash_attention_2", "flash_attention_3"),
        )


@dataclass(frozen=True)
class ActorSetup:
    """What the actor (trainer/actor.py) reads of a run's config: its own two sections and two values
    from others. `config.derive.actor_setup` builds it from the whole config; the Ray actor that builds
    the `Actor` is handed it (cluster/actor_worker.py), so it stays plain, picklable data."""

    actor: ActorConfig
    algorithm: AlgorithmConfig
    # agentloop.temperature (1.0 when 0: greedy): the logprobs are those of the policy that sampled
    temperature: float
    # the learning-rate schedule's length in parameter updates (runner.max_steps * algorithm.n_minibatches)
    total_updates: int
