"""When a request is done: stop token ids (eos included unless `ignore_eos`), stop strings, length.

Stop strings are searched in the decoded tail of the output only (never the prompt), long enough to
hold the longest stop string, as SGLang does. Invariant: a request stops at the first token that
completes a stop condition, and that token stays in `output_ids`.
"""

from __future__ import annotations

from tandemrl.engine.sequence import Sequence


class StopChecker:
    def __init__(self, tokenizer, eos_ids: set[int]):
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)

    def check(self, seq: Sequence) -> dict | None:
        """The finish reason if `seq` is done after its last token, else None."""
        params, token_id = seq.params, seq.output_ids[-1]
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_ids):
            return {"type": "stop", "matched": token_id}
        if params.stop:
            longest = max(len(s) for s in params.stop)
            tail = self.tokenizer.decode(seq.output_ids[-(longest + 1) :])
            for stop in params.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        if len(seq.output_ids) >= params.max_new_tokens or seq.num_known_tokens >= seq.max_total_len:
            return {"type": "length", "length": len(seq.output_ids)}
        return None

    def output_text(self, seq: Sequence) -> str:
        """The decoded output, cut before a matched stop string unless `no_stop_trim` (SGLang's default)."""
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens)
        matched = (seq.finish_reason or {}).get("matched")
        if isinstance(matched, str) and not seq.params.no_stop_trim and matched in text:
            text = text[: text.index(matched)]
        return text
