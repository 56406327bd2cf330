"""A hot set instead of the whole corpus: a chunk's blob is made on its k-th retrieval, in the
background, instead of at ingestion.

TurboRAG moves prefill to ingestion, and at a real corpus most chunks are never retrieved, or
once: encoding them all pays for KV nobody reads (docs/kv_store.md, "A hot set"). With
`TurboRAGEngine(admit_after=k)`:

- ingestion through the adapters stores no blob (`engine.encodes_at_ingestion` is False);
- every turbo request counts its retrieved chunks; a chunk without a blob is prefilled with the
  prompt's other plain text — exactly what a full prefill computes for it, so the answer loses
  nothing — and on its k-th retrieval it is queued for encoding;
- one worker thread encodes the queue, storing each blob as it is made (`ChunkLibrary.
  encode_chunks`: atomic writes, nothing partial); a request never waits for it. A full queue
  drops the newest admission (counted): the chunk is queued again on a later retrieval.
- the worker yields to prefills: it starts no encode while a request of its engine is being
  prefilled (the first token is what the hot set must not delay), waiting at most
  `YIELD_S` seconds so that a busy server still makes its blobs. An encode already running
  is not interrupted.
- the counts decay: past `admission_tracked` counted chunks, every count is halved and chunks
  left at zero are forgotten (TinyLFU's ageing), so memory is bounded and old popularity fades.
  By default the window is about the number of chunk blobs the disk budget holds (known after
  the first encode: the budget over that blob's bytes): a chunk must then be retrieved k times
  within about a store's worth of distinct retrievals. benchmarks/hotset.py measured why: at a
  budget of 10% of 100K chunks and Zipf 0.9, a window of the whole corpus encoded 54% of the
  corpus for a hit rate of 0.644, a window of the budget 9.9% for 0.645.

What stays in the store is then the disk tier's business: its byte budget and its eviction by
heat (core/store/eviction.py) keep the chunks read most. An evicted chunk that is retrieved
again is admitted again.

Chunks admitted here are encoded alone: their document's text before them (context encoding)
is not known at query time. Lead blobs for the registered prompt heads are made as at ingestion.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import queue
import threading
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Iterable, Iterator

if TYPE_CHECKING:
    from .library import ChunkLibrary

log = logging.getLogger(__name__)

__all__ = ["Admission", "AdmissionConfig", "AdmissionStats"]


@dataclass(frozen=True)
class AdmissionConfig:
    """admit_after: None encodes every chunk at ingestion (the default); k ≥ 1 encodes a chunk
    in the background on its k-th retrieval instead (1: store on first use, LMCache's policy).

    admission_queue: admissions waiting for the encoder at most; more are dropped until it
    catches up. admission_tracked: chunks whose retrievals are counted before the counts are
    halved; None (the default): about the chunk blobs the disk budget holds, at least
    `MIN_TRACKED` (100,000 until the first blob is encoded)."""

    admit_after: int | None = None
    admission_queue: int = 1024
    admission_tracked: int | None = None

    def __post_init__(self) -> None:
        if self.admit_after is not None and (not isinstance(self.admit_after, int)
                                             or isinstance(self.admit_after, bool)
                                             or self.admit_after < 1):
            raise ValueError(f"admit_after must be an integer ≥ 1 (the retrieval on which a chunk "
                             f"is encoded) or None (every chunk at ingestion), not "
                             f"{self.admit_after!r}")
        for name in ("admission_queue", "admission_tracked"):
            value = getattr(self, name)
            if name == "admission_tracked" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer ≥ 1, not {value!r}")


@dataclass
class AdmissionStats:
    retrievals: int = 0  # chunks counted (one per retrieved chunk and request)
    queued: int = 0  # encodes queued
    dropped: int = 0  # admissions dropped because the queue was full
    encoded: int = 0  # chunks encoded and stored by the worker
    failed: int = 0  # encodes that raised (logged; the chunk stays served by prefill)
    ageings: int = 0  # times every count was halved

    def as_dict(self) -> dict:
        return asdict(self)


_STOP = object()
MIN_TRACKED = 1024
UNSIZED_TRACKED = 100_000  # the window before a blob's size is known
YIELD_S = 5.0  # longest wait of the encoder for a moment with no prefill running


class Admission:
    """Counts retrievals and encodes admitted chunks on one background thread (started on the
    first admission). `saw(library, texts)` is all a request does: counting and a queue put."""

    def __init__(self, config: AdmissionConfig):
        self.config = config
        self.stats = AdmissionStats()
        # (namespace, 16-byte digest of the text), not the text: ≈200 bytes an entry in a dict
        self._counts: dict[tuple[str, bytes], int] = {}
        self._pending: set[tuple[str, bytes]] = set()
        self._queue: queue.Queue = queue.Queue(maxsize=config.admission_queue)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._quiet = threading.Condition(self._lock)
        self._busy = 0  # admissions queued or being encoded
        self._prefilling = 0  # requests being prefilled now
        self.tracked = config.admission_tracked or UNSIZED_TRACKED
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def enabled(self) -> bool:
        return self.config.admit_after is not None

    def saw(self, library: "ChunkLibrary", texts: Iterable[str]) -> None:
        """Count one retrieval of each of `texts` (in `library`'s namespace); queue the encoding
        of those that reach `admit_after` retrievals without a blob. Never blocks."""
        after = self.config.admit_after
        if after is None or self._closed:
            return
        admit = []
        with self._lock:
            for text in dict.fromkeys(texts):
                if not text or not text.strip():
                    continue
                key = (library.namespace,
                       hashlib.blake2b(text.encode(), digest_size=16).digest())
                n = self._counts.get(key, 0) + 1
                self._counts[key] = n
                self.stats.retrievals += 1
                if n >= after and key not in self._pending:
                    admit.append((key, text))
            if len(self._counts) > self.tracked:
                self._age()
        for key, text in admit:
            # a lookup outside the lock: the store may stat a file
            if library.store.contains(library.chunk_key(text)):
                continue
            self._enqueue(library, key, text)

    @contextlib.contextmanager
    def prefilling(self) -> Iterator[None]:
        """Around a request's prefill: the encoder starts nothing new meanwhile."""
        if self.config.admit_after is None:
            yield
            return
        with self._lock:
            self._prefilling += 1
        try:
            yield
        finally:
            with self._lock:
                self._prefilling -= 1
                if not self._prefilling:
                    self._quiet.notify_all()

    def _age(self) -> None:
        self._counts = {k: n // 2 for k, n in self._counts.items() if n // 2}
        self.stats.ageings += 1

    def _enqueue(self, library: "ChunkLibrary", key: tuple[str, bytes], text: str) -> None:
        with self._lock:
            if key in self._pending or self._closed:
                return
            try:
                self._queue.put_nowait((library, key, text))
            except queue.Full:
                self.stats.dropped += 1
                return
            self._pending.add(key)
            self._busy += 1
            self.stats.queued += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="turborag-admission",
                                                daemon=True)
                self._thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            library, key, text = item
            with self._lock:
                self._quiet.wait_for(lambda: not self._prefilling or self._closed, YIELD_S)
            try:
                library.encode_chunks([text])
            except Exception as exc:  # noqa: BLE001 — any failure leaves the chunk to prefill
                log.warning("could not encode an admitted chunk (%s: %s); it stays served by "
                            "prefill and is admitted again on a later retrieval",
                            type(exc).__name__, exc)
                with self._lock:
                    self.stats.failed += 1
            else:
                with self._lock:
                    self.stats.encoded += 1
                if self.config.admission_tracked is None and self.stats.encoded == 1:
                    self._size_window(library, text)
            finally:
                with self._lock:
                    self._pending.discard(key)
                    self._busy -= 1
                    self._idle.notify_all()

    def _size_window(self, library: "ChunkLibrary", text: str) -> None:
        """The counting window: about the chunk blobs the disk budget holds, from the size of
        the first blob encoded."""
        try:
            blob = library.blob_for(text)
            disk, prefix = library.store.disk.budget()
        except Exception:  # noqa: BLE001 — no size known: the window stays as it is
            return
        if blob is None:
            return
        size = sum(t.numel() * t.element_size() for t in (blob.keys, blob.values))
        with self._lock:
            self.tracked = max(MIN_TRACKED, (disk - prefix) // max(1, size))

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued admission is encoded (or failed); False on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    @property
    def queued_now(self) -> int:
        return self._busy

    def close(self, timeout: float = 30.0) -> None:
        """Stop admitting; the worker finishes the encode it is in (the rest of the queue is
        dropped: those chunks are prefilled, as before they were admitted)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is None:
            return
        while True:  # drop what waits, then stop the worker
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
            with self._lock:
                self._busy -= 1
        with self._lock:
            self._pending.clear()
            self._idle.notify_all()
            self._quiet.notify_all()
        self._queue.put(_STOP)
        thread.join(timeout)
