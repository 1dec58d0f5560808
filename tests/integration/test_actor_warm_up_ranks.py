"""The actor's warm-up across ranks (`trainer/actor.py`, `Actor.warm_up`): 2 gloo ranks each hold a share of the
made-up micro-batches (one rank may get only FSDP's empty padding batch), so the warm-up must keep their
collectives in step, and the train step after it must be the one a cold actor takes."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.multiprocessing as mp

from tests.conftest import free_port
from tests.integration.trainer_helpers import cpu_actor_setup, join_as_rank, leave_together, make_samples


def _worker(rank: int, port: int, model_dir: str, out_file: str) -> None:
    join_as_rank(rank, 2, port)
    from tandemrl.trainer.actor import Actor

    overrides = ("actor.optim.lr=0.001", "actor.micro_batch_tokens=2048", "algorithm.recompute_logprobs=true")
    samples = make_samples(seed=7, num_samples=8)
    cold = Actor(cpu_actor_setup(Path(model_dir), *overrides))
    warm = Actor(cpu_actor_setup(Path(model_dir), *overrides))
    warm.warm_up()
    m_cold, m_warm = cold.train_step(samples), warm.train_step(samples)
    weights_cold = {n: t.clone() for n, t in cold.iter_full_weights()}
    weights_warm = {n: t.clone() for n, t in warm.iter_full_weights()}
    if rank == 0:
        torch.save({"cold": (m_cold, weights_cold), "warm": (m_warm, weights_warm)}, out_file)
    leave_together()


def test_two_ranks_warm_up_in_step_and_train_as_a_cold_actor(tiny_llama_dir, tmp_path):
    out = tmp_path / "result.pt"
    mp.spawn(_worker, args=(free_port(), str(tiny_llama_dir), str(out)), nprocs=2, join=True)
    result = torch.load(out)
    (m_cold, w_cold), (m_warm, w_warm) = result["cold"], result["warm"]
    for key in ("loss", "entropy", "grad_norm", "rollout_train_logprob_gap"):
        assert m_warm[f"train/actor/{key}"] == m_cold[f"train/actor/{key}"], key
    assert w_warm.keys() == w_cold.keys()
    assert all(torch.equal(w_warm[n], w_cold[n]) for n in w_cold)
