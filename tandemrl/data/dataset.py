"""Reading question files: our jsonl (Search-R1 data format) and parquet, including Search-R1's own
parquet layout (`prompt` chat messages, `reward_model.ground_truth.target`).

Invariant: every record comes out as {"id", "question", "golden_answers" (non-empty list of str),
"data_source"}, in file order, or the file is rejected with an error naming the path and the row.
"""

from __future__ import annotations

import json
from pathlib import Path

from tandemrl.data.convert import searchr1_answers, searchr1_question

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet")


def read_raw_records(path: str | Path) -> list[dict]:
    """The rows of a jsonl / json-lines / parquet file as dicts, in file order."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"data file {path} does not exist. Check data.train_data_paths / "
            "data.val_data_paths, or run `tandem prepare kb` to generate the default data."
        )
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix == ".json" and path.read_text(encoding="utf-8").lstrip().startswith("["):
        return list(json.loads(path.read_text(encoding="utf-8")))  # one JSON array of records
    if path.suffix in (".jsonl", ".json"):
        records = []
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ValueError(
                        f"{path}:{line_number} is not valid JSON ({error}); the file must hold "
                        "one JSON object per line."
                    ) from error
        return records
    raise ValueError(
        f"data file {path} has an unsupported suffix {path.suffix!r}; use one of "
        f"{', '.join(SUPPORTED_SUFFIXES)}."
    )


def normalize_record(raw: dict, path: Path, row: int) -> dict:
    """One row as {"id", "question", "golden_answers", "data_source"} (our or Search-R1's layout)."""
    question = raw.get("question") or searchr1_question(raw)
    answers = raw.get("golden_answers")
    if answers is None:
        answers = searchr1_answers(raw)
    if isinstance(answers, str):
        answers = [answers]
    answers = [str(answer) for answer in (answers or [])]
    if not question or not answers:
        raise ValueError(
            f"{path} row {row}: a question and at least one gold answer are required (fields "
            "`question` + `golden_answers`, or Search-R1's `prompt` + "
            "`reward_model.ground_truth.target`)."
        )
    record_id = raw.get("id")
    if record_id is None:
        extra = raw.get("extra_info") or {}
        record_id = extra.get("index", row) if isinstance(extra, dict) else row
    return {
        "id": str(record_id),
        "question": str(question).strip(),
        "golden_answers": answers,
        "data_source": str(raw.get("data_source") or path.stem),
    }


def read_records(path: str | Path) -> list[dict]:
    """Normalised records of one question file."""
    path = Path(path)
    return [normalize_record(raw, path, row) for row, raw in enumerate(read_raw_records(path))]
