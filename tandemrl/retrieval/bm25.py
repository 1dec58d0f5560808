"""BM25 as Qdrant sparse vectors: our tokenizer and the term-frequency half of BM25 on the passage side.

Qdrant's `Modifier.IDF` multiplies each query term by the collection's inverse document frequency at
search time, so a passage vector carries only the saturated, length-normalised term frequency
`tf·(k1+1) / (tf + k1·(1 − b + b·len/avgdl))` and a query vector carries 1.0 per distinct term; the dot
product is then exactly BM25. Invariant: term ids are a stable hash of the term (no vocabulary file),
so the builder and the server agree without sharing state beyond `avgdl` and the tokenizer version, which
the index records (retrieval/retriever.py tokenizes the queries of an index with the version that built it).
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

TOKEN_RE = re.compile(r"\w+", re.UNICODE)
# Han ideographs (CJK Unified Ideographs A-H, compatibility ideographs, 々〆〇 and the Hangzhou
# numerals), Hiragana and Katakana (halfwidth too): written without spaces, so a run of them is a phrase,
# not a word. Each becomes a term of its own, as Lucene's standard tokenizer does for ideographs and
# Hiragana (it keeps a Katakana run whole, but Katakana compounds run together too). Hangul is not here:
# Korean puts spaces between words.
CJK_CHAR_RE = re.compile(
    "[\u3005-\u3007\u3021-\u3029\u3031-\u3035\u3038-\u303b\u3040-\u30ff\u31f0-\u31ff"
    "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f\U00020000-\U000323af]"
)
# 1: \w+ runs alone (a CJK run was one term); 2: CJK_CHAR_RE characters one term each. Bump it (and keep
# the old behaviour under the old number) whenever tokenize() changes what a passage's terms are: an index
# records the version its vectors were made with, and its queries are tokenized with that version.
TOKENIZER_VERSION = 2
TOKENIZER_VERSIONS = tuple(range(1, TOKENIZER_VERSION + 1))  # every one tokenize() still speaks
# A crude suffix stripper, so that "founded", "founder" and "founding" (or "published" and "publisher")
# share a term. Stop words are kept: IDF already makes them nearly free, and on the generated KB dropping
# them lowered recall (measured with benchmarks/retrieval/retrieval.py's questions).
SUFFIXES = ("ing", "ed", "er", "s")
MIN_STEM_LENGTH = 4


def stem(token: str) -> str:
    for suffix in SUFFIXES:
        if token.endswith(suffix) and len(token) - len(suffix) >= MIN_STEM_LENGTH:
            return token[: -len(suffix)]
    return token


def tokenize(text: str, version: int = TOKENIZER_VERSION) -> list[str]:
    """Case-folded word tokens (`\\w+` runs), stemmed; each Han, Hiragana or Katakana character is a token
    of its own ("東京都庁" -> 東, 京, 都, 庁), so a Chinese or Japanese query matches a passage by shared
    characters, not only by an identical run. Text without those characters tokenizes exactly as with
    `\\w+` alone, and the 1-character CJK tokens are too short for the stemmer. NFC first: in decomposed
    text (NFD: "Côte" as "Co" + U+0302 + "te") a combining accent is no word character, so the word would
    split in two and never match the composed query. `version` 1 is the tokenizer before CJK characters
    were split (an index built then is queried with it)."""
    text = unicodedata.normalize("NFC", text.casefold())
    # spaces around each CJK character, then the same \w+ as for any text: punctuation inside those blocks
    # (・, ゠) is still no word. isascii() costs nothing; the scan costs ~10% of tokenizing English text
    if version >= 2 and not text.isascii():
        text = CJK_CHAR_RE.sub(r" \g<0> ", text)
    return [stem(token) for token in TOKEN_RE.findall(text)]


def term_id(term: str) -> int:
    """A stable 32-bit id (Qdrant sparse indices are u32); collisions are negligible at corpus scale."""
    return int.from_bytes(hashlib.blake2b(term.encode("utf-8"), digest_size=4).digest(), "little")


@dataclass(frozen=True)
class SparseVector:
    indices: list[int]
    values: list[float]


@dataclass(frozen=True)
class BM25Params:
    k1: float = 1.2
    b: float = 0.75
    avgdl: float = 1.0  # mean passage length in tokens, measured by the builder

    def __post_init__(self):
        if self.k1 < 0 or not 0 <= self.b <= 1 or self.avgdl <= 0:
            raise ValueError(
                f"BM25 parameters k1={self.k1}, b={self.b}, avgdl={self.avgdl}: need k1 >= 0, "
                f"0 <= b <= 1 and avgdl > 0."
            )


def mean_length(texts: Iterable[str]) -> float:
    total, count = 0, 0
    for text in texts:
        total += len(tokenize(text))
        count += 1
    return max(total / max(count, 1), 1.0)


def _merge(ids_and_weights: Iterable[tuple[int, float]]) -> SparseVector:
    merged: dict[int, float] = {}
    for index, weight in ids_and_weights:
        merged[index] = merged.get(index, 0.0) + weight  # hash collisions add up instead of clashing
    ordered = sorted(merged.items())
    return SparseVector([index for index, _ in ordered], [weight for _, weight in ordered])


def passage_vector(text: str, params: BM25Params) -> SparseVector:
    counts = Counter(tokenize(text))
    length = sum(counts.values())
    norm = params.k1 * (1.0 - params.b + params.b * length / params.avgdl)
    return _merge((term_id(term), tf * (params.k1 + 1.0) / (tf + norm)) for term, tf in counts.items())


def query_vector(text: str, version: int = TOKENIZER_VERSION) -> SparseVector:
    """Each distinct term once: repeating a word in a query should not outweigh the other words. `version`:
    the tokenizer the index's passage vectors were made with (its index.json)."""
    return _merge((term_id(term), 1.0) for term in set(tokenize(text, version)))
