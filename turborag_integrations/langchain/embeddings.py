"""LangChain `Embeddings` over a sentence-transformers model (the bundled MiniLM by default).

`langchain-huggingface` is not a dependency; this adapter is all the vector store wrapper needs
to run offline with the embedding model that ships with the package.
"""

from __future__ import annotations

from langchain_core.embeddings import Embeddings

from ..core.retrieval.embedding import load_embedder


class SentenceTransformerEmbeddings(Embeddings):
    """Normalised sentence embeddings (cosine = dot product), computed locally."""

    def __init__(self, model_name_or_path: str | None = None, *, device: str = "cpu",
                 batch_size: int = 32):
        self.model_name_or_path = model_name_or_path
        self.batch_size = batch_size
        self._model = load_embedder(model_name_or_path, device)

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        if not texts:
            return []
        vectors = self._model.encode(list(texts), batch_size=self.batch_size,
                                     normalize_embeddings=True, show_progress_bar=False)
        return vectors.tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]
