"""From a prompt and the chunk texts it holds to the segments `prefill` stitches.

`PromptAssembly.segments` splits a prompt around its chunks and attaches their blobs from a
chunk library (core/library.py): a chunk's lead blob where it follows a known prompt head, the
cached prompt head itself, the stock separators between chunks. `recovery_for` decides what a
turbo request recomputes over those segments, once, for the prefill and its stats.
`prompt_head` finds the text a template puts before its chunks, as this assembly stitches it.
"""

from __future__ import annotations

import copy
from typing import Iterable, Sequence

from .config import QueryConfig
from .kv.blob import KVBlob
from .library import ChunkLibrary
from .prefill.anchor import CONTEXT_MARKER, VALUE_MARKER
from .prefill.recovery import NO_RECOVERY, Recovery, SparingExact, without_first
from .prefill.reorder import question_last, user_turn_opener
from .prefill.segment import Piece, is_separator, split_prompt, token_pieces, tokenize_with_starts
from .prefill.stitch import Segment

__all__ = ["PromptAssembly"]


class PromptAssembly:
    """How one engine (or one of its namespace views) turns prompts into segments."""

    def __init__(self, library: ChunkLibrary, tokenizer, query: QueryConfig):
        self.library, self.tokenizer, self.query = library, tokenizer, query
        # the chat template's opener of a user turn, where `question_last` moves chunks to
        self.user_opener = user_turn_opener(tokenizer)

    def over(self, library: ChunkLibrary) -> "PromptAssembly":
        """This assembly reading another library (a namespace view's)."""
        made = copy.copy(self)
        made.library = library
        return made

    def segments(self, prompt: str, chunks: Iterable[str] = (), *,
                 encode_missing: bool = False) -> tuple[list[Segment], int, int]:
        """Split `prompt` around the chunk texts it contains and attach their blobs (no chunks:
        the prompt whole, as a full prefill reads it).

        Returns (segments, cache_hits, cache_misses). A chunk without a blob, or whose text the
        prompt does not contain verbatim, is simply prefilled with the rest.
        """
        library, query = self.library, self.query
        chunks = [c for c in dict.fromkeys(chunks) if c and c.strip()]
        if not chunks:
            return [Segment(prompt)], 0, 0
        if query.question_last:
            prompt = question_last(prompt, chunks, self.user_opener)
        pending = {}
        if query.prefetch:
            # Read all blobs concurrently (threads release the GIL in file I/O) instead of one
            # after another; the first wait below overlaps with the remaining reads.
            keys = {text: library.chunk_key(text) for text in chunks if text in prompt}
            futures = library.store.prefetch(list(keys.values()), library.fingerprint)
            pending = {text: f for text, f in zip(keys, futures)}
        blobs: dict[str, KVBlob | None] = {}

        def blob_of(text: str) -> KVBlob | None:
            if text not in blobs:
                blob = pending[text].result() if text in pending else None
                blobs[text] = blob if blob is not None else library.blob_for(
                    text, encode_missing=encode_missing)
            return blobs[text]

        tokens = tokenize_with_starts(self.tokenizer, prompt)
        if tokens is None:  # no token offsets: each piece is tokenized alone
            pieces = [Piece(text, None, text if is_chunk else None)  # type: ignore[arg-type]
                      for text, is_chunk in split_prompt(prompt, chunks)]
        else:
            pieces = token_pieces(prompt, *tokens, chunks, lambda text: (
                None if (b := blob_of(text)) is None else b.token_ids.tolist()))
        lead = self._lead_head(pieces)
        found = set()
        segments = []
        for i, piece in enumerate(pieces):
            if piece.chunk is not None:
                blob = blob_of(piece.chunk)
                if blob is None:
                    segments.append(Segment(piece.text))
                    continue
                if i == 1 and lead is not None:
                    # the first chunk right after a known prompt head: its lead blob is the
                    # full prefill's KV (core/library.py)
                    blob = library.lead_blob(piece.chunk, lead) or blob
                found.add(piece.chunk)
                # the chunk's tail may merge with the text after it: its leading tokens only
                segments.append(Segment(piece.text, blob if piece.ids is None
                                        else blob.head(len(piece.ids))))
            elif i == 0 and query.cache_prefix and any(p.chunk for p in pieces[1:]) \
                    and not any(c in piece.text for c in chunks):
                # The text before the first chunk (system prompt, template head) sees only
                # itself, exactly like a chunk at position 0: caching it is exact, and it is the
                # same for every query of an app (not so when it holds a retrieved chunk that
                # has no blob: that text is prefilled with the question instead).
                segments.append(Segment(piece.text, library.prefix_blob(piece.text,
                                                                         ids=piece.ids)))
            else:
                separators = library.separator_blobs() if query.separators else {}
                if is_separator(pieces, i, separators):  # "\n\n" between two chunks
                    segments.append(Segment(piece.text, separators[tuple(piece.ids)]))
                else:
                    segments.append(Segment(piece.text, ids=piece.ids))
        return segments, len(found), len(chunks) - len(found)

    def _lead_head(self, pieces: Sequence[Piece]) -> tuple[int, ...] | None:
        """The ids of the prompt head before the first chunk when lead blobs are encoded after
        it (`ChunkLibrary.add_prompt_head`), else None."""
        heads = self.library.prompt_heads
        if not heads or len(pieces) < 2 or pieces[0].chunk is not None \
                or pieces[1].chunk is None:
            return None
        head = pieces[0]
        ids = tuple(head.ids if head.ids is not None
                    else self.tokenizer(head.text, add_special_tokens=False)["input_ids"])
        return ids if ids in heads else None

    def recovery_for(self, segments: Sequence[Segment],
                     recovery: Recovery | None = None) -> Recovery:
        """The recovery that prefill runs for `segments`: `recovery` (None: the configured
        one), and where the first chunk is a lead blob (exact already), less its first-chunk
        part, the other parts sparing that chunk's tokens. A spec is parsed where a setting is
        made (`Request`, `QueryConfig`), not here."""
        if recovery is not None and not isinstance(recovery, Recovery):
            raise TypeError(f"a prefill takes a parsed recovery, not {recovery!r}: pass "
                            f"parse_recovery({recovery!r}), or give the spec to "
                            "engine.generate / engine.stream / Request")
        if recovery is None:
            recovery = self.query.recovery
        if isinstance(recovery, SparingExact):  # resolved already
            return recovery
        if recovery is not NO_RECOVERY and any(self.library.is_lead(s.blob) for s in segments):
            rest = without_first(recovery)
            return rest if rest is NO_RECOVERY else SparingExact(rest, self.library.is_lead)
        return recovery

    def prompt_head(self, rendered: str, marker: str = CONTEXT_MARKER, *,
                    varying: str = VALUE_MARKER) -> str:
        """The text a prompt has before its first chunk, from its template rendered with
        `marker` where the chunks go and `varying` for every other variable (as this assembly
        stitches it: with `question_last`, a question-first turn puts the chunks right after
        the turn's opener). A head that holds a variable changes with every query: refused."""
        head, found, _ = rendered.partition(marker)
        if not found:
            raise ValueError(f"the rendered prompt does not hold the context marker {marker!r}: "
                             "render the template with the marker as its context")
        if self.query.question_last:  # as prefill/reorder.py's question_last turns the prompt
            opener = self.user_opener
            cut = head.rfind(opener) + len(opener) if opener and opener in head else 0
            if head[cut:].strip():  # the user's text before the chunks goes after them
                head = head[:cut]
        if varying and varying in head:
            raise ValueError(
                "the template puts a variable (the question) before the context, so the text "
                "before the chunks changes with every query and no blob can be made for it; "
                "put the context first, or use an engine with question_last=True")
        return head
