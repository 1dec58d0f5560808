"""When a request is done: stop token ids (eos included unless `ignore_eos`), stop strings, length.

Stop strings are searched in the decoded tail of the output only (never the prompt), long enough to
hold the longest stop string, as SGLang does. Invariant: a request stops at the first token that
completes a stop condition, and that token stays in `output_ids`.

This runs for every row of every decode step, on the engine's one host thread, so its cost per row sets
how the step time grows with the batch (benchmarks/engine/engine_decode_steps.py). Decoding the tail costs a
tokenizer call per row; instead the tail is decoded only when the new token can complete a stop string:
a stop string completed by the last token ends inside that token's text, so the token's own text holds
the stop string's last character. A token whose text alone is not whole (a piece of a multi-byte
character, shown as U+FFFD) always takes the full check. Whatever the tokenizer's clean-up does, it only
removes spaces, so it never makes a character appear.
"""

from __future__ import annotations

from tandemrl.engine.sequence import Sequence

_PARTIAL = "\ufffd"  # what a lone piece of a multi-byte character decodes to


class StopChecker:
    def __init__(self, tokenizer, eos_ids: set[int]):
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (filled as tokens appear)
        self._last_chars: dict[tuple[str, ...], frozenset[str]] = {}  # stop strings -> their last characters
        self.num_tail_decodes = 0  # full tail decodes run (the prefilter's misses), for the benchmark

    def check(self, seq: Sequence) -> dict | None:
        """The finish reason if `seq` is done after its last token, else None."""
        params, token_id = seq.params, seq.output_ids[-1]
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_ids):
            return {"type": "stop", "matched": token_id}
        if params.stop and self._may_complete_stop(token_id, params.stop):
            self.num_tail_decodes += 1
            longest = max(len(s) for s in params.stop)
            tail = self.tokenizer.decode(seq.output_ids[-(longest + 1) :])
            for stop in params.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        if len(seq.output_ids) >= params.max_new_tokens or seq.num_known_tokens >= seq.max_total_len:
            return {"type": "length", "length": len(seq.output_ids)}
        return None

    def _may_complete_stop(self, token_id: int, stops: list[str]) -> bool:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        key = tuple(stops)
        last_chars = self._last_chars.get(key)
        if last_chars is None:
            last_chars = self._last_chars[key] = frozenset(s[-1] for s in stops if s)
        return _PARTIAL in text or not text or any(c in text for c in last_chars)

    def output_text(self, seq: Sequence) -> str:
        """The decoded output, cut before a matched stop string unless `no_stop_trim` (SGLang's default)."""
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens)
        matched = (seq.finish_reason or {}).get("matched")
        if isinstance(matched, str) and not seq.params.no_stop_trim and matched in text:
            text = text[: text.index(matched)]
        return text
