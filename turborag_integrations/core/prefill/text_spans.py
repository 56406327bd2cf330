"""Which chunk texts a prompt contains, found by their content in one pass over the prompt.

Frameworks and clients hand over a finished prompt in which the retrieved chunks are anonymous
text; the engine reuses a chunk's KV blob only when told the chunk's text. Asking each known text
whether the prompt contains it costs O(known texts) per request, and a store holds hundreds of
thousands. So each text is filed under its head: its first `PREFIX_CHARS` characters, leading
white space stripped (texts shorter than that under their first `min_chars`). A prompt is scanned
once: every word start in it (the start of the text, or a character after white space) may be
where a chunk begins, since chunkers cut at paragraph, sentence or word boundaries and templates
join chunks with white space. The characters from there are looked up as a head, and each text
filed under them is confirmed by comparing it with the prompt verbatim, so a text whose head
matches but whose rest differs is not found. The cost grows with the prompt's length, not with
how many texts are known; a chunk that starts in the middle of a word in the prompt is not found.

The one text finder: the chunk registry of the LlamaIndex and LangChain adapters
(core/registry.py) and the server's (server/finder.py) both look up prompts here. Prompts given
as token ids (vLLM) are searched the same way over ids (prefill/token_spans.py).
"""

from __future__ import annotations

import re
import threading
from typing import Iterable

PREFIX_CHARS = 64
# Shorter texts are not worth finding: core/registry.py says why.
DEFAULT_MIN_CHARS = 32

_WORD = re.compile(r"\S+")


class ChunkIndex:
    """Chunk texts filed by their heads; thread-safe.

    Texts shorter than `min_chars` (white space aside) are not indexed, for the registry's
    reasons (core/registry.py): reusing a few tokens saves less than stitching them costs.
    """

    def __init__(self, prefix_chars: int = PREFIX_CHARS, min_chars: int = DEFAULT_MIN_CHARS):
        if not 0 < min_chars <= prefix_chars:
            raise ValueError("need 0 < min_chars <= prefix_chars")
        self.prefix_chars = prefix_chars
        self.min_chars = min_chars
        # head -> [(text, how many white space characters precede the head in the text)]
        self._long: dict[str, list[tuple[str, int]]] = {}  # heads of prefix_chars characters
        self._short: dict[str, list[tuple[str, int]]] = {}  # shorter texts, heads of min_chars
        self._texts: set[str] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._texts)

    def __contains__(self, text: str) -> bool:
        return text in self._texts

    def _slot(self, text: str) -> tuple[dict, str, int] | None:
        """(table, head, lead) where `text` is filed; None for a text too short to index."""
        body = text.lstrip()
        if len(body.rstrip()) < self.min_chars:
            return None
        lead = len(text) - len(body)
        if len(body) >= self.prefix_chars:
            return self._long, body[:self.prefix_chars], lead
        return self._short, body[:self.min_chars], lead

    def add(self, texts: Iterable[str]) -> int:
        """Index `texts`; return how many were not indexed before."""
        added = 0
        with self._lock:
            for text in texts:
                slot = self._slot(text) if text not in self._texts else None
                if slot is None:
                    continue
                table, head, lead = slot
                table.setdefault(head, []).append((text, lead))
                self._texts.add(text)
                added += 1
        return added

    def discard(self, text: str) -> None:
        with self._lock:
            if text not in self._texts:
                return
            self._texts.discard(text)
            table, head, lead = self._slot(text)
            bucket = table[head]
            bucket.remove((text, lead))
            if not bucket:
                del table[head]

    def find(self, prompt: str) -> list[str]:
        """The indexed texts `prompt` contains verbatim, each starting at a word start, in the
        order they appear (each once).

        Where two found texts overlap in the prompt, the earlier one is kept, then the longer:
        the rule by which the engine splits a prompt around chunks (core/prefill/segment.py),
        so that every text returned gets its blob used.
        """
        matches = []
        width, short_width = self.prefix_chars, self.min_chars
        with self._lock:
            for word in _WORD.finditer(prompt):
                pos = word.start()
                filed = self._long.get(prompt[pos:pos + width], ())
                if self._short:
                    filed = [*filed, *self._short.get(prompt[pos:pos + short_width], ())]
                for text, lead in filed:
                    start = pos - lead
                    if start >= 0 and prompt.startswith(text, start):
                        matches.append((start, start + len(text), text))
        matches.sort(key=lambda m: (m[0], m[0] - m[1]))
        kept, end = [], 0
        for start, stop, text in matches:
            if start >= end:
                kept.append(text)
                end = stop
        return list(dict.fromkeys(kept))
