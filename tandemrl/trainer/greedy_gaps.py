"""How far an engine's greedy output is from a model's own greedy choice, token by token: the measure
behind the weights check (runner/weights_check.py) and the engines benchmark's check
(benchmarks/engine/engines_gpu.py).

Exact equality is not the measure, because two correct bf16 forwards disagree at near-ties. Flash
attention with a KV cache against HF's full recompute, or bf16 against fp32, sums in another order. So
greedy picks a different token where the top two are a few hundredths of a nat apart, and the texts part
from there. On SmolLM2 (CPU), over the runner's 4 probes and 16 real questions, bf16 against fp32 and
eager against SDPA attention parted on 4 or 5 of the 20 prompts. The engine's token there was at most
0.19 nats below the actor's top. Wrong weights were far below:
- an engine still on the base model, scored by the cold-started actor (a real update never pushed), parted
  on 19 of 20 prompts, each by 1.19 nats or more;
- one whose MLPs were not halved as the actor's were parted on all 20, each by 2.3 nats or more.
`benchmarks/results/robustness/weights_check_ties.json` has the figures.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def argmax_gaps(model, prompt: list[int], continuation: list[int]) -> tuple[list[int], list[float]]:
    """Teacher-forced on `prompt + continuation` in one forward pass. For each continuation position it
    gives the model's argmax token and how many nats below that argmax the model ranks the
    continuation's token: 0.0 where they agree. A continuation is the model's own greedy output exactly
    when every gap is 0."""
    if not continuation:
        return [], []
    ids = torch.tensor([list(prompt) + list(continuation[:-1])], device=model.device)
    logits = model(ids).logits[0, len(prompt) - 1 :].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    top = logprobs.argmax(dim=-1)
    taken = torch.tensor(continuation, device=logprobs.device)
    gaps = logprobs.gather(1, top[:, None])[:, 0] - logprobs.gather(1, taken[:, None])[:, 0]
    return top.tolist(), gaps.clamp(min=0.0).tolist()
