"""The margin behind `runner.weights_check_tie_nats` (runner/weights_check.py). Each pair below has an
"engine" that answers greedily and an "actor" that scores that answer (trainer/greedy_gaps.py), on
SmolLM2-135M-Instruct, on CPU.

    python -m benchmarks.robustness.weights_check_ties [--questions .realtext/dev.jsonl] [--num-questions 16]
        [--tokens 16] [--out benchmarks/results/robustness/weights_check_ties.json]

- Same weights, another forward. These pairs should pass:
  - a bf16 engine scored by an fp32 actor;
  - eager attention scored by SDPA, both bf16;
  - an fp32 engine with a KV cache scored by a full recompute;
  - a bf16 engine with a KV cache scored by a bf16 full recompute (the runner's case on the GPU).
- Wrong weights. These pairs must fail:
  - an engine that kept its weights, scored by an actor whose MLP down-projections were halved (the
    engines benchmark's push, benchmarks/engine/engines_gpu.py);
  - an engine still on the base model, scored by an actor on the cold-started one (`tandem sft`), when
    it is prepared. This is a real training update that was never pushed.

The prompts are the runner's probes and, with --questions, real questions: FanOutQA's human-written
sub-questions (benchmarks/retrieval/realtext_data.py) in the model's chat template. For each pair it
reports each prompt's largest gap, the largest gap over same-weight pairs, and the smallest per-prompt
largest gap over wrong-weight pairs.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

import torch

from benchmarks import write_json
from tandemrl.config.schema import RunnerConfig
from tandemrl.runner.weights_check import PROBES
from tandemrl.trainer.greedy_gaps import argmax_gaps

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--questions", type=Path, default=None, help="a jsonl of {'question': ...} (real text)"
    )
    parser.add_argument("--num-questions", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/robustness/weights_check_ties.json"
    )
    return parser.parse_args(argv)


def load(model_dir: Path, dtype, attention: str = "sdpa", halve: bool = False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention).eval()
    if halve:
        for name, param in model.named_parameters():
            if name.endswith("mlp.down_proj.weight"):
                param.data.mul_(0.5)
    return model


@torch.no_grad()
def recompute_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].float().argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def cached_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy with a KV cache, one new token a forward, EOS taken like any token (the engines' ignore_eos;
    `generate(min_new_tokens=...)` would instead forbid EOS and pick the runner-up)."""
    # transformers 5.25 renamed the forward's `past_key_values` to `cache` (the old name warns until 5.40);
    # the GPU machine has 5.17, which knows only the old one
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(torch.tensor([prompt]), use_cache=True)
    ids = [int(out.logits[0, -1].float().argmax())]
    while len(ids) < num_tokens:
        out = model(torch.tensor([[ids[-1]]]), use_cache=True, **{key: getattr(out, key)})
        ids.append(int(out.logits[0, -1].float().argmax()))
    return ids


def prompts_of(tokenizer, args) -> dict[str, list[int]]:
    prompts = {f"probe: {text}": tokenizer.encode(text) for text in PROBES}
    if args.questions:
        lines = args.questions.read_text().splitlines()[: args.num_questions]
        for line in lines:
            question = json.loads(line)["question"]
            chat = [{"role": "user", "content": question}]
            encoded = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)
            prompts[f"question: {question}"] = list(encoded["input_ids"])
    return prompts


def measure(engine, actor, prompts: dict[str, list[int]], num_tokens: int, decode=recompute_greedy) -> dict:
    per_prompt = {}
    for name, prompt in prompts.items():
        output = decode(engine, prompt, num_tokens)
        argmax, gaps = argmax_gaps(actor, prompt, output)
        per_prompt[name] = {
            "divergent_tokens": sum(a != o for a, o in zip(argmax, output, strict=True)),
            "max_gap_nats": max(gaps),
        }
    maxima = [p["max_gap_nats"] for p in per_prompt.values()]
    return {
        "prompts_diverged": sum(p["divergent_tokens"] > 0 for p in per_prompt.values()),
        "max_gap_nats": max(maxima),
        "min_prompt_max_gap_nats": min(maxima),
        "per_prompt": per_prompt,
    }


def main(argv=None) -> None:
    from transformers import AutoTokenizer

    from tandemrl.host.home import default_coldstart_dir, default_model_dir

    args = parse_args(argv)
    base = default_model_dir()
    coldstart = default_coldstart_dir()
    tokenizer = AutoTokenizer.from_pretrained(base)
    prompts = prompts_of(tokenizer, args)
    f32, b16 = load(base, torch.float32), load(base, torch.bfloat16)
    same = {
        "bf16 engine, fp32 actor": measure(b16, f32, prompts, args.tokens),
        "bf16 eager engine, bf16 sdpa actor": measure(
            load(base, torch.bfloat16, "eager"), b16, prompts, args.tokens
        ),
        "fp32 KV-cache engine, fp32 recompute actor": measure(f32, f32, prompts, args.tokens, cached_greedy),
        # the runner's case on the GPU: an engine decoding bf16 with a KV cache, the actor scoring in bf16
        "bf16 KV-cache engine, bf16 recompute actor": measure(b16, b16, prompts, args.tokens, cached_greedy),
    }
    wrong = {
        "unpushed bf16 engine, halved-MLP bf16 actor": measure(
            b16, load(base, torch.bfloat16, halve=True), prompts, args.tokens
        ),
        "unpushed fp32 engine, halved-MLP fp32 actor": measure(
            f32, load(base, torch.float32, halve=True), prompts, args.tokens
        ),
    }
    if (coldstart / "config.json").exists():
        wrong["base bf16 engine, cold-started bf16 actor"] = measure(
            b16, load(coldstart, torch.bfloat16), prompts, args.tokens
        )
        cold16, cold32 = load(coldstart, torch.bfloat16), load(coldstart, torch.float32)
        same["cold-started: bf16 engine, fp32 actor"] = measure(cold16, cold32, prompts, args.tokens)
    for group in (same, wrong):
        for name, result in group.items():
            print(
                f"{name}: {result['prompts_diverged']}/{len(prompts)} prompts diverged, largest gap "
                f"{result['max_gap_nats']:.3f}, smallest per-prompt largest gap "
                f"{result['min_prompt_max_gap_nats']:.3f} nats",
                flush=True,
            )
    report = {
        "command": "python -m benchmarks.robustness.weights_check_ties "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "model": str(base),
        "device": "cpu",
        "tokens": args.tokens,
        "prompts": len(prompts),
        "questions": str(args.questions) if args.questions else None,
        "tie_nats_default": RunnerConfig.weights_check_tie_nats,
        "same_weights_largest_gap_nats": max(r["max_gap_nats"] for r in same.values()),
        "wrong_weights_smallest_prompt_gap_nats": min(r["min_prompt_max_gap_nats"] for r in wrong.values()),
        "wrong_weights_largest_gap_nats_min_over_pairs": min(r["max_gap_nats"] for r in wrong.values()),
        # the runner's own statistic: the largest gap over its probes (PROBES), the least over wrong pairs
        "wrong_weights_probe_largest_gap_nats_min_over_pairs": min(
            max(p["max_gap_nats"] for name, p in r["per_prompt"].items() if name.startswith("probe: "))
            for r in wrong.values()
        ),
        "same_weights": same,
        "wrong_weights": wrong,
    }
    print(
        f"same weights: largest gap {report['same_weights_largest_gap_nats']:.3f} nats; wrong weights: every "
        f"pair's largest gap >= {report['wrong_weights_largest_gap_nats_min_over_pairs']:.3f} nats, over the "
        f"runner's probes >= {report['wrong_weights_probe_largest_gap_nats_min_over_pairs']:.3f} "
        f"(default margin {report['tie_nats_default']})",
        flush=True,
    )
    write_json(args.out, report)


if __name__ == "__main__":
    main()
