"""How well n-gram drafts (`rollout.engine.speculative: ngram`, tandemrl/engine/speculative.py) would fit a
run's own trajectories, replayed offline: decode steps per emitted token, tokens per step, acceptance and
verify rows per token, for each draft length and n-gram size range.

    python -m benchmarks.engine.ngram_drafts RUN/trajectories/step_*.jsonl [--out PATH]

Each trajectory's model turns (runs of loss_mask 1 in its response) are replayed as the engine runs them:
a turn is a request whose context is the prompt and everything before it (earlier turns, information
blocks); its first token comes from the prefill step, each later token from a decode step, where the
engine's own `NgramDrafter` proposes a draft from the context so far. The draft's tokens are accepted
while they equal the tokens the policy actually sampled, and the step emits those plus one. For a
trajectory sampled at T = 1 that is exact in expectation: speculative sampling with a point-mass draft x
accepts x with probability p(x), the probability that the policy sampled x. Draft tokens past the turn's
last token count as rejected (the engine would stop there). What this cannot say is the GPU cost of a
verify row against a decode row: that is `benchmarks/engine/speculative_h200.py`'s to measure.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from benchmarks import write_json
from tandemrl.engine.speculative import NgramDrafter

DRAFT_LENGTHS = (2, 3, 4, 6, 8)
NGRAM_RANGES = ((1, 3), (2, 3), (2, 4), (3, 5), (1, 5))


def model_turns(row: dict) -> list[tuple[int, int]]:
    """[start, end) of each model turn in prompt + response (runs of loss_mask 1 in the response)."""
    offset, turns, start = len(row["prompt_ids"]), [], None
    for i, mask in enumerate([*row["loss_mask"], 0]):
        if mask and start is None:
            start = i
        elif not mask and start is not None:
            turns.append((offset + start, offset + i))
            start = None
    return turns


def replay(rows: list[dict], num_draft_tokens: int, ngram_min: int, ngram_max: int) -> dict:
    """The drafter's figures over every model turn of `rows` (trajectory dicts with prompt_ids,
    response_ids and loss_mask)."""
    drafter = NgramDrafter(num_draft_tokens, ngram_min, ngram_max)
    steps = emitted = drafted = accepted = rows_verified = 0
    for row in rows:
        ids = list(row["prompt_ids"]) + list(row["response_ids"])
        for start, end in model_turns(row):
            request = SimpleNamespace(all_ids=ids[: start + 1], num_pending=0, ngram_index=None)
            position = start + 1  # the turn's first token came from its prefill
            while position < end:
                request.all_ids = ids[:position]
                draft = drafter.propose(request, num_draft_tokens)
                actual = ids[position:end]
                num_accepted = 0
                while num_accepted < len(draft) and num_accepted < len(actual) - 1:
                    if draft[num_accepted] != actual[num_accepted]:
                        break
                    num_accepted += 1
                step_tokens = num_accepted + 1
                steps += 1
                emitted += step_tokens
                drafted += len(draft)
                accepted += num_accepted
                rows_verified += 1 + len(draft)
                position += step_tokens
    return {
        "num_draft_tokens": num_draft_tokens,
        "ngram_min": ngram_min,
        "ngram_max": ngram_max,
        "decode_steps": steps,
        "emitted_tokens": emitted,
        "decode_steps_per_token": steps / emitted if emitted else None,
        "tokens_per_step": emitted / steps if steps else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "verify_rows_per_token": rows_verified / emitted if emitted else None,
    }


def load_rows(patterns: list[str]) -> list[dict]:
    paths = sorted({p for pattern in patterns for p in glob.glob(pattern)})
    if not paths:
        raise SystemExit(f"no trajectory files match {patterns}")
    return [json.loads(line) for path in paths for line in Path(path).read_text().splitlines() if line]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trajectories", nargs="+", help="trajectories/step_*.jsonl files (globs)")
    parser.add_argument("--out", default=None, help="the result JSON (default: print only)")
    parser.add_argument("--label", default="", help="what the trajectories are, for the JSON")
    args = parser.parse_args(argv)
    rows = load_rows(args.trajectories)
    results = [replay(rows, k, lo, hi) for k in DRAFT_LENGTHS for lo, hi in NGRAM_RANGES]
    num_model_tokens = sum(sum(r["loss_mask"]) for r in rows)
    print(f"{len(rows)} trajectories, {num_model_tokens} model tokens")
    print(f"{'k':>3} {'n':>5} {'steps/token':>12} {'tokens/step':>12} {'acceptance':>11} {'rows/token':>11}")
    for r in results:
        print(
            f"{r['num_draft_tokens']:>3} {r['ngram_min']}-{r['ngram_max']:<3} {r['decode_steps_per_token']:>12.3f} "
            f"{r['tokens_per_step']:>12.3f} {r['acceptance_rate'] or 0:>11.3f} {r['verify_rows_per_token']:>11.3f}"
        )
    if args.out:
        result = {
            "label": args.label,
            "trajectories": len(rows),
            "model_tokens": num_model_tokens,
            "files": args.trajectories,
            "results": results,
            "best_steps_per_token": min(results, key=lambda r: r["decode_steps_per_token"]),
            "command": " ".join(sys.argv),
        }
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
