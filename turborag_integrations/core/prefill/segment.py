"""Find known chunk texts inside a rendered prompt and split it into segments.

Frameworks build prompts from templates we do not control; what they keep is the chunk text,
verbatim, in their stock templates. So the prompt is searched for each chunk's exact text, and
everything between matches stays plain text. Invariant 6: the segments' texts concatenate back to
the prompt exactly, in order, with nothing lost or repeated.
"""

from __future__ import annotations

from typing import Iterable


def find_chunks(prompt: str, chunks: Iterable[str]) -> list[tuple[int, int, str]]:
    """Non-overlapping (start, end, chunk) matches in prompt order.

    Each distinct chunk text is matched at most once per occurrence; where matches overlap, the
    earlier one wins, then the longer. Chunks of whitespace only are ignored.
    """
    candidates = []
    for chunk in dict.fromkeys(chunks):  # unique, order kept
        if not chunk or not chunk.strip():
            continue
        start = prompt.find(chunk)
        while start != -1:
            candidates.append((start, start + len(chunk), chunk))
            start = prompt.find(chunk, start + len(chunk))
    candidates.sort(key=lambda m: (m[0], -(m[1] - m[0])))
    chosen, end = [], 0
    for match in candidates:
        if match[0] >= end:
            chosen.append(match)
            end = match[1]
    return chosen


def split_prompt(prompt: str, chunks: Iterable[str]) -> list[tuple[str, bool]]:
    """(text, is_chunk) pieces whose texts concatenate to `prompt`."""
    pieces: list[tuple[str, bool]] = []
    cursor = 0
    for start, end, chunk in find_chunks(prompt, chunks):
        if start > cursor:
            pieces.append((prompt[cursor:start], False))
        pieces.append((chunk, True))
        cursor = end
    if cursor < len(prompt):
        pieces.append((prompt[cursor:], False))
    return pieces
