"""Prompts for the runners: a small prefetch queue in front of the resumable `PromptLoader`.

Invariant: every prompt drawn from the loader is, at any moment, exactly one of prefetched here,
issued (in flight or buffered), trained, dropped, or set aside as too long. The loader's state is its position after the
last drawn prompt, so the prompts open at a checkpoint are the prefetched + in-flight + buffered ones
of save time (docs/DESIGN.md, Checkpoints and resume); after a resume they are handed out first
(`reissue`), ahead of the loader's next prompt. A dropped prompt is not re-queued: the loader's next
epoch brings it again, as it brings every prompt.

Too long: with `max_prompt_tokens` (the engine's context less the response budget, agent/evaluate.py
`prompt_room`) a prompt that does not fit is set aside with a warning, never issued, as verl's
`filter_overlong_prompts` does at load: the engine would refuse it (at once or in a later turn) and the run
would end on that error, however many steps in. Only a question whose UTF-8 bytes could make it too long
is tokenized (a byte-level token covers at least one byte), so a feed of short questions costs nothing.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandemrl.data.loader import Prompt, PromptLoader

log = logging.getLogger(__name__)

NUM_NAMED_OVERLONG = 10  # set-aside prompts warned about one by one; later ones every 1,000th
TOKEN_MARGIN = 8  # tokens the template and the question may gain where they join


class PromptFeed:
    def __init__(
        self, loader: PromptLoader, prefetch: int, tokenizer=None, max_prompt_tokens: int | None = None
    ):
        assert prefetch >= 1
        self.loader = loader
        self.prefetch = prefetch
        self._queue: deque[Prompt] = deque()
        self.num_drawn = 0
        self.tokenizer, self.max_prompt_tokens = tokenizer, max_prompt_tokens
        self._template_tokens: int | None = None
        self.num_overlong = 0

    @property
    def num_prefetched(self) -> int:
        return len(self._queue)

    def prefetched(self) -> list[Prompt]:
        return list(self._queue)

    def reissue(self, prompts: list[Prompt]) -> None:
        """Hand out `prompts` (open at the checkpoint resumed from) before anything else, in order."""
        self._queue.extendleft(reversed(prompts))

    def next(self) -> Prompt:
        """The next prompt that fits (see above); refused once a whole epoch's worth in a row did not."""
        if self.tokenizer is None or self.max_prompt_tokens is None:
            return self._draw()
        for _ in range(max(1, len(self.loader.prompts))):
            prompt = self._draw()
            num_tokens = self._overlong(prompt)
            if num_tokens is None:
                return prompt
            self._set_aside(prompt, num_tokens)
        raise ValueError(
            f"no prompt of data.train_data_paths fits: {len(self.loader.prompts)} in a row were longer than "
            f"{self.max_prompt_tokens} tokens, what rollout.max_context_len leaves after "
            "agentloop.max_response_tokens. Raise rollout.max_context_len or lower agentloop.max_response_tokens."
        )

    def _overlong(self, prompt: Prompt) -> int | None:
        """The prompt's token count when it exceeds `max_prompt_tokens`, else None."""
        from tandemrl.agent.prompt import build_prompt_ids

        if self._template_tokens is None:
            self._template_tokens = len(build_prompt_ids(self.tokenizer, ""))
        bound = self._template_tokens + TOKEN_MARGIN + len(prompt.question.encode("utf-8"))
        if bound <= self.max_prompt_tokens:
            return None
        num_tokens = len(build_prompt_ids(self.tokenizer, prompt.question))
        return num_tokens if num_tokens > self.max_prompt_tokens else None

    def _set_aside(self, prompt: Prompt, num_tokens: int) -> None:
        self.num_overlong += 1
        if self.num_overlong <= NUM_NAMED_OVERLONG or self.num_overlong % 1000 == 0:
            log.warning(
                "prompt %s set aside (%d so far): %d tokens, more than the %d that rollout.max_context_len "
                "leaves after agentloop.max_response_tokens",
                prompt.prompt_id,
                self.num_overlong,
                num_tokens,
                self.max_prompt_tokens,
            )

    def _draw(self) -> Prompt:
        """The next prompt of the queue; refills it from the loader (epochs wrap inside it)."""
        if not self._queue:
            prompts = self.loader.next_prompts(self.prefetch)
            if not prompts:
                raise ValueError(
                    "the training data is empty: data.train_data_paths holds no prompt. "
                    "Point it at a non-empty jsonl/parquet file (e.g. `tandem prepare all`)."
                )
            self.num_drawn += len(prompts)
            self._queue.extend(prompts)
        return self._queue.popleft()

    def loader_state(self) -> dict:
        return self.loader.state_dict()

    def position(self) -> tuple[int, int]:
        return tuple(self.loader.position)
