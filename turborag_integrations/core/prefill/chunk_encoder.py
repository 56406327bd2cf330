"""ChunkEncoder: chunk texts into KV blobs (core/kv/blob.py), with the stock model, in batches.

Anchored encoding: a chunk encoded alone at positions 0..n−1 treats its first token as the start
of a sequence, and the model parks attention there (an attention sink) although at query time the
chunk sits mid-prompt. Encoding it after a fixed anchor text (for example a generic chat-template
head) and keeping only the chunk's own keys and values — positions a..a+n−1, a = anchor length —
gives the chunk the mid-sequence statistics it will have at query time. The anchor's KV is
discarded; `KVBlob.base_position` records a, so re-rotation moves the keys by (target − a).

Context encoding (`context_tokens` > 0): each chunk is encoded after the anchor and then the end
of the text before it in its document (prefill/context.py); that context's KV is discarded like
the anchor's, and the blob's `base_position` counts both.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch

from ..errors import EmptyChunkError
from ..kv.blob import PLAIN, Fingerprint, KVBlob, _digest
from .context import context_token_ids
from ..transformers_api import output_cache

__all__ = ["ChunkEncoder", "anchor_encoding", "chunk_encoding", "chunk_token_ids", "ProgressFn"]

ProgressFn = Callable[[int, int], None]  # (done, total)


def anchor_encoding(anchor_ids: Sequence[int]) -> str:
    """The fingerprint encoding of blobs made after `anchor_ids` ("plain" without an anchor)."""
    if not anchor_ids:
        return PLAIN
    ids = torch.as_tensor(list(anchor_ids), dtype=torch.int64).numpy().tobytes()
    return f"anchor:{len(anchor_ids)}:{_digest(ids, size=8)}"


def chunk_encoding(anchor_ids: Sequence[int], learned=None, context_tokens: int = 0) -> str:
    """The fingerprint encoding of chunk blobs made after `anchor_ids` with the learned
    parameters `learned` (a prefill.encoding.LearnedEncoding, or None: training-free), each
    after up to `context_tokens` tokens of its document's text before it (0: none)."""
    encoding = anchor_encoding(anchor_ids)
    if learned is not None:
        encoding = f"{encoding}+{learned.tag}"
    return f"{encoding}+context:{context_tokens}" if context_tokens else encoding


def chunk_token_ids(tokenizer, text: str, max_tokens: int | None = None) -> list[int]:
    """A chunk's token ids, as every blob of it is keyed: its text alone, no special tokens.

    A function of the tokenizer only, so that a client that has no model (one that sends chunks
    to vLLM's save side, vllm/ingest.py) tokenizes exactly as the encoder does."""
    if not text or not text.strip():
        raise EmptyChunkError("cannot encode an empty chunk: give it some text (whitespace "
                              "alone has nothing to cache)")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise EmptyChunkError(f"chunk {text[:40]!r} produced no tokens")
    if max_tokens is not None and len(ids) > max_tokens:
        raise EmptyChunkError(
            f"chunk of {len(ids)} tokens exceeds the model's window of "
            f"{max_tokens}; split it into smaller chunks")
    return ids


class ChunkEncoder:
    """Encodes chunks of text into KV blobs with the stock model, in batches.

    With `anchor_ids`, every chunk is encoded right after those tokens and keeps only its own
    keys and values (see the module docstring); the blobs' fingerprint records the anchor.
    `context_tokens` is 0 here (plain blobs, prompt heads); the engine gives chunks its own.
    """

    def __init__(self, model, tokenizer, fingerprint: Fingerprint, *, batch_size: int = 8,
                 max_chunk_tokens: int | None = None, anchor_ids: Sequence[int] = (),
                 learned=None, context_tokens: int = 0):
        self.model = model
        self.tokenizer = tokenizer
        self.anchor_ids = list(anchor_ids)
        # learned: a prefill.encoding.LearnedEncoding (soft tokens after the anchor, an
        # encode-only LoRA), or None for the training-free encoding
        self.learned = learned
        if isinstance(context_tokens, bool) or not isinstance(context_tokens, int) \
                or context_tokens < 0:
            raise ValueError(f"context_tokens must be a whole number ≥ 0 (0: no context), not "
                             f"{context_tokens!r}")
        self.context_tokens = context_tokens
        self.fingerprint = fingerprint.with_encoding(
            chunk_encoding(self.anchor_ids, learned, context_tokens))
        self.batch_size = batch_size
        self.max_chunk_tokens = (max_chunk_tokens or int(model.config.max_position_embeddings)) \
            - self.base_position

    @property
    def num_soft(self) -> int:
        return self.learned.num_soft if self.learned is not None else 0

    @property
    def base_position(self) -> int:
        """Where a chunk without context has its first token: after the anchor and the soft
        tokens (a context adds its length; each blob records its own)."""
        return len(self.anchor_ids) + self.num_soft

    def tokenize(self, text: str) -> list[int]:
        return chunk_token_ids(self.tokenizer, text, self.max_chunk_tokens)

    def context_ids(self, text: str | None, chunk_len: int = 0,
                    chunk: str | None = None) -> list[int]:
        """The context a chunk is encoded after (`context_token_ids`): the end of `text`, the
        text before the chunk in its document, less its overlap with the chunk's text `chunk`;
        at most `context_tokens`, fewer when the window leaves less room beside a chunk of
        `chunk_len` tokens; [] without one."""
        return context_token_ids(self.tokenizer, text,
                                 min(self.context_tokens, self.max_chunk_tokens - chunk_len), chunk)

    def encode(self, text: str) -> KVBlob:
        return self.encode_many([text])[0]

    def encode_ids(self, ids_list: Sequence[Sequence[int]],
                   progress: ProgressFn | None = None,
                   contexts: Sequence[Sequence[int]] | None = None) -> list[KVBlob]:
        """Encode token-id chunks, each after the anchor and its context's ids (`contexts`,
        from `context_ids`; none by default). Right padding keeps every real token at its own
        position, and causal attention means no real token ever sees a pad."""
        if contexts is None:
            contexts = [()] * len(ids_list)
        if len(contexts) != len(ids_list):
            raise ValueError(f"{len(contexts)} contexts for {len(ids_list)} chunks: give one "
                             "per chunk (empty for none)")
        heads = [len(self.anchor_ids) + len(c) + self.num_soft for c in contexts]
        order = sorted(range(len(ids_list)), key=lambda i: heads[i] + len(ids_list[i]))
        blobs: list[KVBlob | None] = [None] * len(ids_list)
        device = next(self.model.parameters()).device
        pad_id = self.tokenizer.pad_token_id
        pad_id = 0 if pad_id is None else pad_id
        done = 0
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            lengths = [heads[i] + len(ids_list[i]) for i in batch]
            width = max(lengths)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                # the soft tokens (right before the chunk, where they were trained) hold a
                # placeholder id until their embeddings replace it
                head = self.anchor_ids + list(contexts[i]) + [pad_id] * self.num_soft
                input_ids[row, :lengths[row]] = torch.as_tensor(head + list(ids_list[i]))
                mask[row, :lengths[row]] = 1
            input_ids, mask = input_ids.to(device), mask.to(device)
            with torch.inference_mode():
                if self.learned is None:
                    out = self.model(input_ids=input_ids, attention_mask=mask, use_cache=True,
                                     logits_to_keep=1)
                else:
                    soft_at = torch.as_tensor([heads[i] - self.num_soft for i in batch],
                                              dtype=torch.long)
                    embeds = self.learned.embed(self.model, input_ids, soft_at)
                    with self.learned.active(self.model):
                        out = self.model(inputs_embeds=embeds, attention_mask=mask,
                                         use_cache=True, logits_to_keep=1)
            layers = output_cache(out).layers
            del out  # the batch's cache, contexts and pads included, goes once its rows are cut
            for row, i in enumerate(batch):
                n, a = lengths[row], heads[i]
                # each chunk's own rows only ([L, H, T, D]): stacking the whole batch's cache
                # first would copy the contexts' rows too, twice the cache at the peak
                blobs[i] = KVBlob(
                    token_ids=torch.as_tensor(ids_list[i], dtype=torch.long),
                    keys=torch.stack([layer.keys[row, :, a:n] for layer in layers]).cpu(),
                    values=torch.stack([layer.values[row, :, a:n] for layer in layers]).cpu(),
                    fingerprint=self.fingerprint,
                    base_position=a,
                )
            del layers
            done += len(batch)
            if progress:
                progress(done, len(ids_list))
        return blobs  # type: ignore[return-value]

    def encode_many(self, texts: Iterable[str], progress: ProgressFn | None = None,
                    contexts: Sequence[str | None] | None = None) -> list[KVBlob]:
        """Encode chunk texts; `contexts`: the text before each in its document (or None)."""
        texts = list(texts)
        ids = [self.tokenize(t) for t in texts]
        ctx = None if contexts is None else [
            self.context_ids(c, len(i), t) for c, i, t in zip(contexts, ids, texts, strict=True)]
        return self.encode_ids(ids, progress=progress, contexts=ctx)


# Tokens (chunk and context) one encoding forward reads at most, beside `batch_size` chunks:
# memory follows the tokens, not the chunks. On a 2-core CPU (SmolLM2 fp32, 12 chunks of 400
# tokens after 1,024 context tokens each) a 4,096-token bound peaked 0.8 GB above the loaded
# engine and took 33 s, 2,048 tokens 0.25 GB and 27 s: the CPU's matrix products are as fast
# on one long sequence, and padding to the batch's longest wastes the difference.
BATCH_TOKENS = 2048


def token_batches(items: Sequence[int], lengths: Sequence[int], most: int) -> list[list[int]]:
    """`items` in order, cut into batches of at most `most` items and `BATCH_TOKENS` tokens
    (`lengths`: each item's), each batch at least one item."""
    batches: list[list[int]] = []
    batch: list[int] = []
    tokens = 0
    for item, n in zip(items, lengths):
        if batch and (len(batch) == most or tokens + n > BATCH_TOKENS):
            batches.append(batch)
            batch, tokens = [], 0
        batch.append(item)
        tokens += n
    if batch:
        batches.append(batch)
    return batches
