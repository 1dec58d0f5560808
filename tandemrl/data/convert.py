"""Converters between Search-R1's data and ours.

- Questions: Search-R1's parquet (e.g. `nq_hotpotqa_train`, made by scripts/data_process/nq_search.py)
  stores the question inside the instruction prompt (`prompt` = [{"role": "user", "content":
  "Answer the given question. ... Question: {question}\\n"}]) and the answers in
  `reward_model.ground_truth.target`; we write {"id", "question", "golden_answers", "data_source"} jsonl.
- Corpus: wiki-18 jsonl ({"id", "contents": "\\"Title\\"\\ntext"}) is read as is by `iter_corpus`.
Invariant: conversion loses nothing the reward needs: every gold answer and the question text verbatim.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from tandemrl.data.dataset import normalize_record, read_raw_records


def convert_searchr1_parquet(src: str | Path, dst: str | Path, limit: int | None = None) -> int:
    """Write a Search-R1 question parquet as our jsonl; returns the number of records written."""

    src, dst = Path(src), Path(dst)
    raws = read_raw_records(src)[:limit]
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row, raw in enumerate(raws):
            record = normalize_record(raw, src, row)
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, dst)
    return len(raws)


def iter_corpus(path: str | Path) -> Iterator[dict]:
    """Passages {"id": str, "contents": "\\"Title\\"\\ntext"} of a wiki-18 style jsonl, streamed.

    Rows with separate `title` and `text` fields (another common dump) are joined into `contents`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"corpus file {path} does not exist; run `tandem prepare kb` or point "
            "retrieval.corpus_path at a wiki-18 jsonl."
        )
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "contents" not in row:
                if "text" not in row:
                    raise ValueError(
                        f"{path}:{line_number}: a passage needs `contents` (wiki-18 format) or "
                        "`title` + `text`."
                    )
                row = {**row, "contents": f'"{row.get("title", "")}"\n{row["text"]}'}
            yield {"id": str(row.get("id", line_number - 1)), "contents": row["contents"]}


def split_contents(contents: str) -> tuple[str, str]:
    """(title, text) of a wiki-18 `contents` string; the title loses its quotes."""
    title, _, text = contents.partition("\n")
    return title.strip().strip('"'), text
