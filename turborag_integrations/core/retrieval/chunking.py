"""Split documents into chunks of about N tokens at paragraph, then sentence, boundaries."""

from __future__ import annotations

import re

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_text(text: str, tokenizer, max_tokens: int = 512) -> list[str]:
    """Chunks of at most max_tokens tokens; each chunk is a verbatim slice of `text`, stripped.

    Paragraphs are packed together while they fit; a paragraph too long is split at sentence
    ends, and a sentence too long at token boundaries.
    """
    if max_tokens < 8:
        raise ValueError("max_tokens must be at least 8")

    def count(s: str) -> int:
        return len(tokenizer(s, add_special_tokens=False)["input_ids"])

    pieces: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        para = para.strip()
        if not para:
            continue
        if count(para) <= max_tokens:
            pieces.append(para)
            continue
        for sentence in _SENTENCE_END.split(para):
            if count(sentence) <= max_tokens:
                pieces.append(sentence)
            else:
                ids = tokenizer(sentence, add_special_tokens=False)["input_ids"]
                pieces.extend(tokenizer.decode(ids[i:i + max_tokens]).strip()
                              for i in range(0, len(ids), max_tokens))
    chunks: list[str] = []
    current = ""
    for piece in pieces:
        joined = f"{current}\n\n{piece}" if current else piece
        if current and count(joined) > max_tokens:
            chunks.append(current)
            current = piece
        else:
            current = joined
    if current:
        chunks.append(current)
    return [c for c in chunks if c.strip()]
