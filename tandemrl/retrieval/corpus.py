"""Reading a wiki-18 style corpus (`{"id", "contents"}` jsonl) for the index builder, every record checked.

Invariant: what `read_corpus` yields is what gets indexed, and it is refused whole at the first bad line,
named by its line number: a line that is not a JSON object, `contents` (or `title` + `text`) that is not
non-blank Unicode text, an `id` that is neither a non-empty string nor an integer. Ids follow one rule,
so two records can never share a point: either every record carries an `id`, or none does and each
takes its 0-based line number (blank lines count); a corpus that mixes the two is refused, since a
line number could equal another record's id. `scan_corpus` reads the file once more to refuse
duplicate ids, count the passages and fingerprint the file before anything is encoded.

The file is opened as the files a user names are (`host.files.open_regular`: a regular file, never a FIFO
or a device), but its lines are read here rather than through `host.files.iter_json_lines`, which bounds
the whole file (a corpus of 21M passages runs to many GB, and is bounded per line only) and words its errors
`<what> '<path>' line N ...`, where every corpus error, the record checks below included, reads `<path>:N:`.
JSON is read as strictly as there: a byte-order mark is refused as it is in a question file, and so are
what Python's `json` would otherwise let through, a key given twice in one object (the last would silently
win) and NaN or Infinity (stored in the payload, it would make every answer that holds it invalid JSON).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tandemrl.host.files import open_regular
from tandemrl.retrieval import bm25

MAX_ID_CHARS = 1024
MAX_LINE_BYTES = 16 << 20  # wiki-18's passages are ~100 words
MAX_CORPUS_BYTES = 1 << 50  # no bound on the whole file: only on each line


@dataclass
class CorpusScan:
    num_passages: int
    sha256: str  # of the file's bytes: a rebuild from the same file with the same settings is a no-op
    mean_length: float  # BM25 tokens per passage (its avgdl)


def read_corpus(path: Path) -> Iterator[dict]:
    """Corpus records with a string `id` and `contents`; a record with `title`/`text` instead gets the
    wiki-18 `contents` ("\\"Title\\"\\ntext"). Raises ValueError naming the line of the first bad record."""
    for _, record in numbered_records(path):
        yield record


def numbered_records(path: Path) -> Iterator[tuple[int, dict]]:
    """(1-based line number, record) of every record of `read_corpus`."""
    has_ids: bool | None = None  # decided by the first record
    with open_regular(path, "corpus", MAX_CORPUS_BYTES) as handle:
        for line_no, raw in enumerate(iter(lambda: handle.readline(MAX_LINE_BYTES + 1), b"")):
            where = f"{path}:{line_no + 1}"
            if len(raw) > MAX_LINE_BYTES:  # never hold a line without end (a file of one huge line)
                raise ValueError(
                    f"{where}: a line longer than {MAX_LINE_BYTES >> 20} MiB; a passage is one line of a few KB."
                )
            record = _parse_line(raw, where)
            if record is None:
                continue
            if has_ids is None:
                has_ids = "id" in record
            if ("id" in record) != has_ids:
                raise ValueError(
                    f"{where}: this record {'has' if 'id' in record else 'has no'} 'id' but the first record "
                    f"{'has none' if 'id' in record else 'has one'}. Give every record a unique 'id', or none "
                    "(then each takes its 0-based line number): a mix could make two records share one id."
                )
            record["id"] = _check_id(record["id"], where) if has_ids else str(line_no)
            record["contents"] = _contents(record, where)
            _check_text_fields(record, where)
            yield line_no + 1, record


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


class _NonFinite:
    """What NaN, Infinity or a number beyond float range parses to, so its field can be named."""

    def __init__(self, literal: str):
        self.literal = literal


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    record = dict(pairs)
    if len(record) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(key for key, _ in pairs if key in seen or seen.add(key)))
    return record


def _finite_float(text: str) -> float | _NonFinite:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


_DECODER = json.JSONDecoder(
    object_pairs_hook=_unique_keys, parse_constant=_NonFinite, parse_float=_finite_float
)


def _parse_line(raw: bytes, where: str) -> dict | None:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{where}: not UTF-8 text (byte {error.start} of the line); save the corpus as UTF-8."
        ) from None
    if line.startswith("\ufeff"):  # refused in a question file too (host/files.py)
        raise ValueError(
            f"{where}: the line starts with a byte-order mark (U+FEFF); save the corpus as UTF-8 without "
            "one (e.g. `sed -i '1s/^\\xEF\\xBB\\xBF//' FILE`)."
        )
    if not line.strip():
        return None
    try:
        record = _DECODER.decode(line)
    except _DuplicateKey as error:
        raise ValueError(
            f"{where}: key {_summary(error.key)} appears twice in one object; JSON would keep only the last "
            "value. Give each key once."
        ) from None
    except RecursionError:
        raise ValueError(f"{where}: nested too deeply; a corpus record is a flat JSON object.") from None
    except ValueError as error:  # JSONDecodeError, or an integer too long to convert
        raise ValueError(f"{where}: not valid JSON ({getattr(error, 'msg', error)}).") from None
    if not isinstance(record, dict):
        raise ValueError(
            f'{where}: a corpus record is a JSON object such as {{"id": "1", "contents": "..."}}, '
            f"not a JSON {type(record).__name__}."
        )
    _refuse_non_finite(record, where)
    return record


def _refuse_non_finite(record: dict, where: str) -> None:
    """Refuse the first NaN or infinite number, named by its path in the record (`'score'`, `'m'['x'][2]`)."""
    stack: list[tuple[str, object]] = [(_summary(key), value) for key, value in reversed(record.items())]
    while stack:
        path, value = stack.pop()
        if isinstance(value, _NonFinite):
            raise ValueError(
                f"{where}: field {path} is {value.literal[:20]}, which JSON has no number for (the retrieval "
                "server could not send it back). Use a finite number, a string or null."
            )
        if isinstance(value, dict):
            stack += [(f"{path}[{_summary(k)}]", v) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            stack += [(f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value)))]


def _check_id(value, where: str) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: 'id' must be a non-empty string or an integer, got {_summary(value)}.")
    if len(value) > MAX_ID_CHARS:
        raise ValueError(f"{where}: 'id' has {len(value)} characters; at most {MAX_ID_CHARS}.")
    _check_unicode(value, "'id'", where)
    return value


def _contents(record: dict, where: str) -> str:
    if "contents" in record:
        contents = record["contents"]
        if not isinstance(contents, str):
            raise ValueError(f"{where}: 'contents' must be a string, got {_summary(contents)}.")
    elif "title" in record and "text" in record:
        for key in ("title", "text"):
            if not isinstance(record[key], str):
                raise ValueError(f"{where}: '{key}' must be a string, got {_summary(record[key])}.")
        contents = f'"{record["title"]}"\n{record["text"]}'
    else:
        raise ValueError(
            f"{where}: a corpus record needs 'contents' (or 'title' and 'text'), as in wiki-18's "
            '{"id", "contents"} jsonl.'
        )
    _check_unicode(contents, "'contents'", where)
    if not contents.strip() or contents.strip() == '""':
        raise ValueError(f"{where}: 'contents' is empty; every passage needs text to be found by.")
    return contents


def _check_text_fields(record: dict, where: str) -> None:
    """Every other field is stored as the passage's payload: it must be encodable too."""
    for key, value in record.items():
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                f"{where}: field {_summary(key)} holds text that is not valid Unicode."
            ) from None


def _check_unicode(text: str, field: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{where}: {field} is not valid Unicode ({error.reason} at character {error.start}, a lone "
            "surrogate such as \\ud800); fix the record."
        ) from None


def _summary(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:50]}... ({type(value).__name__})"


def scan_corpus(path: Path) -> CorpusScan:
    """Check every record and refuse duplicate ids, before anything is encoded. Ids are kept as 8-byte
    hashes (wiki-18's 21M ids fit in 170 MB); a hash seen twice is confirmed on the ids themselves."""
    digest = hashlib.sha256()
    with open_regular(path, "corpus", MAX_CORPUS_BYTES) as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    hashes = bytearray()
    num_passages, num_tokens = 0, 0
    for record in read_corpus(path):
        hashes += hashlib.blake2b(record["id"].encode(), digest_size=8).digest()
        num_tokens += len(bm25.tokenize(record["contents"]))
        num_passages += 1
    if num_passages == 0:
        raise ValueError(f"corpus {path} holds no passages; an index needs at least one record.")
    keys = np.frombuffer(bytes(hashes), dtype="<u8")
    ordered = np.sort(keys)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if repeated.size:
        _raise_duplicates(path, set(repeated.tolist()))
    return CorpusScan(num_passages, digest.hexdigest(), num_tokens / num_passages)


def _raise_duplicates(path: Path, suspects: set[int]) -> None:
    lines: dict[str, list[int]] = {}
    for line, record in numbered_records(path):
        key = int.from_bytes(hashlib.blake2b(record["id"].encode(), digest_size=8).digest(), "little")
        if key in suspects:
            lines.setdefault(record["id"], []).append(line)
    duplicated = {pid: found for pid, found in lines.items() if len(found) > 1}
    if duplicated:
        pid, found = next(iter(duplicated.items()))
        more = f" ({len(duplicated)} ids in all)" if len(duplicated) > 1 else ""
        raise ValueError(
            f"{path}: id {_summary(pid)} appears on lines {', '.join(map(str, found[:5]))}{more}; ids must be "
            "unique, or one of the passages would silently replace the other. Give each record its own id."
        )
