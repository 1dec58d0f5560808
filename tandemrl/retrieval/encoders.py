"""Dense text encoders: the embedded MiniLM, e5-style models with `query: `/`passage: ` prefixes, or any
sentence-transformers directory.

Invariant: every embedding leaves this module L2-normalised (float32), so the Qdrant cosine distance and
a dot product agree, and queries and passages of one index always go through the same `EncoderSpec`
(the spec string is stored in the index metadata and re-resolved by the server).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tandemrl.host.home import tandem_home

log = logging.getLogger(__name__)

E5_QUERY_PREFIX = "query: "
E5_PASSAGE_PREFIX = "passage: "
# Characters per token is ~4 for English; cutting the raw text at this multiple of the token limit bounds
# the tokenizer's work on a pathological (megabyte-long) query without changing what the model sees.
CHARS_PER_TOKEN_BOUND = 12


@dataclass(frozen=True)
class EncoderSpec:
    """Where the weights are and which prefixes the model was trained with."""

    name: str  # the user-facing spec: "minilm", "e5", "e5:/dir" or "/dir"
    path: Path
    query_prefix: str = ""
    passage_prefix: str = ""


def default_e5_dir() -> Path:
    return tandem_home() / "models" / "e5-base-v2"


def resolve_encoder(spec: str) -> EncoderSpec:
    """Map `minilm | e5 | e5:DIR | DIR` to weights on disk; nothing is downloaded."""
    if spec == "minilm":
        from tandemrl.data.prepare_model import prepare_retriever

        return EncoderSpec(spec, prepare_retriever())
    if spec == "e5" or spec.startswith("e5:"):
        path = default_e5_dir() if spec == "e5" else Path(spec[len("e5:") :]).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"encoder {spec!r}: no e5 weights at {path}. Put an e5-base-v2 sentence-transformers "
                f"directory there, or pass --encoder e5:/path/to/e5-dir."
            )
        return EncoderSpec(spec, path, E5_QUERY_PREFIX, E5_PASSAGE_PREFIX)
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"encoder {spec!r}: not 'minilm', 'e5', 'e5:DIR' nor an existing sentence-transformers directory."
        )
    return EncoderSpec(spec, path)


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class Encoder:
    """A sentence-transformers model plus its prefixes; `encode_*` return normalised float32 [N, dim]."""

    def __init__(self, spec: EncoderSpec, device: str | None = None, batch_size: int = 64):
        from sentence_transformers import SentenceTransformer

        self.spec = spec
        self.batch_size = batch_size
        self.model = SentenceTransformer(
            str(spec.path), device=device or default_device(), local_files_only=True
        )
        self.max_seq_length: int = int(self.model.max_seq_length or 512)
        self.dim: int = int(self.model.get_embedding_dimension())
        log.info(
            "encoder %s (%s): dim %d, max %d tokens", spec.name, spec.path, self.dim, self.max_seq_length
        )

    @classmethod
    def from_name(cls, name: str, device: str | None = None, batch_size: int = 64) -> Encoder:
        return cls(resolve_encoder(name), device=device, batch_size=batch_size)

    def encode_queries(self, texts: list[str]) -> np.ndarray:
        return self._encode([self.spec.query_prefix + text for text in texts])

    def encode_passages(self, texts: list[str]) -> np.ndarray:
        return self._encode([self.spec.passage_prefix + text for text in texts])

    def _encode(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        # The model truncates to max_seq_length tokens itself; the character cut only bounds tokenizer work.
        limit = self.max_seq_length * CHARS_PER_TOKEN_BOUND
        texts = [text[:limit] for text in texts]
        vectors = self.model.encode(
            texts,
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.asarray(vectors, dtype=np.float32)
