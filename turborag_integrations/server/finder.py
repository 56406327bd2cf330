"""The server's chunk lookup: the texts given to it (ingested, or named in a request), and the
texts the in-process LlamaIndex and LangChain adapters record in the engine's ChunkRegistry.
Both are found in a prompt the same way (core/prefill/text_spans.py): by content, in one pass
over the prompt, whatever the number of known texts. A chunk that starts in the middle of a word
in the prompt is not found (name it in `turborag_chunks` instead).
"""

from __future__ import annotations

from typing import Iterable

from ..core.prefill.text_spans import ChunkIndex
from ..core.registry import DEFAULT_MIN_CHARS, ChunkRegistry


class ChunkFinder:
    """The server's lookup: the texts given to it, indexed here for good, and those of a
    ChunkRegistry (the engine's, where LlamaIndex and LangChain adapters in the same process
    record what they ingest and retrieve), which the registry indexes and forgets itself."""

    def __init__(self, registry: ChunkRegistry | None = None, index: ChunkIndex | None = None):
        self.registry = registry
        self.index = index or ChunkIndex(
            min_chars=registry.min_chars if registry is not None else DEFAULT_MIN_CHARS)

    def __len__(self) -> int:
        return len(self.index)

    def add(self, texts: Iterable[str]) -> int:
        """Index `texts` for good; return how many were not indexed before."""
        return self.index.add(texts)

    def find(self, prompt: str) -> list[str]:
        """The known texts `prompt` contains verbatim (see `ChunkIndex.find`), given or
        registered, in the order they appear."""
        found = self.index.find(prompt)
        if self.registry is not None:
            found += [t for t in self.registry.found_in(prompt) if t not in self.index]
        return sorted(found, key=prompt.find)
