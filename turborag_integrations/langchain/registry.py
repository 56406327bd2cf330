"""Which document texts a chat model should look for in its prompts.

LangChain hands a chat model finished messages: by then the retrieved documents are anonymous
text inside a prompt template. The engine can reuse a document's KV blob only if it is told which
texts to look for, so the vector store wrapper records every text it ingests or retrieves here,
and the chat model searches its rendered prompt for those texts. A text the prompt does not
contain verbatim (a template that truncates or rewrites it) is simply not found, and prefilled.

Each text keeps the fingerprints of the models it was ingested for, so that a chat model running
another model can say so instead of silently prefilling everything.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class RegisteredText:
    text: str
    # fingerprint id -> human-readable description of the model that made the blob
    fingerprints: dict[str, str] = field(default_factory=dict)


class ChunkRegistry:
    """A bounded, thread-safe, most-recently-used set of candidate chunk texts.

    Texts shorter than `min_chars` are ignored: a cached blob of a few tokens saves nothing, and
    a short text ("bar") would match inside unrelated words of a prompt.
    """

    def __init__(self, max_texts: int = 4096, min_chars: int = 32):
        self.max_texts = max_texts
        self.min_chars = min_chars
        self._texts: OrderedDict[str, RegisteredText] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, text: str, fingerprint_id: str | None = None, model: str | None = None) -> None:
        if not text or len(text.strip()) < self.min_chars:
            return
        with self._lock:
            entry = self._texts.get(text)
            if entry is None:
                entry = self._texts[text] = RegisteredText(text)
                while len(self._texts) > self.max_texts:
                    self._texts.popitem(last=False)
            else:
                self._texts.move_to_end(text)
            if fingerprint_id:
                entry.fingerprints[fingerprint_id] = model or fingerprint_id

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

    def found_in(self, prompt: str) -> list[RegisteredText]:
        """The registered texts that occur verbatim in `prompt`, most recent first."""
        with self._lock:
            entries = list(reversed(self._texts.values()))
        return [e for e in entries if e.text in prompt]


_DEFAULT = ChunkRegistry()


def default_registry() -> ChunkRegistry:
    """The process-wide registry that wrappers and chat models share unless given their own."""
    return _DEFAULT
