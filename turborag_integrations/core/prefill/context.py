"""The context a chunk is encoded after: the end of the text before it in its document.

A chunk alone does not know what its document said before it — whose policy, which release,
what product a figure belongs to — and a full prefill of a prompt reads that from the text
before the chunk. At ingestion the document is known, so an encoder with `context_tokens` > 0
(prefill/chunk_encoder.py) encodes each chunk after the anchor and then the last
`context_tokens` tokens of the document's text before it: the pieces before it, each less the
overlap a splitter repeats at the start of the next, joined as prompts join chunks, by a blank
line. The context's KV is discarded like the anchor's: the blob still holds exactly the chunk's
own tokens and query time is unchanged.

Everything here is a function of the text and the tokenizer only, so that the adapters (which
know a document's pieces), the HF encoder and a client of vLLM's save side (vllm/ingest.py)
build the same context token for token.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["DEFAULT_CONTEXT_TOKENS", "CONTEXT_JOIN", "context_token_ids", "document_contexts",
           "text_before", "without_overlap"]

# What TurboRAGEngine(context_tokens=) and the vLLM connector default to.
DEFAULT_CONTEXT_TOKENS = 1024
CONTEXT_JOIN = "\n\n"  # how prompts join chunks (LlamaIndex, LangChain's format_docs, ours)
MIN_OVERLAP_CHARS = 16  # a shorter match between two chunks is a coincidence, not an overlap
# The text kept before tokenizing: enough characters for `context_tokens` tokens (a token is far
# shorter than this on average), so that a long document is never tokenized whole per chunk.
CHARS_PER_TOKEN = 16


def without_overlap(before: str, chunk: str) -> str:
    """`before` less its tail that `chunk` repeats: splitters overlap consecutive chunks (by 200
    tokens in LlamaIndex's default), and the text before a chunk is what precedes that overlap."""
    # An overlap starts where `chunk`'s first characters occur in `before`'s tail: only those
    # places are compared, the earliest (the longest overlap) first.
    head = chunk[:MIN_OVERLAP_CHARS]
    start = max(0, len(before) - len(chunk))
    while len(head) == MIN_OVERLAP_CHARS and (i := before.find(head, start)) != -1:
        if chunk.startswith(before[i:]):
            return before[:i]
        start = i + 1
    return before


def text_before(pieces: Iterable[str], chunk: str, context_tokens: int) -> str | None:
    """The document's text before `chunk`, given the pieces before it nearest first: each less
    its overlap with the piece after it, joined by blank lines, only as much of the end as
    `context_tokens` tokens can hold; None without any."""
    budget = context_tokens * CHARS_PER_TOKEN
    parts: list[str] = []
    after, size = chunk, 0
    for piece in pieces:
        if size >= budget:
            break
        part = without_overlap(piece, after).strip()
        if part:
            parts.append(part)
            size += len(part) + len(CONTEXT_JOIN)
        after = piece
    return CONTEXT_JOIN.join(reversed(parts))[-budget:] if parts else None


def document_contexts(pieces: Iterable[str], context_tokens: int) -> list[str | None]:
    """For a document's pieces in order, the text before each (`text_before`); all None when
    `context_tokens` is 0."""
    pieces = list(pieces)
    if not context_tokens:
        return [None] * len(pieces)
    return [text_before((pieces[j] for j in range(i - 1, -1, -1)), piece, context_tokens)
            for i, piece in enumerate(pieces)]


def context_token_ids(tokenizer, text: str | None, limit: int,
                      chunk: str | None = None) -> list[int]:
    """The context a chunk is encoded after: the last `limit` tokens of `text` (the text before
    the chunk in its document, less any overlap with `chunk`) and the blank line that joins
    chunks; [] without text or room. A function of the tokenizer only, like
    `chunk_token_ids`, for clients without a model."""
    if chunk and text:
        text = without_overlap(text, chunk)
    if limit <= 0 or not text or not text.strip():
        return []
    ids = tokenizer(text.rstrip() + CONTEXT_JOIN, add_special_tokens=False)["input_ids"]
    return ids[-limit:]
