"""FSDP2 on CPU: 2 gloo ranks end 3 train steps with the same parameters as 1 rank on the same data
(with the TIS off-policy correction, so each rank recomputes the proximal logprobs of its own micro-batches,
and the weight statistics and the rollout-train gap are summed over ranks), and their sharded checkpoint loads into a 1-rank actor (DCP reshards on
load)."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from tandemrl.trainer.actor import Actor
from tests.conftest import free_port
from tests.integration.trainer_helpers import cpu_actor_setup, rank_worker, train_steps

OVERRIDES = [
    "actor.optim.lr=0.0001",
    "algorithm.n_minibatches=2",
    "actor.micro_batch_tokens=80",
    "algorithm.off_policy_correction=tis",  # implies recomputing the old logprobs
]


def _run(world_size: int, model_dir, out_file) -> dict:
    mp.spawn(
        rank_worker,
        args=(world_size, free_port(), str(model_dir), str(out_file), 3, OVERRIDES),
        nprocs=world_size,
        join=True,
    )
    return torch.load(out_file, weights_only=True)


def test_two_gloo_ranks_match_one_rank(tiny_llama_dir, tmp_path):
    torch.set_num_threads(1)
    one = train_steps(tiny_llama_dir, 3, OVERRIDES)  # world size 1, in this process
    two = _run(2, tiny_llama_dir, tmp_path / "two.pt")
    initial = load_file(tiny_llama_dir / "model.safetensors")
    moved = max((one["weights"][k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-4, "training must move the weights far more than the tolerance"
    max_diff = max((one["weights"][k] - two["weights"][k]).abs().max().item() for k in one["weights"])
    print(f"max |param(1 rank) - param(2 ranks)| after 3 steps: {max_diff:.2e}")
    assert max_diff <= 1e-5
    for m1, m2 in zip(one["metrics"], two["metrics"], strict=True):
        assert abs(m1["train/actor/loss"] - m2["train/actor/loss"]) < 1e-5
        assert m1["train/actor/num_tokens"] == m2["train/actor/num_tokens"]
        keys = (
            "train/actor/is_weight_mean",
            "train/actor/is_clip_fraction",
            "train/actor/rollout_train_logprob_gap",
        )
        for key in keys:
            assert abs(m1[key] - m2[key]) < 1e-5, key
    clip = one["metrics"][0]["train/actor/is_clip_fraction"]
    assert 0.0 < clip < 1.0, clip  # the helpers' random rollout logprobs: some weights over the cap 2
    # the 2-rank checkpoint, resharded onto this process's single rank
    actor = Actor(cpu_actor_setup(tiny_llama_dir, *OVERRIDES))
    actor.load_checkpoint(tmp_path / "ckpt")
    assert actor.weight_version == 3
    loaded = {name: t for name, t in actor.iter_full_weights()}
    assert all(torch.equal(loaded[k], two["weights"][k]) for k in two["weights"])
    assert sorted(p.name for p in (tmp_path / "ckpt" / "actor").glob("rng_rank*.pt")) == [
        "rng_rank0.pt",
        "rng_rank1.pt",
    ]
