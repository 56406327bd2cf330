"""The engine's chunk library: what ingestion stores and what a prompt's assembly finds.

Keys, encoding and storing chunk blobs (`encode_chunks`, `prepare_chunks`), finding them in the
engine's namespace and then in the shared ones (`blob_for`), the plain blobs of prompt heads
(`prefix_blob`), lead blobs (`add_prompt_head`, `lead_blob`), the stock separators between
chunks, and keeping a blob made while answering (`keep`).

Lead blobs: the retriever puts its best chunk first, right after the template's head, and a
stitched prompt loses most where that chunk holds the answer (docs/accuracy.md). A chunk's KV
computed right after a prompt head is exactly what a full prefill computes for the chunk that
follows that head. An engine told its app's prompt heads (`add_prompt_head`) encodes each chunk
once more after each of them, at ingestion, and a prompt whose first chunk follows a known head
stitches that lead blob: the first chunk exact, at no query-time cost. The other chunks keep
their usual blobs.

`TurboRAGEngine` (core/engine.py) has one (`engine.library`); the library needs only the two
chunk encoders and a store.
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import Callable, Sequence

import xxhash
from cachetools import FIFOCache

from .errors import EmptyChunkError
from .prefill.chunk_encoder import ChunkEncoder, token_batches
from .kv.blob import Fingerprint, KVBlob
from .prefill.segment import tokenize_with_starts
from .prefill.separators import separator_ids
from .store import KVStore, StoreWriteError

log = logging.getLogger(__name__)

__all__ = ["ChunkLibrary", "KeyCache"]


class KeyCache:
    """Chunk texts' store keys, remembered for an engine and all its namespace views together,
    so that one bound (`max_entries`, the oldest forgotten first) holds however many
    namespaces — a server's cache salts — come and go. Thread-safe."""

    def __init__(self, max_entries: int = 65536):
        self._keys: FIFOCache[tuple[str, str], str] = FIFOCache(max_entries)
        self._lock = threading.Lock()  # a cachetools cache is not thread-safe, reads included

    def __len__(self) -> int:
        return len(self._keys)

    def get(self, namespace: str, digest: str) -> str | None:
        with self._lock:
            return self._keys.get((namespace, digest))

    def put(self, namespace: str, digest: str, key: str) -> None:
        with self._lock:
            self._keys[(namespace, digest)] = key


def head_ids(tokenizer, head: str) -> list[int]:
    """The token ids of prompt head `head` as a prompt has them before a chunk. A head alone
    can tokenize otherwise: a BPE tokenizer gives "context:\n\n" one "\n\n" token, but
    "context:\n\nThe…" a "\n" and a "\n" (its last whitespace joins the next word's run).
    So the head is tokenized before a word, and its own tokens kept."""
    if not head:
        return []
    found = tokenize_with_starts(tokenizer, head + _WORD)
    if found is None:  # no offsets: the head alone is what the prompt's pieces get too
        return list(tokenizer(head, add_special_tokens=False)["input_ids"])
    ids, starts = found
    ends = starts[1:] + [len(head) + len(_WORD)]
    return [i for i, end in zip(ids, ends) if end <= len(head)]


_WORD = "The"


class ChunkLibrary:
    """Chunk and prompt-head blobs of one namespace of a store; see the module docstring.

    `encoder` encodes chunks (after the anchor, with the learned encoding if any);
    `prefix_encoder` encodes prompt heads plain, at 0..n−1, as a full prefill does. A view in
    another namespace (`TurboRAGEngine.namespaced`) shares the encoders and the separators of
    its root and binds its own store (`view`).
    """

    def __init__(self, encoder: ChunkEncoder, prefix_encoder: ChunkEncoder, store: KVStore,
                 shared: "tuple[ChunkLibrary, ...]" = ()):
        self.encoder, self.prefix_encoder = encoder, prefix_encoder
        # The fingerprint of chunk blobs (model setup + anchor + encoder), and of prefix blobs.
        self.fingerprint: Fingerprint = encoder.fingerprint
        self.prefix_fingerprint: Fingerprint = prefix_encoder.fingerprint
        self._separators: dict[tuple[int, ...], KVBlob] | None = None
        # prompt head ids -> the encoder of chunks after that head (no anchor, context or learned
        # encoding: exactly a full prefill's KV); one dict for an engine and its views
        self._leads: dict[tuple[int, ...], ChunkEncoder] = {}
        self._bind(store, shared)

    def view(self, store: KVStore, shared: "tuple[ChunkLibrary, ...]" = ()) -> "ChunkLibrary":
        """This library in another namespace's `store`, reading the `shared` libraries too:
        the same encoders, prompt heads, separators and key cache (a shallow copy)."""
        root = getattr(self, "_root", self)
        made = copy.copy(root)
        made._root = root
        made._bind(store, shared, root._keys)
        return made

    def _bind(self, store: KVStore, shared: "tuple[ChunkLibrary, ...]",
              keys: KeyCache | None = None) -> None:
        """Point this library (or a view of it, with its root's `keys`) at one namespace's store."""
        self.store = store
        self.namespace = store.namespace_name
        self._shared = shared
        self._keys = keys if keys is not None else KeyCache()
        self._separator_keys: list[str] | None = None

    def chunk_key(self, text: str) -> str:
        """Key of the (anchored) blob of a chunk."""
        return self._key(text, self.encoder)

    def _key(self, text: str, encoder: ChunkEncoder) -> str:
        # Retrieved chunks and prompt heads come back query after query; remember their keys
        # rather than tokenizing 4K tokens of text again on the TTFT path.
        digest = encoder.fingerprint.encoding + "|" + xxhash.xxh3_128_hexdigest(text.encode())
        key = self._keys.get(self.namespace, digest)
        if key is None:
            key = self.store.key(encoder.fingerprint, encoder.tokenize(text))
            self._keys.put(self.namespace, digest, key)
        return key

    def encode_chunks(self, texts: Sequence[str], *, doc_ids: Sequence[str | None] | None = None,
                      contexts: Sequence[str | None] | None = None,
                      progress: Callable[[int, int], None] | None = None) -> list[str]:
        """Encode and store the blobs of `texts` (skipping those already stored); return keys.

        contexts: for each text, the text before it in its document (prefill/context.py), or
        None; an engine made with `context_tokens` encodes each chunk after the end of it
        (core/prefill/chunk_encoder.py), others ignore it. A blob is keyed by its chunk's
        tokens alone, so that any prompt holding the text finds it: a text stored already keeps
        its blob, whatever came before it the first time (text repeated across documents is
        mostly boilerplate, and one blob per text is what a prompt can look up) — except a blob
        encoded alone (at query time, `prepare_chunks`, where a chunk has no document), which
        a context given here replaces."""
        if contexts is not None and len(contexts) != len(texts):
            raise ValueError(f"{len(contexts)} contexts for {len(texts)} chunks: give one per "
                             "chunk (None for a document's first)")
        ids = [self.encoder.tokenize(t) for t in texts]
        keys = [self.store.key(self.fingerprint, i) for i in ids]
        context: dict[int, list[int]] = {}  # context ids of the chunks to encode
        first: dict[str, int] = {}  # encode each distinct chunk once
        replace: set[str] = set()
        pending_refs: list[tuple[str, str]] = []
        todo = []
        for i, k in enumerate(keys):
            if k in first:
                if doc_ids and doc_ids[i]:
                    pending_refs.append((k, doc_ids[i]))
                continue
            if self.store.contains(k):
                # only a blob encoded alone is replaced, and only by one with a context
                upgrade = self._wants_context(i, contexts) and self._encoded_alone(k)
                context[i] = self._context_of(i, contexts, ids, texts) if upgrade else []
                if not context[i]:
                    if doc_ids and doc_ids[i]:
                        self.store.add_ref(k, doc_ids[i])
                    continue
                replace.add(k)
            else:
                context[i] = self._context_of(i, contexts, ids, texts)
            first[k] = i
            todo.append(i)
        if replace:
            log.info("re-encoding %d stored chunk(s) after their document's context: they "
                     "were encoded alone, at query time", len(replace))
        done_before = len(texts) - len(todo)
        # one blob per chunk, and one more per chunk and prompt head (lead blobs)
        leads = list(self._leads.values())
        total = len(texts) * (1 + len(leads))
        if progress:
            progress(done_before, total)
        # one encoder batch at a time, each blob stored as soon as it is made: an interrupted
        # ingestion resumes where it stopped, and progress moves every batch
        done = done_before
        for batch in token_batches(todo, [len(ids[i]) + len(context[i]) for i in todo],
                                   self.encoder.batch_size):
            blobs = self.encoder.encode_ids([ids[i] for i in batch],
                                            contexts=[context[i] for i in batch])
            for i, blob in zip(batch, blobs):
                self.store.put(blob, doc_id=doc_ids[i] if doc_ids else None,
                               replace=keys[i] in replace)
            done += len(batch)
            if progress:
                progress(done, total)
        for k, doc in pending_refs:
            self.store.add_ref(k, doc)
        for n, encoder in enumerate(leads, start=1):
            self._encode_with(encoder, ids, doc_ids, progress=None if progress is None else (
                lambda done, n=n: progress(len(texts) * n + done, total)))
        return keys

    def _encode_with(self, encoder: ChunkEncoder, ids: Sequence[Sequence[int]],
                     doc_ids: Sequence[str | None] | None,
                     progress: Callable[[int], None] | None = None) -> None:
        """Store `encoder`'s blobs of the chunk ids that have none yet (each distinct chunk
        once); a stored one gains the document's reference. progress(chunks of `ids` done)."""
        todo: dict[str, int] = {}
        for i, chunk in enumerate(ids):
            key = self.store.key(encoder.fingerprint, chunk)
            if key in todo or self.store.contains(key):
                if doc_ids and doc_ids[i] and key not in todo:
                    self.store.add_ref(key, doc_ids[i])
                continue
            todo[key] = i
        order = list(todo.values())
        if order:
            log.info("encoding %d lead blob(s) after a %d-token prompt head", len(order),
                     len(encoder.anchor_ids))
        done_before = len(ids) - len(order)
        if progress:
            progress(done_before)
        # batches bounded by tokens as the plain blobs' are, each stored as it is made: 32
        # 512-token lead blobs held for one call peaked 0.6-0.9 GB above the engine
        done = done_before
        lengths = [len(encoder.anchor_ids) + len(ids[i]) for i in order]
        for batch in token_batches(order, lengths, encoder.batch_size):
            for i, blob in zip(batch, encoder.encode_ids([ids[i] for i in batch])):
                self.store.put(blob, doc_id=doc_ids[i] if doc_ids else None)
            done += len(batch)
            if progress:
                progress(done)

    # ---- lead blobs (see the module docstring) ----------------------------------------------
    def add_prompt_head(self, head: str | Sequence[int]) -> tuple[int, ...]:
        """Encode chunks also right after `head` (a prompt's text before its first chunk, or its
        token ids as the whole prompt has them), from the next ingestion on; returns its ids.

        Each head costs one more encoding and blob per chunk. A prompt whose first chunk
        follows this head exactly then stitches that chunk's lead blob, which equals a full
        prefill's KV (a chunk ingested before the head was added gets its lead blob encoded
        when a prompt first needs it)."""
        ids = tuple(head_ids(self.prefix_encoder.tokenizer, head) if isinstance(head, str)
                    else head)
        if not ids:
            raise ValueError("a prompt head needs at least one token: give the text a prompt "
                             "has before its first chunk")
        if ids not in self._leads:
            e = self.encoder
            self._leads[ids] = ChunkEncoder(e.model, e.tokenizer, e.fingerprint,
                                            batch_size=e.batch_size, anchor_ids=ids)
        return ids

    @property
    def prompt_heads(self) -> list[tuple[int, ...]]:
        """The token ids of the prompt heads chunks are also encoded after."""
        return list(self._leads)

    def is_lead(self, blob: KVBlob | None) -> bool:
        """Whether `blob` is a lead blob (a chunk encoded right after a prompt head)."""
        return blob is not None and any(blob.fingerprint.encoding == e.fingerprint.encoding
                                        for e in self._leads.values())

    def lead_blob(self, text: str, head_ids: Sequence[int]) -> KVBlob | None:
        """The blob of chunk `text` encoded right after the prompt head `head_ids`, encoded and
        kept now if it is missing; None if that head was never added."""
        encoder = self._leads.get(tuple(head_ids))
        if encoder is None:
            return None
        blob = self._blob(text, encoder, encode_missing=False)
        if blob is None:  # a chunk ingested before its head: made now, and it goes with the
            blob = self._blob(text, encoder, encode_missing=True)  # chunk's documents
            if blob is not None:
                self.store.share_refs(self.chunk_key(text), self._key(text, encoder))
        return blob

    def _wants_context(self, i: int, contexts: Sequence[str | None] | None) -> bool:
        return bool(contexts is not None and contexts[i] and self.encoder.context_tokens)

    def _context_of(self, i: int, contexts: Sequence[str | None] | None,
                    ids: Sequence[Sequence[int]], texts: Sequence[str]) -> list[int]:
        """The context ids chunk i is encoded after: [] without a context or context encoding."""
        if not self._wants_context(i, contexts):
            return []
        return self.encoder.context_ids(contexts[i], len(ids[i]), texts[i])

    def _encoded_alone(self, key: str) -> bool:
        """Whether the blob stored under key was encoded with no context before it: its first
        token sat right after the anchor (and soft tokens). Read from its header only."""
        return self.store.base_position(key) == self.encoder.base_position

    def encode_separators(self) -> list[str]:
        """Store the stock separators between chunks ("\\n\\n", "\\n", …) encoded like chunks,
        once per engine; returns their keys. An engine that can only take a stored prefix
        (vLLM's connector, which calls this when it starts) needs them stored to go on past the
        first chunk (core/prefill/separators.py); this engine stitches them from memory."""
        if self._separator_keys is None:
            keys = []
            for ids, blob in self.separator_blobs().items():
                keys.append(self.store.key(self.fingerprint, ids))
                if not self.store.contains(keys[-1]):
                    self.keep(blob)
            self._separator_keys = keys
        return self._separator_keys

    def prepare_chunks(self, texts: Sequence[str], *, doc_ids: Sequence[str | None] | None = None,
                       encode_missing: bool = True, warm: bool = True) -> list[str | None]:
        """Make retrieved chunk texts ready for the next prompt that contains them.

        Encodes (and stores) the blobs of texts that have none yet when `encode_missing`, and
        with `warm` loads the stored ones into the memory tier now, so that the prompt's
        assembly reads RAM rather than disk. Returns each text's key; None for a text with no
        tokens, or without a blob when `encode_missing` is off.
        """
        keys: list[str | None] = []
        missing: list[int] = []
        for i, text in enumerate(texts):
            try:
                key = self.chunk_key(text)
            except EmptyChunkError:
                keys.append(None)
                continue
            holder = next((e for e in (self, *self._shared)
                           if e.store.contains(e.chunk_key(text))), None)
            if holder is not None:
                keys.append(holder.chunk_key(text))
                if warm:
                    holder.store.get(keys[-1], self.fingerprint)
            else:
                keys.append(key if encode_missing else None)
                if encode_missing:
                    missing.append(i)
        if missing:
            self.encode_chunks([texts[i] for i in missing],
                               doc_ids=[doc_ids[i] for i in missing] if doc_ids else None)
            if warm:
                for i in missing:
                    self.store.get(keys[i], self.fingerprint)
        return keys

    def blob_for(self, text: str, *, encode_missing: bool = False) -> KVBlob | None:
        """The (anchored) blob of a chunk text; None if not stored (and not encoded)."""
        return self._blob(text, self.encoder, encode_missing)

    def prefix_key(self, text: str) -> str:
        """Key of the plain (unanchored) blob of a prompt head."""
        return self._key(text, self.prefix_encoder)

    def prefix_blob(self, text: str, *, encode_missing: bool = True,
                    ids: Sequence[int] | None = None) -> KVBlob | None:
        """The blob of text that starts a prompt: encoded alone at 0..n−1, like a full prefill.
        `ids`: its tokens as the whole prompt has them (else the text is tokenized alone)."""
        if ids is None:
            return self._blob(text, self.prefix_encoder, encode_missing)
        if not ids:
            return None
        key = self.store.key(self.prefix_fingerprint, ids)
        blob = self.store.get(key, self.prefix_fingerprint)
        if blob is None and encode_missing:
            [blob] = self.prefix_encoder.encode_ids([list(ids)])
            self.keep(blob, kind="prefix")
        return blob

    def _blob(self, text: str, encoder: ChunkEncoder, encode_missing: bool) -> KVBlob | None:
        try:
            key = self._key(text, encoder)
        except EmptyChunkError:
            return None
        blob = self.store.get(key, encoder.fingerprint)
        if blob is None and encoder is not self.prefix_encoder:
            for other in self._shared:  # read-only namespaces, in order
                blob = other.store.get(other._key(text, encoder), encoder.fingerprint)
                if blob is not None:
                    break
        if blob is None and encode_missing:
            blob = encoder.encode(text)
            # A prompt head is written per query: the store bounds such blobs apart from chunks.
            self.keep(blob, kind="prefix" if encoder is self.prefix_encoder else "chunk")
        return blob

    def keep(self, blob: KVBlob, *, kind: str = "chunk") -> None:
        """Store a blob made while answering. A store that cannot take it (a full disk, a
        read-only folder) costs the cache, never the answer: the KV is already computed, so
        the failure is logged and the query goes on."""
        try:
            self.store.put(blob, kind=kind)
        except StoreWriteError as exc:
            log.warning("KV blob %s not stored, the answer goes on without caching it: %s",
                        blob.key[:12], exc)

    def separator_blobs(self) -> dict[tuple[int, ...], KVBlob]:
        """The stock separators' blobs by their token ids, encoded like chunks once per model
        (core/prefill/separators.py); kept in memory, the same for every namespace."""
        root = getattr(self, "_root", self)
        if root._separators is None:
            runs = separator_ids(self.encoder.tokenizer)
            root._separators = {tuple(r): b for r, b in zip(runs, self.encoder.encode_ids(runs))}
        return root._separators
