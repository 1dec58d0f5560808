"""How far an engine's greedy output is from a model's own greedy choice, token by token: the measure
behind the weights check (runner/weights_check.py) and the engines benchmark's check
(benchmarks/engine/engines_gpu.py).

Exact equality is not the measure, because two correct bf16 forwards disagree at near-ties. Flash
attention with a KV cache against HF's full recompute, or bf16 against fp32, sums in another order, and
vLLM takes its argmax over bf16 logits. So greedy picks a different token where the top two are a few
hundredths of a nat apart, and the texts part from there. On SmolLM2 (CPU), over the runner's 4 probes
and 16 real questions, bf16 against fp32, eager against SDPA attention and a bf16 KV cache against a
bf16 recompute parted on 4 to 6 of the 20 prompts, the engine's token at most 0.2 nats below the actor's
top. Wrong weights were far below:
- an engine still on the base model, scored by the cold-started actor (a real update never pushed), parted
  on 19 of 20 prompts, each by 1.17 nats or more;
- one whose MLPs were not halved as the actor's were parted on all 20, each by 2.3 nats or more.
Over the runner's 4 probes, the largest gap of every wrong pair was 6.8 nats or more.
`benchmarks/results/robustness/weights_check_ties.json` has the figures.
"""

from __future__ import annotations

import torch

from tandemrl.trainer.policy import head_logit_scale, uses_packed_rows


@torch.no_grad()
def argmax_gaps(model, prompt: list[int], continuation: list[int]) -> tuple[list[int], list[float]]:
    """Teacher-forced on `prompt + continuation` in one forward pass. For each continuation position it
    gives the model's argmax token and how many nats below that argmax the model ranks the
    continuation's token: 0.0 where they agree. A continuation is the model's own greedy output exactly
    when every gap is 0.

    The logits are computed in fp32 from the model's last hidden state (the head in fp32, as the
    trainer's logprobs are), not read from a bf16 forward: bf16 logits near 30 are rounded to steps of
    0.125-0.25 nats, which measured a vLLM near-tie as 0.25 and 0.5 nats on an H100. A model whose
    attention packs rows (the actor's `tandem_varlen` or flash kinds, trainer/policy.py
    `uses_packed_rows`) gets the row's sample boundaries, as the trainer passes them."""
    if not continuation:
        return [], []
    ids = torch.tensor([list(prompt) + list(continuation[:-1])], device=model.device)
    packed = {}
    if uses_packed_rows(model.config._attn_implementation or ""):
        length = ids.shape[1]
        bounds = torch.tensor([0, length], dtype=torch.int32, device=ids.device)
        packed = dict(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=length, max_length_k=length)
    hidden = model.base_model(input_ids=ids, use_cache=False, **packed).last_hidden_state
    head = model.get_output_embeddings()
    logits = hidden[0, len(prompt) - 1 :].float() @ head.weight.float().T
    if getattr(head, "bias", None) is not None:
        logits = logits + head.bias.float()
    scale = head_logit_scale(model.config)  # Cohere's and Granite's factor, as HF's forward applies it
    if scale != 1.0:
        logits = logits * scale
    logprobs = torch.log_softmax(logits, dim=-1)
    top = logprobs.argmax(dim=-1)
    taken = torch.tensor(continuation, device=logprobs.device)
    gaps = logprobs.gather(1, top[:, None])[:, 0] - logprobs.gather(1, taken[:, None])[:, 0]
    return top.tolist(), gaps.clamp(min=0.0).tolist()
