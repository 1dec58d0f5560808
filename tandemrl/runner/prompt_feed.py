"""Prompts for the runners: a small prefetch queue in front of the resumable `PromptLoader`.

Invariant: every prompt drawn from the loader is, at any moment, exactly one of prefetched here,
issued (in flight or buffered), trained or dropped. The loader's state is its position after the
last drawn prompt, so the prompts open at a checkpoint are the prefetched + in-flight + buffered ones
of save time (docs/DESIGN.md, Checkpoints and resume); after a resume they are handed out first
(`reissue`), ahead of the loader's next prompt. A dropped prompt is not re-queued: the loader's next
epoch brings it again, as it brings every prompt.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandemrl.data.loader import Prompt, PromptLoader


class PromptFeed:
    def __init__(self, loader: PromptLoader, prefetch: int):
        assert prefetch >= 1
        self.loader = loader
        self.prefetch = prefetch
        self._queue: deque[Prompt] = deque()
        self.num_drawn = 0

    @property
    def num_prefetched(self) -> int:
        return len(self._queue)

    def prefetched(self) -> list[Prompt]:
        return list(self._queue)

    def reissue(self, prompts: list[Prompt]) -> None:
        """Hand out `prompts` (open at the checkpoint resumed from) before anything else, in order."""
        self._queue.extendleft(reversed(prompts))

    def next(self) -> Prompt:
        """The next prompt; refills the prefetch queue from the loader (epochs wrap inside it)."""
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
