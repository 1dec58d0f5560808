"""`actor.param_dtype=bfloat16` (and `actor.optim.state_dtype`) on CPU with a tiny Llama: bf16 weights,
gradients and reference model, fp32 (or bf16) AdamW moments, steps close to the fp32 actor's; a checkpoint
resumes them exactly; 2 gloo ranks (FSDP2, bf16 shards) train and their checkpoint reshards onto one rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from tandemrl.trainer.actor import Actor
from tandemrl.trainer.checkpoint import checkpoint_dir
from tandemrl.trainer.low_precision import LowPrecisionAdamW
from tests.conftest import free_port
from tests.integration.trainer_helpers import cpu_actor_setup, join_as_rank, leave_together, make_samples

OVERRIDES = (
    "actor.optim.lr=0.001",
    "algorithm.n_minibatches=2",
    "actor.micro_batch_tokens=96",
    "algorithm.off_policy_correction=tis",  # the proximal logprobs recomputed: the loss depends on the model
)
BF16 = "actor.param_dtype=bfloat16"


def _weights(actor: Actor) -> dict[str, torch.Tensor]:
    return {name: t.float().clone() for name, t in actor.iter_full_weights()}


def _moments(actor: Actor) -> list[torch.Tensor]:
    return [state[k] for state in actor.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]


def _train(model_dir: Path, *overrides: str, num_steps: int = 3):
    torch.set_num_threads(1)
    actor = Actor(cpu_actor_setup(model_dir, *OVERRIDES, *overrides))
    start = _weights(actor)
    metrics = [actor.train_step(make_samples(seed=s, num_samples=6)) for s in range(num_steps)]
    return actor, start, metrics


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_bf16_parameters_step_close_to_fp32(tiny_llama_dir, state_dtype):
    """Same data, 3 steps (6 updates): the bf16 actor's losses, its update (weights now minus at the start)
    and its logprobs afterwards stay close to the fp32 actor's; its weights and reference model are
    bf16, the rotary frequencies fp32, the moments `state_dtype`."""
    fp32, start32, metrics32 = _train(tiny_llama_dir, "algorithm.kl_coef=0.1")
    bf16, start16, metrics16 = _train(
        tiny_llama_dir, BF16, f"actor.optim.state_dtype={state_dtype}", "algorithm.kl_coef=0.1"
    )
    assert bf16.compute_dtype == torch.bfloat16 and isinstance(bf16.optimizer, LowPrecisionAdamW)
    assert {p.dtype for p in bf16.policy.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in bf16.ref_policy.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in bf16.hf_model.buffers()} == {torch.float32}
    assert {m.dtype for m in _moments(bf16)} == {getattr(torch, state_dtype)}
    assert len(_moments(bf16)) == 2 * len(list(bf16.policy.parameters()))

    loss_gap = max(
        abs(a["train/actor/loss"] - b["train/actor/loss"]) for a, b in zip(metrics32, metrics16, strict=True)
    )
    moved32 = {k: _weights(fp32)[k] - start32[k] for k in start32}
    moved16 = {k: _weights(bf16)[k] - start16[k] for k in start16}
    norm = sum(v.pow(2).sum() for v in moved32.values()).sqrt()
    update_gap = (sum((moved16[k] - moved32[k]).pow(2).sum() for k in moved32).sqrt() / norm).item()
    held_out = make_samples(seed=9, num_samples=4)
    logprob_gap = max(
        abs(a - b)
        for x, y in zip(fp32.compute_logprobs(held_out), bf16.compute_logprobs(held_out), strict=True)
        for a, b in zip(x, y, strict=True)
    )
    print(
        f"bf16 ({state_dtype} moments) vs fp32: |loss| {loss_gap:.1e}, update {update_gap:.3f}, "
        f"|logprob| {logprob_gap:.3f}"
    )
    assert norm > 1e-2, "the fp32 actor must move its weights for the comparison to mean anything"
    # observed on CPU (fp32 / bf16 moments): loss 4.0e-4 / 1.2e-4, update 0.041 / 0.041, logprobs 0.016 / 0.022
    assert loss_gap < 5e-3
    assert update_gap < 0.2
    assert logprob_gap < 0.1


def test_bf16_checkpoint_resumes_exactly(tiny_llama_dir, tmp_path):
    """Save after 2 steps, then step 3: a fresh bf16 actor loading the checkpoint has the bf16 weights and
    fp32 moments bit for bit, and its step 3 (same RNG, so the same stochastic rounding) equals the original's."""
    straight, _, _ = _train(tiny_llama_dir, BF16, num_steps=2)
    ckpt = straight.save_checkpoint(checkpoint_dir(tmp_path, 2))
    saved_weights, saved_moments = _weights(straight), [m.clone() for m in _moments(straight)]
    last = straight.train_step(make_samples(seed=2, num_samples=6))

    resumed = Actor(cpu_actor_setup(tiny_llama_dir, *OVERRIDES, BF16))
    resumed.load_checkpoint(ckpt)
    assert {p.dtype for p in resumed.policy.parameters()} == {torch.bfloat16}
    loaded = _weights(resumed)
    assert all(torch.equal(loaded[k], saved_weights[k]) for k in saved_weights)
    assert all(m.dtype == torch.float32 for m in _moments(resumed))
    assert all(torch.equal(a, b) for a, b in zip(_moments(resumed), saved_moments, strict=True))
    again = resumed.train_step(make_samples(seed=2, num_samples=6))
    assert again["train/actor/loss"] == last["train/actor/loss"]
    a, b = _weights(straight), _weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _bf16_rank_worker(rank: int, port: int, model_dir: str, out_file: str) -> None:
    """One of 2 ranks: 2 bf16 steps and a checkpoint; rank 0 saves what the test checks."""
    join_as_rank(rank, 2, port)
    actor = Actor(cpu_actor_setup(Path(model_dir), *OVERRIDES, BF16))
    metrics = [actor.train_step(make_samples(seed=s, num_samples=6)) for s in range(2)]
    actor.save_checkpoint(Path(out_file).parent / "ckpt")
    params = list(actor.policy.parameters())
    found = {
        "dtensor": all(isinstance(p, DTensor) for p in params),
        "param_dtypes": sorted({str(p.to_local().dtype) for p in params}),
        "moment_dtypes": sorted({str(m.dtype) for m in _moments(actor)}),
        "moments_sharded": all(isinstance(m, DTensor) for m in _moments(actor)),
        "weights": _weights(actor),
        "losses": [m["train/actor/loss"] for m in metrics],
    }
    if rank == 0:
        torch.save(found, out_file)
    leave_together()


def test_two_ranks_train_bf16_shards_and_reshard_onto_one(tiny_llama_dir, tmp_path):
    """FSDP2 over 2 gloo ranks with bf16 shards and fp32 moments sharded alike; their losses match one
    rank's (the first step's forward is the same model); their checkpoint loads into a 1-rank actor exactly."""
    mp.spawn(
        _bf16_rank_worker,
        args=(free_port(), str(tiny_llama_dir), str(tmp_path / "two.pt")),
        nprocs=2,
        join=True,
    )
    two = torch.load(tmp_path / "two.pt", weights_only=True)
    assert two["dtensor"] and two["moments_sharded"]
    assert two["param_dtypes"] == ["torch.bfloat16"] and two["moment_dtypes"] == ["torch.float32"]
    one, start, metrics = _train(tiny_llama_dir, BF16, num_steps=2)
    assert any(not torch.equal(two["weights"][k], start[k]) for k in start), "2 ranks must train"
    gaps = [abs(m["train/actor/loss"] - loss) for m, loss in zip(metrics, two["losses"], strict=True)]
    print(f"|loss(1 rank) - loss(2 ranks)|, bf16: {gaps}")
    assert max(gaps) < 5e-3  # observed 1.2e-4 and 2.0e-4
    one.load_checkpoint(tmp_path / "ckpt")
    assert {p.dtype for p in one.policy.parameters()} == {torch.bfloat16}
    assert all(m.dtype == torch.float32 for m in _moments(one))
    loaded = _weights(one)
    assert all(torch.equal(loaded[k], two["weights"][k]) for k in loaded)


@pytest.mark.parametrize(("saved", "resumed"), [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_checkpoint_resumes_in_the_other_param_dtype(tiny_llama_dir, tmp_path, saved, resumed):
    """A run saved with one `actor.param_dtype` resumes with the other (to halve the actor's memory, or to
    leave bf16): the weights are the saved ones in the new dtype (fp32 to bf16 rounds to nearest, once),
    the fp32 moments come back exactly, the optimizer is the one the new dtype takes, and it trains on."""
    straight, _, _ = _train(tiny_llama_dir, f"actor.param_dtype={saved}", num_steps=2)
    ckpt = straight.save_checkpoint(checkpoint_dir(tmp_path, 2))
    saved_weights, saved_moments = _weights(straight), [m.clone() for m in _moments(straight)]

    actor = Actor(cpu_actor_setup(tiny_llama_dir, *OVERRIDES, f"actor.param_dtype={resumed}"))
    actor.load_checkpoint(ckpt)
    dtype = getattr(torch, resumed)
    assert {p.dtype for p in actor.policy.parameters()} == {dtype}
    assert isinstance(actor.optimizer, LowPrecisionAdamW) == (resumed == "bfloat16")
    loaded = _weights(actor)
    assert all(torch.equal(loaded[k], saved_weights[k].to(dtype).float()) for k in saved_weights)
    assert all(m.dtype == torch.float32 for m in _moments(actor))
    assert all(torch.equal(a, b) for a, b in zip(_moments(actor), saved_moments, strict=True))
    assert actor.num_updates == straight.num_updates
    actor.train_step(make_samples(seed=2, num_samples=6))
    moved = _weights(actor)
    assert any(not torch.equal(moved[k], loaded[k]) for k in loaded), "the resumed actor must train"
