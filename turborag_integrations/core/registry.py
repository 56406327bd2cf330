"""Which chunk texts a prompt may contain: the texts recently ingested or retrieved.

Frameworks hand the LLM a finished prompt, in which the retrieved chunks are anonymous text. The
engine can reuse a chunk's KV blob only if told which texts to look for, so the adapters record
here every text they ingest or retrieve, and the LLM keeps those its prompt contains verbatim.
Matching by text, not by query, makes concurrent queries safe: another query's text is used only
if this prompt really contains it, and then reusing its blob is correct anyway. A text the prompt
does not contain verbatim (a template that truncates or rewrites it) is not found, and prefilled.
Texts are found as the server finds its own (core/prefill/text_spans.py): filed by their heads,
in one pass over the prompt, so a lookup costs the prompt's length, not the registry's.

One registry per engine. `ChunkRegistry.for_engine(engine)` is what every adapter built on an
engine uses unless it is given `registry=`, from LlamaIndex and LangChain alike: texts are worth
looking for only where that engine's store can hold their blobs, so the ingesting side and the
generating side must meet in the same registry, and an engine running another model must not be
sent looking for them. Pass one registry explicitly to share it across engines.

Texts shorter than `DEFAULT_MIN_CHARS` (32 characters, about 6 to 10 tokens) are not registered:
reusing the blob of a few tokens saves less than finding and stitching it costs, and a short text
(a word, a heading) also occurs inside unrelated text, where splitting the prompt around it would
cut the prompt's tokenization at a false boundary.

Each text may carry the fingerprints of the models it was ingested for, so that an LLM running
another model says so (`FingerprintMismatch`) instead of silently prefilling everything.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable

from .errors import FingerprintMismatch
from .prefill.text_spans import DEFAULT_MIN_CHARS, PREFIX_CHARS, ChunkIndex

_BY_ENGINE: "weakref.WeakKeyDictionary[object, ChunkRegistry]" = weakref.WeakKeyDictionary()
_BY_ENGINE_LOCK = threading.Lock()


@dataclass
class RegisteredText:
    text: str
    fingerprints: dict[str, str] = field(default_factory=dict)  # fingerprint id -> model
    used: int = 0  # when it was last added: the larger, the more recent


def mismatch(current, recorded_id: str, recorded_model: str | None,
             where: str) -> FingerprintMismatch:
    """The error for `where` (a store, a document), ingested for another model than `current`.

    `current` is the engine that met it, or that engine's `Fingerprint`.
    """
    fp = getattr(current, "fingerprint", current)
    return FingerprintMismatch(
        f"{where} was ingested for another model: {recorded_model or '?'} (fingerprint "
        f"{recorded_id}), but this engine runs {fp.describe()} (fingerprint {fp.id}). Its KV "
        "blobs cannot be used with this model: use the model that built the store, or re-ingest "
        "the documents with this one (a new collection or store directory).")


class ChunkRegistry:
    """A bounded, thread-safe, most-recently-used set of candidate chunk texts.

    Texts shorter than `min_chars` are ignored (see the module docstring for the default).
    """

    def __init__(self, capacity: int = 4096, min_chars: int = DEFAULT_MIN_CHARS):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.min_chars = min_chars
        self._texts: OrderedDict[str, RegisteredText] = OrderedDict()
        # the same texts, filed for finding in a prompt (prefill/text_spans.py)
        self._index = ChunkIndex(max(PREFIX_CHARS, min_chars), min_chars)
        self._clock = 0
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
                    self._index.add([text])
                else:
                    self._texts.move_to_end(text)
                self._clock += 1
                entry.used = self._clock
                if fingerprint_id:
                    entry.fingerprints[fingerprint_id] = model or fingerprint_id
            while len(self._texts) > self.capacity:
                self._index.discard(self._texts.popitem(last=False)[0])

    def entries_in(self, prompt: str, *, fingerprint=None) -> list[RegisteredText]:
        """The registered entries whose text `prompt` contains verbatim, most recent first.

        With `fingerprint` (the generating engine's `Fingerprint`), raise FingerprintMismatch
        if one of them was ingested only for other models: their blobs cannot serve this one,
        and a store built for another model is a mistake worth naming. Texts registered without
        a fingerprint pass.
        """
        with self._lock:
            found = [self._texts[t] for t in self._index.find(prompt) if t in self._texts]
        found.sort(key=lambda e: -e.used)
        if fingerprint is not None:
            for entry in found:
                if entry.fingerprints and fingerprint.id not in entry.fingerprints:
                    recorded, model = next(iter(entry.fingerprints.items()))
                    preview = entry.text[:60].replace("\n", " ")
                    raise mismatch(fingerprint, recorded, model,
                                   f"a document in this prompt ({preview!r}…)")
        return found

    def found_in(self, prompt: str, *, fingerprint=None) -> list[str]:
        """The registered texts that `prompt` contains verbatim, most recent first (checked
        against `fingerprint` as in `entries_in`)."""
        return [e.text for e in self.entries_in(prompt, fingerprint=fingerprint)]

    def discard(self, text: str) -> None:
        with self._lock:
            if self._texts.pop(text, None) is not None:
                self._index.discard(text)

    def clear(self) -> None:
        with self._lock:
            self._texts.clear()
            self._index = ChunkIndex(self._index.prefix_chars, self.min_chars)

    def texts(self) -> list[str]:
        """Every registered text, most recent last (a snapshot)."""
        with self._lock:
            return list(self._texts)

    def __len__(self) -> int:
        return len(self._texts)

    def __contains__(self, text: str) -> bool:
        return text in self._texts
