"""Retrieval helpers of the core: token-bounded chunking, the bundled sentence embedder, and
cosine search over a handful of chunks (RAPID's drafter context, the CLI's `ask`)."""

from .search import ChunkRetriever, Hit

__all__ = ["ChunkRetriever", "Hit"]
