"""A small dense retriever over chunks: embed once, cosine top-k with a similarity threshold.

Used by the demo and by RAPID's drafter when no framework retriever is given. Results come
back in document order when asked, as RAPID's drafter reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .embedding import load_embedder


@dataclass
class Hit:
    index: int
    text: str
    score: float


class ChunkRetriever:
    def __init__(self, chunks: Sequence[str], embedder=None, *, batch_size: int = 32,
                 show_progress: bool = False):
        self.chunks = list(chunks)
        self.embedder = embedder or load_embedder()
        vectors = self.embedder.encode(self.chunks, batch_size=batch_size, convert_to_tensor=True,
                                       normalize_embeddings=True, show_progress_bar=show_progress)
        self.vectors = vectors.float().cpu()

    def search(self, query: str, k: int = 4, *, threshold: float | None = None,
               document_order: bool = False) -> list[Hit]:
        if not self.chunks:
            return []
        q = self.embedder.encode([query], convert_to_tensor=True, normalize_embeddings=True)
        scores = (self.vectors @ q.float().cpu()[0]).tolist()
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[:k]
        if threshold is not None:
            ranked = [i for i in ranked if scores[i] >= threshold]
        if document_order:
            ranked.sort()
        return [Hit(i, self.chunks[i], scores[i]) for i in ranked]


