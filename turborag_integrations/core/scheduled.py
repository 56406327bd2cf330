"""A generation submitted to the batch scheduler (core/batching.py): its request, what the worker
reports of it (`RequestOutput`), and the worker's decoding state."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

from .decode.sampling import Sampler
from .decode.selfspec import DraftStats
from .engine import TurboRAGEngine
from .request import Request
from .run import GenerationStats

WITHDRAWN = "the request was withdrawn before its turn"


class RequestCancelled(Exception):
    """The error of a request withdrawn (aborted, or `submit(cancelled=...)`) before its turn."""


@dataclass
class RequestOutput:
    """What the worker reports of one request: the token ids it drew since the last report, and
    whether the request has ended. Every request gets reports in order, the last one `finished`
    (whatever ended it); the worker holds nothing of the request once that one is sent.

    finish_reason (set when finished): "stop" (an end-of-sequence token), "length" (its token
    limit or the end of the context window), "cancelled" (aborted, or its caller's `cancelled`
    event), "error". error: why it failed (its prefill, say), or `RequestCancelled` when it was
    withdrawn before its prefill. stats: the request's figures, filled in by the worker: the
    prefill's from the first report on, all of them (`queue_s`, `mean_batch_size`, drafting)
    once finished. Stop strings are the consumer's: the worker sees ids, not text."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    error: BaseException | None = None
    stats: GenerationStats | None = None


class Scheduled:
    """One submitted generation: the request, where its outputs go, and the worker's decoding
    state (touched by the worker thread only, but `aborted`, which the scheduler's lock guards)."""

    def __init__(self, request_id: str, request: Request, engine: TurboRAGEngine,
                 on_output: Callable[[RequestOutput], None],
                 withdrawn: threading.Event | None = None):
        self.id, self.request, self.engine, self.config = request_id, request, engine, \
            request.config
        self.on_output = on_output
        self.stats = GenerationStats(mode=request.mode)
        self.draft_stats = DraftStats() if request.config.draft else None
        self.aborted = False  # `abort(id)`: nobody wants its tokens any more
        self.withdrawn = withdrawn  # a caller's event that does the same once set
        self.finished = False  # its last output is sent; the worker holds nothing of it
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
        return self.aborted or (self.withdrawn is not None and self.withdrawn.is_set())


class OutputQueue:
    """A request's outputs for a consumer on another thread, which blocks for them: what the
    stream of `BatchScheduler.submit` reads. `put` is the request's `on_output`."""

    def __init__(self):
        self._outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self.finished = False  # the last output has been taken

    def put(self, output: RequestOutput) -> None:
        self._outputs.put(output)

    def get(self) -> RequestOutput:
        output = self._outputs.get()
        self.finished = output.finished
        return output

    def tokens(self, first: RequestOutput) -> Iterator[list[int]]:
        """The token ids of `first` and the outputs after it, in batches of what has arrived by
        each call; raises the error of a request that fails."""
        output = first
        while True:
            batch: list[int] = []
            while True:
                batch += output.token_ids
                if output.error is not None:
                    if batch:
                        yield batch
                    raise output.error
                if output.finished:
                    if batch:
                        yield batch
                    return
                try:
                    output = self._outputs.get_nowait()
                except queue.Empty:
                    break
                self.finished = output.finished
            yield batch
            output = self.get()

    def drain(self) -> None:
        """Wait for the last output (the worker has let go of the request)."""
        while not self.finished:
            self.get()
