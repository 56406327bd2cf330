"""Which chunk texts a prompt may contain: the texts recently ingested or retrieved.

Frameworks hand the LLM a finished prompt, in which the retrieved chunks are anonymous text. The
engine can reuse a chunk's KV blob only if told which texts to look for, so the adapters record
here every text they ingest or retrieve, and the LLM keeps those its prompt contains verbatim.
Matching by text, not by query, makes concurrent queries safe: another query's text is used only
if this prompt really contains it, and then reusing its blob is correct anyway. A text the prompt
does not contain verbatim (a template that truncates or rewrites it) is not found, and prefilled.

Each text may carry the fingerprints of the models it was ingested for, so that an adapter
running another model can say so instead of silently prefilling everything.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable

_BY_ENGINE: "weakref.WeakKeyDictionary[object, ChunkRegistry]" = weakref.WeakKeyDictionary()
_BY_ENGINE_LOCK = threading.Lock()


@dataclass
class RegisteredText:
    text: str
    fingerprints: dict[str, str] = field(default_factory=dict)  # fingerprint id -> model


class ChunkRegistry:
    """A bounded, thread-safe, most-recently-used set of candidate chunk texts.

    Texts shorter than `min_chars` are ignored: a blob of a few tokens saves nothing, and a short
    text would match inside unrelated words of a prompt.
    """

    def __init__(self, capacity: int = 4096, min_chars: int = 1):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.min_chars = min_chars
        self._texts: OrderedDict[str, RegisteredText] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_engine(cls, engine) -> "ChunkRegistry":
        """The registry shared by every adapter built on `engine` (created on first use)."""
        with _BY_ENGINE_LOCK:
            registry = _BY_ENGINE.get(engine)
            if registry is None:
                registry = _BY_ENGINE[engine] = cls()
            return registry

    def add(self, texts: str | Iterable[str], fingerprint_id: str | None = None,
            model: str | None = None) -> None:
        """Register one text or many, optionally with the model they were ingested for."""
        with self._lock:
            for text in [texts] if isinstance(texts, str) else texts:
                if not text or len(text.strip()) < self.min_chars:
                    continue
                entry = self._texts.get(text)
                if entry is None:
                    entry = self._texts[text] = RegisteredText(text)
                else:
                    self._texts.move_to_end(text)
                if fingerprint_id:
                    entry.fingerprints[fingerprint_id] = model or fingerprint_id
            while len(self._texts) > self.capacity:
                self._texts.popitem(last=False)

    def entries_in(self, prompt: str) -> list[RegisteredText]:
        """The registered entries whose text `prompt` contains verbatim, most recent first."""
        with self._lock:
            entries = list(reversed(self._texts.values()))
        return [e for e in entries if e.text in prompt]

    def found_in(self, prompt: str) -> list[str]:
        """The registered texts that `prompt` contains verbatim, most recent first."""
        return [e.text for e in self.entries_in(prompt)]

    def discard(self, text: str) -> None:
        with self._lock:
            self._texts.pop(text, None)

    def clear(self) -> None:
        with self._lock:
            self._texts.clear()

    def __len__(self) -> int:
        return len(self._texts)

    def __contains__(self, text: str) -> bool:
        return text in self._texts
