"""The resumable prompt loader behind `data.train_data_paths` / `data.val_data_paths`.

Epoch e visits every prompt once, in the order of `random.Random(seed * 1_000_003 + e)` shuffling
the concatenated files (or file order without shuffle); the loader is an endless iterator over
epochs. Invariant: the position (epoch, index) — index = prompts already issued in that epoch —
determines everything that follows, so restoring a saved position in any process replays exactly
the prompts an uninterrupted run would have issued next.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

from tandemrl.data.dataset import read_records
from tandemrl.host.files import InputFileError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    prompt_id: str  # "<file stem>:<record key>" (`record_keys`), stable across runs and processes
    question: str
    golden_answers: list[str]
    data_source: str


def file_keys(paths: list[Path]) -> list[str]:
    """The id prefix of each file: its stem, or parent/stem where two files share a stem."""
    stems = [path.stem for path in paths]
    return [f"{path.parent.name}/{path.stem}" if stems.count(path.stem) > 1 else path.stem for path in paths]


def record_keys(records: list[dict]) -> list[str]:
    """Each record's key within its file: its id, or "<data_source>/<id>" for every record of a file whose
    ids repeat, as in Search-R1's merged nq_hotpotqa_train, which numbers each source's rows from 0
    (`extra_info.index`). The rule reads only the file, so a prompt keeps its id across runs and resumes."""
    ids = [record["id"] for record in records]
    if len(set(ids)) == len(ids) or len({record["data_source"] for record in records}) == 1:
        return ids
    return [f"{record['data_source']}/{record['id']}" for record in records]


def load_prompts(paths: list[str | Path], limit: int | None = None) -> list[Prompt]:
    """All prompts of the files, in file order (the first `limit` only, when given)."""
    if not paths:
        raise InputFileError(
            "no data files given: set data.train_data_paths (or data.val_data_paths) to one or "
            "more jsonl/parquet files, e.g. the default KB's train.jsonl from `tandem prepare kb`."
        )
    paths = [Path(path) for path in paths]
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for path, key in zip(paths, file_keys(paths), strict=True):
        records = read_records(path)
        for record, record_key in zip(records, record_keys(records), strict=True):
            prompt_id = f"{key}:{record_key}"
            if prompt_id in seen:
                raise InputFileError(
                    f"duplicate prompt id {prompt_id!r} in {path}: record ids (`id`, or Search-R1's "
                    "`extra_info.index`) must be unique within a file and data source (and a file must "
                    "not be listed twice)."
                )
            seen.add(prompt_id)
            prompts.append(
                Prompt(prompt_id, record["question"], record["golden_answers"], record["data_source"])
            )
    if not prompts:
        raise InputFileError(f"the data files {[str(p) for p in paths]} hold no questions.")
    return prompts[:limit] if limit is not None else prompts


class PromptLoader:
    """Endless, per-epoch shuffled iterator of prompts with an exactly restorable position."""

    def __init__(self, paths: list[str | Path], seed: int, shuffle: bool = True):
        self.paths = [str(path) for path in paths]
        self.prompts = load_prompts(self.paths)
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self.prompts)

    def __iter__(self) -> PromptLoader:
        return self

    def __next__(self) -> Prompt:
        if self.index >= len(self.prompts):
            self.epoch += 1
            self.index = 0
            self._order = self._epoch_order(self.epoch)
        prompt = self.prompts[self._order[self.index]]
        self.index += 1
        return prompt

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_prompts(self, num: int) -> list[Prompt]:
        """The next `num` prompts, crossing into the next epoch when this one runs out."""
        if num < 0:
            raise ValueError(f"next_prompts(num={num}): num must be >= 0.")
        return [next(self) for _ in range(num)]

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, prompts already issued in that epoch)."""
        return self.epoch, self.index

    @property
    def num_issued(self) -> int:
        """Prompts issued since the start of epoch 0 (the count skipped on resume)."""
        return self.epoch * len(self.prompts) + self.index

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": len(self.prompts),
            "paths": list(self.paths),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a position; the data must be the same as when it was saved (checked by size and seed)."""
        if state["num_prompts"] != len(self.prompts):
            raise ValueError(
                f"cannot resume the prompt loader: the checkpoint was saved over "
                f"{state['num_prompts']} prompts but the data files now hold {len(self.prompts)}. "
                "Resume with the same data.train_data_paths as the original run."
            )
        if (state["seed"], state["shuffle"]) != (self.seed, self.shuffle):
            raise ValueError(
                f"cannot resume the prompt loader: it was saved with seed={state['seed']} "
                f"shuffle={state['shuffle']}, now seed={self.seed} shuffle={self.shuffle}. "
                "Resume with the original data.seed and data.shuffle."
            )
        if not 0 <= state["index"] <= len(self.prompts) or state["epoch"] < 0:
            raise ValueError(
                f"invalid loader position (epoch={state['epoch']}, index={state['index']}) for "
                f"{len(self.prompts)} prompts."
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._epoch_order(self.epoch)
        # position only: the count of prompts re-issued or skipped is logged once, by the runner
        log.info("prompt loader resumed at epoch %d index %d", self.epoch, self.index)
