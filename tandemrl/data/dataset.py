"""Reading question files: our jsonl (Search-R1 data format) and parquet, including Search-R1's own
parquet layout (`prompt` chat messages, `reward_model.ground_truth.target`).

Invariant: every record comes out as {"id", "question", "golden_answers" (non-empty list of str),
"data_source"}, in file order, or the file is rejected with an error naming the path and the row.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tandemrl.host.files import InputFileError, is_missing, iter_json_lines, open_regular, read_json_document

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet")
WHAT = "data file"


# Search-R1's records (data/convert.py writes ours from them; this reader takes either layout)
QUESTION_MARKER = "Question:"


def searchr1_question(raw: dict) -> str | None:
    """The question inside a Search-R1 prompt: the text after the last "Question:" of the user turn."""
    messages = raw.get("prompt")
    if not messages:
        return None
    if isinstance(messages, str):
        content = messages
    else:
        user_turns = [
            m.get("content", "") for m in messages if isinstance(m, dict) and m.get("role") == "user"
        ]
        content = user_turns[-1] if user_turns else ""
    if QUESTION_MARKER in content:
        content = content.rsplit(QUESTION_MARKER, 1)[1]
    return content.strip() or None


def searchr1_answers(raw: dict) -> list[str] | None:
    """`reward_model.ground_truth.target` as a list of strings (it may be one string or a list)."""
    reward_model = raw.get("reward_model") or {}
    target = (
        (reward_model.get("ground_truth") or {}).get("target") if isinstance(reward_model, dict) else None
    )
    if target is None:
        return None
    if isinstance(target, str):
        return [target]
    return list(target)  # checked as answers by normalize_record: a null element must not become "None"


def iter_raw_records(path: str | Path) -> Iterator[tuple[str, dict]]:
    """(where: "line N" / "row N", record) of a jsonl / json-lines / JSON-array / parquet file, in file
    order. The file is checked as host/files.py checks every file a user names (regular, bounded)."""
    path = Path(path)
    if is_missing(path):
        raise FileNotFoundError(
            f"data file {path} does not exist. Check data.train_data_paths / "
            "data.val_data_paths, or run `tandem prepare kb` to generate the default data."
        )
    open_regular(path, WHAT).close()  # a directory or a pipe is named before its suffix
    if path.suffix not in SUPPORTED_SUFFIXES:
        raise InputFileError(
            f"{WHAT} {str(path)!r} has an unsupported suffix {path.suffix!r}; use one of "
            f"{', '.join(SUPPORTED_SUFFIXES)}."
        )
    if path.suffix == ".parquet":
        yield from _parquet_rows(path)
        return
    if path.suffix == ".json" and _starts_with_bracket(path):
        records = read_json_document(path, WHAT)  # one JSON array of records
        if not isinstance(records, list):
            raise InputFileError(f"{WHAT} {str(path)!r} must hold a JSON array of records or one per line.")
        for row, raw in enumerate(records, start=1):
            if not isinstance(raw, dict):
                raise InputFileError(f"{WHAT} {str(path)!r} row {row} is not a JSON object.")
            yield f"row {row}", raw
        return
    for line_number, raw in iter_json_lines(path, WHAT):
        yield f"line {line_number}", raw


def _starts_with_bracket(path: Path) -> bool:
    with open_regular(path, WHAT) as stream:
        return stream.read(4096).lstrip().startswith(b"[")


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError, ValueError) as error:
        raise InputFileError(
            f"{WHAT} {str(path)!r} is not a readable parquet file ({' '.join(str(error).split())[:200]})."
        ) from None
    for row, raw in enumerate(rows, start=1):
        yield f"row {row}", raw


def read_raw_records(path: str | Path) -> list[dict]:
    """The rows of a jsonl / json-lines / parquet file as dicts, in file order."""
    return [raw for _, raw in iter_raw_records(path)]


def normalize_record(raw: dict, path: Path, row: int, where: str | None = None) -> dict:
    """One row as {"id", "question", "golden_answers", "data_source"} (our or Search-R1's layout); `row`
    (0-based) is the id of a record without one. A field of the wrong type is refused naming the file
    and `where` the record is ("line N", "row N")."""
    where = f"{WHAT} {str(path)!r} {where or f'row {row + 1}'}"
    try:
        question = raw.get("question") or searchr1_question(raw)
        answers, answers_field = raw.get("golden_answers"), "golden_answers"
        if answers is None and "reward_model" in raw:
            answers, answers_field = searchr1_answers(raw), "reward_model.ground_truth.target"
    except (AttributeError, TypeError):  # a Search-R1 field of the wrong shape
        raise InputFileError(
            f"{where}: `prompt` / `reward_model.ground_truth.target` do not have Search-R1's layout."
        ) from None
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(question, str) or not question.strip():
        raise InputFileError(
            f"{where}: {_what_is_wrong('question', question)}; a question and at least one gold answer are "
            "required (fields `question` + `golden_answers`, or Search-R1's `prompt` + "
            "`reward_model.ground_truth.target`)."
        )
    if not isinstance(answers, list) or not answers or not all(_is_answer(a) for a in answers):
        raise InputFileError(
            f"{where}: {_what_is_wrong(answers_field, answers)}; it must be a non-empty list of strings "
            "(or one string)."
        )
    record_id = raw.get("id")
    if record_id is None:
        extra = raw.get("extra_info") or {}
        record_id = extra.get("index", row) if isinstance(extra, dict) else row
    if not isinstance(record_id, (str, int)) or isinstance(record_id, bool):
        raise InputFileError(f"{where}: `id` is {_summary(record_id)}, not a string or an integer.")
    source = raw.get("data_source")
    if source is not None and not isinstance(source, str):
        raise InputFileError(f"{where}: `data_source` is {_summary(source)}, not a string.")
    return {
        "id": str(record_id),
        "question": question.strip(),
        "golden_answers": [str(answer) for answer in answers],
        "data_source": source or path.stem,
    }


def _is_answer(value: Any) -> bool:
    """A string, or a number written as one (`42`); not NaN or infinity, which no answer text matches."""
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return isinstance(value, (str, int, float)) and not isinstance(value, bool) and str(value).strip() != ""


def _what_is_wrong(field: str, value: Any) -> str:
    if value is None:
        return f"no `{field}`"
    return f"`{field}` is empty" if value in ("", []) else f"`{field}` is {_summary(value)}"


def _summary(value: Any) -> str:
    from tandemrl.config.errors import value_summary

    return value_summary(value)


def read_records(path: str | Path) -> list[dict]:
    """Normalised records of one question file; an empty file is refused naming it."""
    path = Path(path)
    records = [
        normalize_record(raw, path, row, where) for row, (where, raw) in enumerate(iter_raw_records(path))
    ]
    if not records:
        raise InputFileError(f"{WHAT} {str(path)!r} holds no records.")
    return records
