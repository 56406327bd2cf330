"""Find known chunk texts inside a rendered prompt and split it into segments.

Frameworks build prompts from templates we do not control; what they keep is the chunk text,
verbatim, in their stock templates. So the prompt is searched for each chunk's exact text, and
everything between matches stays plain text. Invariant 6: the segments' texts concatenate back to
the prompt exactly, in order, with nothing lost or repeated.

A full prefill reads the prompt's own tokenization, and a stitched prompt must read the same
tokens: tokenized piece by piece, the text around chunks often comes out otherwise ("\n\n"
alone is one token in SmolLM2's vocabulary; between a sentence and a word the whole prompt has
two), and a small model answers a different token sequence differently even with exact KV
(measured: the reply changed on 8 of the first 24 hand-written dev items). So
`token_pieces` cuts the prompt's own token ids: a chunk is used where its own ids (those of its
blob) occur at its place in the prompt's tokenization — all of them, or the leading ones when
its last tokens merge with the text after it — and every other token is the prompt's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence


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


@dataclass(frozen=True)
class Piece:
    """A run of the prompt's own tokens: plain text, or the leading `len(ids)` tokens of
    `chunk`'s blob (all of them unless its tail merges with the text after it)."""

    text: str  # the prompt's characters from this run's first token to the next run's
    ids: tuple[int, ...]
    chunk: str | None = None


def tokenize_with_starts(tokenizer, prompt: str) -> tuple[list[int], list[int]] | None:
    """The prompt's token ids and the character at which each token starts; None for a
    tokenizer that cannot tell where its tokens start (a slow tokenizer without offsets)."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    out = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
    starts, last = [], 0
    for begin, _ in out["offset_mapping"]:
        last = max(last, begin)  # a multi-token character repeats its offsets
        starts.append(last)
    return list(out["input_ids"]), starts


def token_pieces(prompt: str, prompt_ids: Sequence[int], starts: Sequence[int],
                 chunks: Iterable[str],
                 chunk_ids: Callable[[str], Sequence[int] | None]) -> list[Piece]:
    """Cut the prompt's own tokens into plain runs and chunk runs (see the module docstring).

    `chunk_ids(text)` gives a chunk's own token ids (its blob's), or None when it has no blob.
    A chunk is used where a prompt token starts at the chunk's first character and the prompt's
    ids from there begin with the chunk's; it covers the longest such common run. Matches follow
    `find_chunks`' overlap rule. The pieces' ids concatenate to `prompt_ids`, their texts to
    `prompt`.
    """
    at: dict[int, int] = {}
    for index, char in enumerate(starts):
        at.setdefault(char, index)
    runs: list[tuple[int, int, str]] = []  # (first token, tokens, chunk)
    cursor = 0
    for start, _, chunk in find_chunks(prompt, chunks):
        first = at.get(start)
        if first is None or first < cursor:
            continue  # the chunk's first character is inside a token of the text before it
        own = chunk_ids(chunk)
        if not own:
            continue
        n = 0
        limit = min(len(own), len(prompt_ids) - first)
        while n < limit and prompt_ids[first + n] == own[n]:
            n += 1
        if n:
            runs.append((first, n, chunk))
            cursor = first + n

    def char(index: int) -> int:
        return len(prompt) if index >= len(starts) else (0 if index == 0 else starts[index])

    pieces: list[Piece] = []
    done = 0
    for first, n, chunk in runs:
        if first > done:
            pieces.append(Piece(prompt[char(done):char(first)], tuple(prompt_ids[done:first])))
        pieces.append(Piece(prompt[char(first):char(first + n)],
                            tuple(prompt_ids[first:first + n]), chunk))
        done = first + n
    if done < len(prompt_ids):
        pieces.append(Piece(prompt[char(done):], tuple(prompt_ids[done:])))
    return pieces


def is_separator(pieces: Sequence[Piece], i: int, runs) -> bool:
    """Whether plain piece i lies between two chunks and is one of `runs` (token-id tuples of
    the stock separators, separators.separator_ids): stitched from its stored blob, like a
    chunk, by every engine (vLLM's connector can take only a run of stored KV)."""
    return (0 < i < len(pieces) - 1 and pieces[i].chunk is None
            and pieces[i - 1].chunk is not None and pieces[i + 1].chunk is not None
            and pieces[i].ids is not None and tuple(pieces[i].ids) in runs)
