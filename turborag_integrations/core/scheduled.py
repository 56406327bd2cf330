"""A generation submitted to the batch scheduler (core/batching.py): its request, the channel
its tokens go through to the consumer's stream, and the worker's decoding state."""

from __future__ import annotations

import queue
import threading
from typing import Iterator

from .decode.sampling import Sampler
from .decode.selfspec import DraftStats
from .engine import TurboRAGEngine
from .request import Request
from .run import GenerationStats

ADMITTED = object()  # first item of a request's queue once its prefill is done
END = object()  # last item: no more tokens


WITHDRAWN = "the request was withdrawn before its turn"


class RequestCancelled(Exception):
    """Raised by the stream of a request withdrawn (`submit(cancelled=...)`) before its turn."""


class Scheduled:
    """One submitted generation: the request, the channel to its consumer, and the worker's
    decoding state (touched by the worker thread only; the events are the threads' signals)."""

    def __init__(self, request: Request, engine: TurboRAGEngine,
                 cancelled: threading.Event | None = None):
        self.request, self.engine, self.config = request, engine, request.config
        self.stats = GenerationStats(mode=request.mode)
        self.draft_stats = DraftStats() if request.config.draft else None
        self.out: queue.SimpleQueue = queue.SimpleQueue()  # ADMITTED, tokens, END or an error
        self.cancelled = threading.Event()  # the consumer has closed its stream
        self.withdrawn = cancelled  # the caller's event: set, it wants the request no more
        self.released = threading.Event()  # the worker holds nothing of it any more
        self.limit = 0
        self.cache = None
        self.sampler: Sampler | None = None
        self.token = 0  # the last token handed over: the next one fed to the model
        self.position = 0  # where that token goes
        self.count = 0  # tokens handed over
        self.solo: Iterator[int] | None = None  # the decode loop of an unbatched request
        self.steps = 0  # batched steps it took part in
        self.batch_sizes = 0  # the sum of their batch sizes
        self.submitted = 0.0  # when it joined the queue

    @property
    def batched(self) -> bool:
        return self.solo is None

    def dropped(self) -> bool:
        """Whether nobody wants the request's tokens any more."""
        return self.cancelled.is_set() or (self.withdrawn is not None and self.withdrawn.is_set())

    def tokens(self) -> Iterator[list[int]]:
        """What the consumer iterates: the tokens handed over so far, in batches."""
        while True:
            batch = []
            item = self.out.get()
            while True:
                if item is END or isinstance(item, BaseException):
                    if batch:
                        yield batch
                    if item is END:
                        return
                    raise item
                batch.append(item)
                try:
                    item = self.out.get_nowait()
                except queue.Empty:
                    break
            yield batch
