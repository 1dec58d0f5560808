"""The actor: PPO/GRPO updates (and SFT steps) of the policy under FSDP2, and the full weights for sync.

One `train_step` = one rollout step's data = `algorithm.n_minibatches` parameter updates, then
`weight_version += 1`. Every rank is given the *whole* sample list and derives its share itself
(`batching.plan_rank_micro_batches`), so the token counts that normalise the loss are known everywhere
without communication and all ranks run the same number of forwards.
Invariant: the gradient of an update is that of the token-mean loss over all model tokens of the
minibatch, however the tokens are split over micro-batches and ranks (FSDP averages over ranks, so each
rank's summed loss is scaled by world_size / minibatch tokens).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tandemrl.config.actor import ActorSetup
from tandemrl.host.startup import mark
from tandemrl.trainer.batching import MicroBatch, TrainSample, plan_rank_micro_batches, split_minibatches
from tandemrl.trainer.loading import CheckpointSource, build_on_meta, load_hf_model, materialize, read_config
from tandemrl.trainer.loss import PolicyLossConfig, loglinear_proximal, masked_sum_tensors, ppo_token_losses
from tandemrl.trainer.low_precision import cast_parameters
from tandemrl.trainer.optim import DTYPES, build_optimizer
from tandemrl.trainer.policy import (
    PolicyModel,
    compile_layers,
    fuse_rms_norms,
    init_distributed,
    reshard,
    resolve_attn_implementation,
    resolve_compute_dtype,
    resolve_device,
    resolve_micro_batch_tokens,
    shard_policy,
    uses_packed_rows,
)
from tandemrl.trainer.step_probe import StepProbe

log = logging.getLogger(__name__)

PPO_SUM_KEYS = (
    "loss",
    "ratio_abs",
    "clip_fraction",
    "approx_kl",
    "entropy",
    "tokens",
    "gap",
    "gap_tokens",
    "kl_ref",
    "is_weight",
    "is_clip_fraction",
    "pos_advantage",
    "clipped_pos_advantage",
)


def enable_activation_checkpointing(hf_model: torch.nn.Module) -> None:
    """Non-reentrant checkpointing of every decoder layer (recomputed inside FSDP's unshard in backward).
    transformers >= 5.2x names it activation_checkpointing_enable; older releases gradient_checkpointing_enable."""
    kwargs = {"use_reentrant": False}
    if hasattr(hf_model, "activation_checkpointing_enable"):
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class Actor:
    """Policy with AdamW, FSDP2-sharded across ranks (one rank: the plain module, under autocast below
    fp32; see `policy.shard_policy`); see the module docstring for the step contract."""

    def __init__(self, setup: ActorSetup, hf_model: torch.nn.Module | None = None):
        """`setup`: the actor's part of the run's config (config/derive.py `actor_setup`); `hf_model`:
        the policy itself, else loaded from `actor.model.model_path` (None: the embedded default)."""
        from tandemrl.host.home import default_model_dir

        self.setup = setup
        cfg = setup.actor
        self.device = resolve_device(cfg.device)
        self.rank, self.world_size = init_distributed(self.device)
        self.compute_dtype = resolve_compute_dtype(cfg.dtype, self.device, cfg.param_dtype)
        # the stored weights and gradients (actor.param_dtype): bf16 ones are loaded as such, never whole in
        # fp32, and stepped by trainer/low_precision.py's AdamW
        self.param_dtype = DTYPES[cfg.param_dtype]
        self.model_path = cfg.model.model_path or (None if hf_model is not None else str(default_model_dir()))
        attn = resolve_attn_implementation(cfg.attn_implementation, self.device, self.compute_dtype)
        hf_model, ref_hf, source = self._load(hf_model, attn)
        mark("actor: model weights loaded")
        self.is_padded = not uses_packed_rows(hf_model.config._attn_implementation or "sdpa")
        self.micro_batch_tokens = resolve_micro_batch_tokens(
            cfg.micro_batch_tokens, hf_model.config, self.device
        )
        if cfg.gradient_checkpointing:
            enable_activation_checkpointing(hf_model)
        if cfg.fused_rms_norm:
            fuse_rms_norms(hf_model)
        if cfg.compile_layers:
            compile_layers(hf_model)
        self.policy = self._place(PolicyModel(hf_model.train(), setup.temperature), source)
        self.ref_policy = None
        if ref_hf is not None:
            ref = PolicyModel(ref_hf.requires_grad_(False).eval(), setup.temperature)
            self.ref_policy = self._place(ref, source)
        if source is not None:
            source.close()  # the fallback's whole model, where it took one
        self.optimizer, self.scheduler = build_optimizer(
            self.policy.parameters(), cfg.optim, setup.total_updates
        )
        self.loss_cfg = PolicyLossConfig.from_algorithm(setup.algorithm)
        # the correction's proximal policy: recomputed before the step's first update, or each minibatch's
        # own forward (algorithm.proximal_logprobs)
        is_corrected = self.loss_cfg.off_policy_correction != "none"
        self.is_proximal_current = is_corrected and setup.algorithm.proximal_logprobs == "current"
        self.is_proximal_loglinear = is_corrected and setup.algorithm.proximal_logprobs == "loglinear"
        self.recomputes = bool(setup.algorithm.recompute_logprobs) or (
            is_corrected and setup.algorithm.proximal_logprobs == "recompute"
        )
        self.weight_version = 0
        self.num_updates = 0
        self.num_skipped_updates = 0
        self._probe = StepProbe(torch.device(self.device))  # what the current train step waited on
        if cfg.compile_layers:
            self.warm_up()
            mark("actor: compiled layers warmed up")

    def _load(
        self, hf_model: torch.nn.Module | None, attn: str
    ) -> tuple[torch.nn.Module, torch.nn.Module | None, CheckpointSource | None]:
        """(the policy's HF model, the reference model's or None, rank 0's weight source or None), the weights
        in actor.param_dtype. Several ranks: each builds the models on the meta device and `_place` has rank
        0 stream the weights into everyone's shards (trainer/loading.py); one rank loads the model whole, on
        the host, and deep-copies it for the reference."""
        source = None
        if self.world_size > 1:
            if self.rank == 0:
                where = {"model": hf_model} if hf_model is not None else {"model_path": self.model_path}
                source = CheckpointSource(**where, attn_implementation=attn, dtype=self.param_dtype)
            config = hf_model.config if hf_model is not None else read_config(self.model_path)
            hf_model = build_on_meta(config, attn, self.param_dtype)
        elif hf_model is None:
            hf_model = load_hf_model(self.model_path, attn, self.param_dtype)
        else:  # a model handed in (tests, benchmarks): its weights as actor.param_dtype says
            cast_parameters(hf_model, self.param_dtype)
        ref_hf = None
        if self.setup.algorithm.kl_coef > 0:  # sharded: a meta model of its own, filled from the same source
            if self.world_size > 1:
                ref_hf = build_on_meta(hf_model.config, attn, self.param_dtype)
            else:
                ref_hf = copy.deepcopy(hf_model)
        return hf_model, ref_hf, source

    def _place(self, policy: PolicyModel, source: CheckpointSource | None) -> PolicyModel:
        """Shard `policy`; across ranks, fill its meta parameters from rank 0's `source`."""
        shard_policy(policy, self.device, self.compute_dtype, self.setup.actor.cpu_offload, self.param_dtype)
        if self.world_size > 1:
            materialize(policy, policy.hf, source, self.device)
        return policy

    def warm_up(self) -> None:
        """Forwards and backwards of the train step's own path on made-up trajectories (every kind and size
        of micro-batch a step makes, below), then the gradients are dropped: the weights, the optimizer, the
        schedule, the counters and the RNG are as before. With `actor.compile_layers` the layers' compile (Dynamo's trace, Inductor's compile or its
        cache) then happens here, while the actor is built and before any rollout, in sync and async runs
        alike, rather than inside the first train step's clock, where it took 3.9 to 19.7 s on the H200 and
        H100 recipes and varied more between runs than the steps it was compared with
        (benchmarks/results/runner/colocated_h100/COMMAND.md). Every rank calls it (FSDP's collectives)."""
        vocab = int(self.policy.hf.config.vocab_size)
        unit = max(8, min(64, self.micro_batch_tokens // 8))
        generator = torch.Generator().manual_seed(0)  # not the global RNG: nothing later draws differently

        def made_up(n: int, advantage: float) -> TrainSample:
            ids = torch.randint(0, vocab, (n,), generator=generator).tolist()
            mask = [0] * (n // 4) + [1] * (n - n // 4)
            return TrainSample(ids, mask, [-1.0 * m for m in mask], advantage, lags=[0] * n)

        # Each kind of micro-batch the plans make, twice at different sizes, since Dynamo specializes a
        # size it has seen once (and always a size of 1): padded rows come as one row, as rows of unequal
        # lengths (an attention mask) and as rows of one length (none); packed rows are always one row.
        kinds = [(2 * unit,), (3 * unit,), (unit, unit + unit // 8), (3 * unit // 2, 7 * unit // 4)]
        kinds += [(5 * unit // 4,) * 2, (2 * unit,) * 2]
        # Then micro-batches as large as the budget allows: Inductor guards its fusions on size ranges
        # (on the H100, 576 x row length < 5,242,880: rows over 9,102 tokens compiled again in the first
        # step, benchmarks/results/actor/first_step_h100_735798f.json), so the large rows of real steps are seen too.
        budget = self.micro_batch_tokens
        cap = min(budget // 2, getattr(self.policy.hf.config, "max_position_embeddings", None) or budget)
        if cap > 8 * unit:  # rows of about the budget, a little less, and half of it
            kinds += [(cap,) * (budget // cap), (cap, cap - unit), (cap // 2, cap // 2 - unit)]
        plans = [[made_up(n, (-1.0) ** i) for i, n in enumerate(lengths)] for lengths in kinds]
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            for samples in plans:
                num_tokens = sum(s.num_loss_tokens for s in samples)
                sums: dict[str, float] = defaultdict(float)
                micros = [micro.to(self.device) for micro in self._plan(samples)]
                for micro in micros:
                    self._ppo_micro_step(micro, num_tokens, sums, is_first=True, is_own_proximal=True)
                if self.recomputes:  # the old logprobs' no-grad recompute: graphs of its own
                    self._recompute_proximal([micros], sums)
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the made-up activations' blocks go back to the shared GPU

    @property
    def hf_model(self) -> torch.nn.Module:
        return self.policy.hf

    # ----------------------------------------------------------------- forward helpers
    def _forward(self, policy: PolicyModel, micro: MicroBatch, with_entropy: bool = False):
        """Logprobs (and entropies) at the loss positions of `micro` (already on the device, its
        `select_K` computed on the host, so no sync here)."""
        select_K = micro.select_K
        logprobs_K, entropy_K = policy(
            micro.input_ids_RL,
            micro.position_ids_RL,
            micro.attention_mask_RL,
            micro.labels_N,
            select_K,
            with_entropy,
            micro.cu_seqlens_S,
            micro.max_seqlen,
        )
        return logprobs_K, entropy_K, select_K, micro.mask_N.index_select(0, select_K)

    @torch.no_grad()
    def compute_logprobs(self, samples: list[TrainSample]) -> list[list[float]]:
        """Current-policy logprob of every loss token, aligned with input_ids (0.0 where loss_mask is 0)."""
        mine: dict[int, list[float]] = {}
        for micro in self._plan(samples):
            micro = micro.to(self.device)
            logprobs_K, _, select_K, mask_K = self._forward(self.policy, micro)
            full_N = torch.zeros_like(micro.mask_N).index_put_((select_K,), logprobs_K.float() * mask_K)
            with self._probe.waiting():  # split_per_sample copies to the host
                mine.update(zip(micro.sample_indices, micro.split_per_sample(full_N), strict=True))
        if self.world_size > 1:
            gathered: list[dict] = [{} for _ in range(self.world_size)]
            dist.all_gather_object(gathered, mine)
            mine = {k: v for part in gathered for k, v in part.items()}
        return [mine[i] for i in range(len(samples))]

    def _plan(self, samples: list[TrainSample]) -> list[MicroBatch]:
        return plan_rank_micro_batches(
            samples, self.rank, self.world_size, self.micro_batch_tokens, padded=self.is_padded
        )

    # ----------------------------------------------------------------- PPO
    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """`algorithm.n_minibatches` PPO updates on `samples` (the same list on every rank), then
        `weight_version += 1`.

        Every minibatch's micro-batches are planned and moved to the device once, before the first update.
        When the old logprobs are recomputed (an off-policy correction's proximal policy, or
        `algorithm.recompute_logprobs`), they are the actor's logprobs at the weights before the first
        update: the first minibatch's own forward is taken at those weights, so its logprobs, detached,
        are the old ones, and one no-grad pass recomputes only the later minibatches', into their
        micro-batches on the device (`_recompute_proximal`). With `algorithm.proximal_logprobs=current`
        every minibatch's own forward, detached, stands as the proximal policy; with `loglinear` the first
        minibatch's does, exact, and a later one's interpolates between it and the rollout's by each
        token's lag (`loglinear_proximal`): no extra pass.
        `train/actor/rollout_train_logprob_gap` = mean |logp_train - logp_rollout| before the first
        update: over all tokens when the old logprobs are recomputed, else over the first minibatch's.
        """
        if not samples:
            raise ValueError("Actor.train_step got no samples; hand over at least one trajectory.")
        start = time.perf_counter()
        self._probe = StepProbe(torch.device(self.device)).start()
        sums: dict[str, float] = defaultdict(float)
        minibatches = split_minibatches(samples, self.setup.algorithm.n_minibatches)
        plans = [[micro.to(self.device) for micro in self._plan(minibatch)] for minibatch in minibatches]
        if self.recomputes:
            self._recompute_proximal(plans[1:], sums)
        grad_norms = []
        for k, (minibatch, micros) in enumerate(zip(minibatches, plans, strict=True)):
            num_tokens = sum(s.num_loss_tokens for s in minibatch)
            is_first = k == 0
            is_own_proximal = self.is_proximal_current or (
                is_first and (self.recomputes or self.is_proximal_loglinear)
            )
            interpolates = self.is_proximal_loglinear and not is_first
            for micro in micros:
                self._ppo_micro_step(micro, num_tokens, sums, is_first, is_own_proximal, interpolates)
            grad_norms.append(self._optimizer_step())
        self.weight_version += 1
        return self._ppo_metrics(sums, grad_norms, time.perf_counter() - start)

    def _ppo_micro_step(
        self,
        micro: MicroBatch,
        num_tokens: int,
        sums: dict[str, float],
        is_first: bool,
        is_own_proximal: bool,
        interpolates: bool = False,
    ) -> None:
        """One micro-batch's loss and backward. `is_own_proximal`: this forward's logprobs, detached, are the
        old ones (the ratio is 1 here); `interpolates`: the old ones are `loglinear_proximal` of the rollout's
        and this forward's; `is_first`: the forward precedes the first update, so it measures the gap to the
        rollout's logprobs."""
        logprobs_K, entropy_K, select_K, mask_K = self._forward(self.policy, micro, with_entropy=True)
        old_K, adv_K = micro.old_logprobs_N[select_K], micro.advantages_N[select_K]
        ref_K = None
        if self.ref_policy is not None:
            with torch.no_grad():
                ref_K = self._forward(self.ref_policy, micro)[0]
        behav_K = micro.behav_logprobs_N[select_K]
        if is_own_proximal:
            old_K = logprobs_K.detach()
        elif interpolates:
            old_K = loglinear_proximal(behav_K, logprobs_K, micro.lags_N[select_K])
        losses_K, stats = ppo_token_losses(logprobs_K, old_K, adv_K, self.loss_cfg, ref_K, behav_K)
        loss_sum = (losses_K * mask_K).sum()
        (loss_sum * (self.world_size / max(num_tokens, 1))).backward()
        stats.update(loss=losses_K.detach(), entropy=entropy_K, tokens=torch.ones_like(mask_K))
        if is_first:
            stats.update(gap=(logprobs_K.detach() - behav_K).abs(), gap_tokens=torch.ones_like(mask_K))
        for name, value in masked_sum_tensors(stats, mask_K).items():
            sums[name] = sums[name] + value  # stays on the device: no host sync per micro-batch

    @torch.no_grad()
    def _recompute_proximal(self, plans: list[list[MicroBatch]], sums: dict[str, float]) -> None:
        """Old logprobs := the actor's at the current weights, for the micro-batches of `plans` (already on
        the device; the rollout's stay in `behav_logprobs_N` for the correction). Nothing leaves the
        device: no host copy, no per-token Python, no second plan of the samples."""
        for micros in plans:
            for micro in micros:
                logprobs_K, _, select_K, mask_K = self._forward(self.policy, micro)
                logprobs_K = logprobs_K.float()
                micro.old_logprobs_N = micro.old_logprobs_N.index_put((select_K,), logprobs_K)
                gap = {
                    "gap": (logprobs_K - micro.behav_logprobs_N[select_K]).abs(),
                    "gap_tokens": torch.ones_like(mask_K),
                }
                for name, value in masked_sum_tensors(gap, mask_K).items():
                    sums[name] = sums[name] + value

    def _optimizer_step(self) -> float:
        max_norm = self.setup.actor.optim.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(
            self.policy.parameters(), max_norm if max_norm > 0 else math.inf
        )
        with self._probe.waiting():  # the update's one host sync
            norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        self.last_lr = self.optimizer.param_groups[0]["lr"]
        if math.isfinite(norm):
            self.optimizer.step()
        else:  # one bad batch must not poison the weights; the schedule still advances
            self.num_skipped_updates += 1
            log.warning("non-finite grad norm at update %d: update skipped", self.num_updates)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.num_updates += 1
        return norm

    def _reduce(self, sums: dict, keys: tuple[str, ...]) -> dict[str, float]:
        """Sum each metric over ranks (one collective, one host sync)."""
        values = torch.stack(
            [torch.as_tensor(sums.get(k, 0.0), dtype=torch.float64).to(self.device) for k in keys]
        )
        if self.world_size > 1:
            dist.all_reduce(values)
        with self._probe.waiting():
            host_values = values.cpu().tolist()
        return dict(zip(keys, host_values, strict=True))

    def _ppo_metrics(
        self, sums: dict[str, float], grad_norms: list[float], elapsed_s: float
    ) -> dict[str, float]:
        total = self._reduce(sums, PPO_SUM_KEYS)
        tokens = max(total["tokens"], 1.0)
        metrics = {
            f"train/actor/{k}": total[k] / tokens
            for k in ("loss", "ratio_abs", "clip_fraction", "approx_kl", "entropy")
        }
        metrics["train/actor/rollout_train_logprob_gap"] = total["gap"] / max(total["gap_tokens"], 1.0)
        # the share of the positive advantage (summed over tokens) that the PPO clip removed from the step
        metrics["train/actor/clipped_pos_advantage_share"] = total["clipped_pos_advantage"] / max(
            total["pos_advantage"], 1e-12
        )
        if self.ref_policy is not None:
            metrics["train/actor/kl_ref"] = total["kl_ref"] / tokens
        if self.loss_cfg.off_policy_correction != "none":
            metrics["train/actor/is_weight_mean"] = total["is_weight"] / tokens
            metrics["train/actor/is_clip_fraction"] = total["is_clip_fraction"] / tokens
        metrics.update(
            {
                "train/actor/grad_norm": sum(grad_norms) / len(grad_norms),
                "train/actor/lr": self.last_lr,
                "train/actor/num_tokens": total["tokens"] / max(1, len(grad_norms)),
                "train/actor/num_updates": float(self.num_updates),
                "time/train_step": elapsed_s,
                **self._probe.metrics(),
            }
        )
        return metrics

    # ----------------------------------------------------------------- SFT
    def sft_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """One parameter update of token-mean cross-entropy over the loss tokens of `samples`."""
        if not samples:
            raise ValueError("Actor.sft_step got no samples.")
        num_tokens = sum(s.num_loss_tokens for s in samples)
        sums: dict[str, float] = defaultdict(float)
        for micro in self._plan(samples):
            logprobs_K, _, _, mask_K = self._forward(self.policy, micro.to(self.device))
            nll_sum = -(logprobs_K * mask_K).sum()
            (nll_sum * (self.world_size / max(num_tokens, 1))).backward()
            sums["loss"] = sums["loss"] + nll_sum.detach().double()
            sums["tokens"] = sums["tokens"] + mask_K.sum().double()
        grad_norm = self._optimizer_step()
        total = self._reduce(sums, ("loss", "tokens"))
        return {
            "train/sft/loss": total["loss"] / max(total["tokens"], 1.0),
            "train/sft/grad_norm": grad_norm,
            "train/sft/lr": self.last_lr,
            "train/sft/num_tokens": total["tokens"],
        }

    # ----------------------------------------------------------------- weights, checkpoints
    def iter_full_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) in state-dict order, tied weights once; each parameter is all-gathered
        from its shards, so every rank must consume the iterator (only one needs to send). A tensor may
        alias the live parameter (an unsharded actor whose weights are in `dtype`): clone it to keep it
        past the next update."""
        reshard(self.policy)
        persistent = set(self.policy.hf.state_dict().keys())
        named = list(self.policy.hf.named_parameters()) + [
            (n, b) for n, b in self.policy.hf.named_buffers() if n in persistent
        ]
        for name, tensor in named:
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            yield name, full.detach().to(dtype or self.compute_dtype)

    async def sync_weights(self, sender) -> dict[str, float]:
        """Push the full weights through a `rollout.weight_sync.WeightSender` (rank 0 sends)."""
        start = time.perf_counter()
        if self.rank == 0:
            result = await sender.push(self.iter_full_weights(), self.weight_version)
        else:
            result = {"bytes": sum(t.numel() * t.element_size() for _, t in self.iter_full_weights())}
        return {
            "time/sync_weights": time.perf_counter() - start,
            "sync_weights/bytes": float(result["bytes"]),
        }

    def save_checkpoint(self, ckpt_dir: str | Path, extra: dict[str, object] | None = None) -> Path:
        from tandemrl.trainer.checkpoint import save_checkpoint

        return save_checkpoint(self, ckpt_dir, extra)

    def load_checkpoint(self, ckpt_dir: str | Path) -> None:
        from tandemrl.trainer.checkpoint import load_checkpoint

        load_checkpoint(self, ckpt_dir)

    def export_hf(self, out_dir: str | Path) -> Path:
        from tandemrl.trainer.export import save_hf_dir

        # one tensor at a time: every rank takes part in each gather, rank 0 writes it (trainer/export.py)
        weights = self.iter_full_weights(dtype=torch.float32)
        if self.rank == 0:
            save_hf_dir(weights, self.policy.hf.config, self.model_path, out_dir)
        else:
            for _ in weights:
                pass
        if self.world_size > 1:
            dist.barrier()
        return Path(out_dir)
