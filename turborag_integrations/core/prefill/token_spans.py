"""Find stored chunks inside a prompt given as token ids, with no model and no tokenizer.

An engine that tokenizes prompts itself (vLLM) hands over token ids, not text. A stored blob
knows its chunk's token ids, so a chunk is found in a prompt where those ids occur contiguously.
The ids of a chunk tokenized alone equal its ids inside a prompt when the text around it does not
merge with its edges: chunks that start a line or follow a separator, as in the stock templates.
A chunk whose first or last token merges with its neighbours in the prompt's tokenization is not
found, and is simply computed with the rest.

Entries are filed under their first `head` token ids; a prompt is scanned once, and every
position whose next `head` ids name an entry is confirmed by comparing all of its ids. Overlaps
follow the rule of the text finder (segment.find_chunks): the earlier match wins, then the longer.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class SpanEntry:
    """A stored blob as the finder knows it: its key, its token ids and what kind it is."""

    key: str
    token_ids: tuple[int, ...]
    plain: bool = False  # a prompt-head blob (encoded at 0..n−1): it can only start a prompt


@dataclass(frozen=True)
class SpanMatch:
    start: int
    entry: SpanEntry

    @property
    def end(self) -> int:
        return self.start + len(self.entry.token_ids)


class TokenSpanIndex:
    """Blobs filed by their first token ids; thread-safe. Entries shorter than `min_tokens`
    are not indexed: stitching a few tokens costs more than computing them."""

    def __init__(self, min_tokens: int = 8, head: int = 8):
        if not 0 < head <= min_tokens:
            raise ValueError("need 0 < head <= min_tokens")
        self.min_tokens = min_tokens
        self.head = head
        self._by_head: dict[tuple[int, ...], list[SpanEntry]] = {}
        self._keys: dict[str, tuple[int, ...]] = {}  # key -> the head it is filed under
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def add(self, entries: Iterable[SpanEntry]) -> int:
        """Index entries; return how many were new (an indexed key is kept as it is)."""
        added = 0
        with self._lock:
            for entry in entries:
                if entry.key in self._keys or len(entry.token_ids) < self.min_tokens:
                    continue
                head = entry.token_ids[:self.head]
                self._by_head.setdefault(head, []).append(entry)
                self._keys[entry.key] = head
                added += 1
        return added

    def discard(self, key: str) -> None:
        with self._lock:
            head = self._keys.pop(key, None)
            if head is None:
                return
            bucket = [e for e in self._by_head[head] if e.key != key]
            if bucket:
                self._by_head[head] = bucket
            else:
                del self._by_head[head]

    def find(self, prompt_ids: Sequence[int]) -> list[SpanMatch]:
        """Non-overlapping matches in prompt order; plain entries only at position 0."""
        ids = tuple(prompt_ids)
        h = self.head
        found = []
        with self._lock:
            for start in range(len(ids) - h + 1):
                for entry in self._by_head.get(ids[start:start + h], ()):
                    if entry.plain and start:
                        continue
                    n = len(entry.token_ids)
                    if ids[start:start + n] == entry.token_ids:
                        found.append(SpanMatch(start, entry))
        return non_overlapping(found)


def non_overlapping(found: Iterable[SpanMatch]) -> list[SpanMatch]:
    """Matches in prompt order, none overlapping: the earlier wins, then the longer (the rule
    of the text finder, segment.find_chunks). Also merges the finds of several indexes."""
    kept, end = [], 0
    for match in sorted(found, key=lambda m: (m.start, -len(m.entry.token_ids))):
        if match.start >= end:
            kept.append(match)
            end = match.end
    return kept
