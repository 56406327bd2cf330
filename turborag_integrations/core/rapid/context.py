"""The drafter's context: the chunks of a long context it reads instead of the whole.

Either RAPID retrieves them itself (`ContextIndex`: token-bounded chunks of the context, embedded
once per context, searched by cosine against the question), or the caller gives them (a
framework's retriever); either way they reach the drafter in document order (`document_order`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..retrieval.chunking import split_text
from ..retrieval.search import ChunkRetriever


@dataclass
class DrafterContext:
    chunks: list[str]  # in document order
    tokens: int
    retrieved: int  # chunks above the threshold before the budget
    candidates: int  # chunks the context was split into
    budget: int
    retrieval_s: float = 0.0


class ContextIndex:
    """Chunks, their token counts and embeddings for one long context."""

    def __init__(self, context: str, tokenizer, chunk_tokens: int, embedder):
        self.chunks = split_text(context, tokenizer, chunk_tokens)
        self.tokens = [len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in self.chunks]
        self.retriever = ChunkRetriever(self.chunks, embedder)

    def select(self, question: str, *, threshold: float, budget: int) -> tuple[list[int], int, int]:
        """Chunks for `question`: cosine ≥ threshold, best first while they fit in `budget`
        tokens, then back in document order. Returns (indices, tokens, retrieved above the
        threshold)."""
        hits = self.retriever.search(question, k=len(self.chunks), threshold=threshold)
        chosen, used = [], 0
        for hit in hits:  # best first
            n = self.tokens[hit.index]
            if used + n <= budget:
                chosen.append(hit.index)
                used += n
        return sorted(chosen), used, len(hits)


def document_order(context: str, texts: list[str]) -> list[str]:
    """`texts` in the order they stand in `context`; those it does not contain keep their given
    order, after them. The drafter reads its chunks as the document has them, whoever chose
    them."""
    texts = [t for t in texts if t and t.strip()]
    found = sorted((context.find(t), i) for i, t in enumerate(texts) if t in context)
    placed = {i for _, i in found}
    return [texts[i] for _, i in found] + [t for i, t in enumerate(texts) if i not in placed]
