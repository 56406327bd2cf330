"""Which chunk texts a prompt may contain: the texts recently handed to the LLM by retrieval.

Query engines build the prompt themselves, so the LLM only sees a string. The postprocessor
records the retrieved texts here; the LLM keeps those found verbatim in its prompt. Matching by
text (not by query id) makes concurrent queries safe: a text from another query is used only if
this prompt really contains it, and then reusing its blob is correct anyway.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Iterable

_BY_ENGINE: "weakref.WeakKeyDictionary[object, ChunkRegistry]" = weakref.WeakKeyDictionary()
_BY_ENGINE_LOCK = threading.Lock()


class ChunkRegistry:
    """A bounded, thread-safe, most-recently-used set of chunk texts."""

    def __init__(self, capacity: int = 2048):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._texts: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_engine(cls, engine) -> "ChunkRegistry":
        """The registry shared by every adapter built on `engine` (created on first use)."""
        with _BY_ENGINE_LOCK:
            registry = _BY_ENGINE.get(engine)
            if registry is None:
                registry = _BY_ENGINE[engine] = cls()
            return registry

    def add(self, texts: Iterable[str]) -> None:
        with self._lock:
            for text in texts:
                if not text:
                    continue
                self._texts[text] = None
                self._texts.move_to_end(text)
            while len(self._texts) > self.capacity:
                self._texts.popitem(last=False)

    def found_in(self, prompt: str) -> list[str]:
        """The registered texts that `prompt` contains verbatim."""
        with self._lock:
            texts = list(self._texts)
        return [t for t in texts if t in prompt]

    def clear(self) -> None:
        with self._lock:
            self._texts.clear()

    def __len__(self) -> int:
        return len(self._texts)

    def __contains__(self, text: str) -> bool:
        return text in self._texts
