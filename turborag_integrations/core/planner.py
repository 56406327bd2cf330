"""What a corpus will cost before it is ingested: store bytes per tier and encoding hours.

    calibration = calibrate(engine, shape, storage_dtype="int8")   # a few forwards, here
    print(plan(shape, calibration, StoreConfig(storage_dtype="int8")))

The bytes are measured, not modelled: a blob of the planned chunk length is written in the
planned storage dtype to a temporary store (a header, the token ids, then keys and values per
token; int8 adds a scale per group of 64 tokens), so a corpus of chunks of that length costs
that many times its size, to a few header bytes a blob (a lead blob's header names its prompt
head). Chunks whose lengths vary cost about their mean's. The time is measured too: one encoder
batch of chunks of the planned length after the planned context (context encoding), and one
batch of lead blobs after a prompt head, timed after a warm-up on this machine with this model (the faster of two),
so the hours are this machine's. Every chunk is assumed to have its full context; a document's
first chunks have less, so the hours are an upper bound there. Embedding the chunks for the
vector store is not counted.

`turborag store plan` prints it (cli.py).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .engine import TurboRAGEngine
from .prefill.chunk_encoder import ChunkEncoder, token_batches
from .store import KVStore, StoreConfig, default_store_path
from .store.budget import format_size, requested, resolve
from .store.codec import STORAGE_DTYPES

__all__ = ["CorpusShape", "Calibration", "calibrate", "plan", "describe"]

# Tokens of the prompt head lead blobs are timed after: a chat template's system turn and the
# opening of a user turn are about this long.
HEAD_TOKENS = 32


@dataclass(frozen=True)
class CorpusShape:
    """A corpus as the planner sees it: `chunks` chunks of `chunk_tokens` tokens each, encoded
    after `context_tokens` of their document's text (0: alone) and once more after each of
    `heads` prompt heads (lead blobs)."""

    chunks: int
    chunk_tokens: int
    heads: int = 0
    context_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("chunks", "chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        for name in ("heads", "context_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be ≥ 0, not {getattr(self, name)}")

    @property
    def blobs(self) -> int:
        return self.chunks * (1 + self.heads)


@dataclass(frozen=True)
class Calibration:
    """Measured on this machine: bytes of one blob of `chunk_tokens` in `storage_dtype`, and
    seconds to encode a chunk (after its context) and a lead blob, in batches of `batch_size`."""

    model: str
    storage_dtype: str
    chunk_tokens: int
    blob_bytes: int
    chunk_s: float
    lead_s: float
    batch_size: int


def _random_ids(tokenizer, count: int, generator: torch.Generator) -> list[int]:
    """Ordinary token ids (no special ones): the cost of a forward does not depend on them."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = len(tokenizer)
    ids: list[int] = []
    while len(ids) < count:
        drawn = torch.randint(0, vocab, (count,), generator=generator).tolist()
        ids += [i for i in drawn if i not in special][:count - len(ids)]
    return ids


def _blob_bytes(blob, storage_dtype: str) -> int:
    """Bytes a store in `storage_dtype` writes for `blob` (one blob, counted as the store does)."""
    with tempfile.TemporaryDirectory(prefix="turborag-plan-") as folder:
        with KVStore(folder, storage_dtype=storage_dtype, memory_bytes=0, remote_url="") as store:
            store.put(blob)
            return store.disk_usage()["bytes"]


def _timed_batch(encoder: ChunkEncoder, chunks: list[list[int]], contexts: list[list[int]]
                 ) -> float:
    """Seconds per chunk of a batch: the faster of two, after an untimed one of the same shape
    (the first batches of a shape pay for allocations that a long ingestion does not)."""
    encoder.encode_ids(chunks, contexts=contexts)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        encoder.encode_ids(chunks, contexts=contexts)
        times.append(time.perf_counter() - start)
    return min(times) / len(chunks)


def calibrate(engine: TurboRAGEngine, shape: CorpusShape, *, storage_dtype: str = "native",
              seed: int = 0) -> Calibration:
    """Measure a blob's bytes and the encoding time of `shape`'s chunks with `engine`'s model
    and chunk encoder (a few forwards: one batch of chunks, one of lead blobs)."""
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage_dtype {storage_dtype!r}: use one of "
                         f"{', '.join(STORAGE_DTYPES)}")
    encoder = engine.library.encoder
    room = encoder.max_chunk_tokens - encoder.base_position - shape.context_tokens
    if shape.chunk_tokens > room:
        raise ValueError(f"chunks of {shape.chunk_tokens} tokens after {shape.context_tokens} "
                         f"context tokens exceed what the model's window leaves ({room}); "
                         "plan shorter chunks or less context")
    generator = torch.Generator().manual_seed(seed)
    # the batch ingestion forms for chunks of this shape: `batch_size` chunks at most, and at
    # most BATCH_TOKENS tokens of chunk and context (library.encode_chunks)
    length = encoder.base_position + shape.context_tokens + shape.chunk_tokens
    batch = len(token_batches(range(encoder.batch_size), [length] * encoder.batch_size,
                              encoder.batch_size)[0])
    chunks = [_random_ids(engine.tokenizer, shape.chunk_tokens, generator)
              for _ in range(encoder.batch_size)]
    contexts = [_random_ids(engine.tokenizer, shape.context_tokens, generator)
                for _ in range(batch)]
    chunk_s = _timed_batch(encoder, chunks[:batch], contexts)
    [blob] = encoder.encode_ids(chunks[:1])
    blob_bytes = _blob_bytes(blob, storage_dtype)
    lead_s = 0.0
    if shape.heads:
        lead = ChunkEncoder(encoder.model, encoder.tokenizer, encoder.fingerprint,
                            batch_size=encoder.batch_size,
                            anchor_ids=_random_ids(engine.tokenizer, HEAD_TOKENS, generator))
        heads = len(token_batches(range(encoder.batch_size),
                                  [HEAD_TOKENS + shape.chunk_tokens] * encoder.batch_size,
                                  encoder.batch_size)[0])
        lead_s = _timed_batch(lead, chunks[:heads], [[] for _ in chunks[:heads]])
    return Calibration(engine.loaded.name, storage_dtype, shape.chunk_tokens, blob_bytes,
                       chunk_s, lead_s, batch)


def plan(shape: CorpusShape, calibration: Calibration, store: StoreConfig | None = None,
         *, root: str | Path | None = None) -> dict:
    """The corpus's bytes per tier and its encoding time, from `calibration` (same chunk
    length), against the budgets of `store` at `root` (None: the default store folder)."""
    if calibration.chunk_tokens != shape.chunk_tokens:
        raise ValueError(f"the calibration measured chunks of {calibration.chunk_tokens} "
                         f"tokens, not {shape.chunk_tokens}: calibrate this shape")
    store = store or StoreConfig(storage_dtype=calibration.storage_dtype)
    corpus = shape.blobs * calibration.blob_bytes
    where = Path(root) if root is not None else default_store_path()
    existing = next(p for p in (where, *where.parents) if p.exists())
    disk_budget, _ = resolve(requested(store.disk_bytes, store.prefix_bytes),
                             free=shutil.disk_usage(existing).free, held=0)
    seconds = shape.chunks * (calibration.chunk_s + shape.heads * calibration.lead_s)
    tiers = {
        "disk": {"budget_bytes": disk_budget, "holds_bytes": min(corpus, disk_budget)},
        "memory": {"budget_bytes": store.memory_bytes,
                   "holds_bytes": min(corpus, store.memory_bytes)},
    }
    if store.accelerator_bytes:
        tiers["accelerator"] = {"budget_bytes": store.accelerator_bytes,
                                "holds_bytes": min(corpus, store.accelerator_bytes)}
    if store.remote_url:
        tiers["redis"] = {"budget_bytes": None, "holds_bytes": corpus}
    for tier in tiers.values():
        tier["share_of_corpus"] = tier["holds_bytes"] / corpus
    return {"shape": asdict(shape), "calibration": asdict(calibration),
            "blobs": shape.blobs, "corpus_bytes": corpus,
            "bytes_per_token": calibration.blob_bytes / shape.chunk_tokens,
            "encode_hours": seconds / 3600, "tiers": tiers}


def describe(report: dict) -> list[str]:
    """The plan as lines a person reads."""
    shape, cal = report["shape"], report["calibration"]
    lines = [f"{shape['chunks']:,} chunks of {shape['chunk_tokens']} tokens"
             + (f", {shape['heads']} prompt head(s)" if shape["heads"] else "")
             + (f", {shape['context_tokens']} context tokens" if shape["context_tokens"] else "")
             + f" on {cal['model']} ({cal['storage_dtype']}):",
             f"  {report['blobs']:,} blobs of {format_size(cal['blob_bytes'])} "
             f"({report['bytes_per_token']:,.0f} bytes a token): "
             f"{format_size(report['corpus_bytes'])} in all",
             f"  encoding on this machine: {report['encode_hours']:.2f} h "
             f"({cal['chunk_s'] * 1000:.0f} ms a chunk"
             + (f", {cal['lead_s'] * 1000:.0f} ms a lead blob" if shape["heads"] else "")
             + f", batches of {cal['batch_size']})"]
    for name, tier in report["tiers"].items():
        budget = ("no budget" if tier["budget_bytes"] is None
                  else f"budget {format_size(tier['budget_bytes'])}")
        lines.append(f"  {name}: {budget}, holds {format_size(tier['holds_bytes'])} "
                     f"({tier['share_of_corpus']:.0%} of the corpus)")
    return lines
