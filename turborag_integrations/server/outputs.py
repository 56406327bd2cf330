"""The scheduler's token ids turned into each request's events, on the event loop.

The batch scheduler's worker reports each request's new token ids (`RequestOutput`,
core/scheduled.py) to the callback the request was added with. That callback, on the worker's
thread, only hands the output to the request's event loop (`call_soon_threadsafe`); there,
`OutputLoop` turns the ids into text (`RunProgress`: a character split across tokens waits for
its last byte, and a stop string is cut off even when tokens split it) and puts the events on the
request's `asyncio.Queue`, which its HTTP handler reads. A stop string found here, and a client
that leaves (disconnect.py), end the request by id (`BatchScheduler.abort`).

So the worker runs no tokenizer, the event loop no torch, and no thread waits per request: one
worker thread for the model, one event loop for everything else (vLLM's `OutputProcessor` splits
its engine the same way).

    stream = outputs.add("chatcmpl-1", Request(prompt, chunks, config, namespace=tenant))
    while (event := await stream.next()) is not None:  # ("delta", text) … ("done", result)
        ...
"""

from __future__ import annotations

import asyncio
from typing import Callable, Iterable, Protocol

from ..core.batching import BatchScheduler, RequestOutput
from ..core.decode.loop import now
from ..core.request import Request
from ..core.run import GenerationResult, RunProgress

Event = tuple[str, object]  # ("delta", str) | ("done", GenerationResult) | ("error", exception)


class Events(Protocol):
    """What a handler reads a generation's events from: a `RequestStream`, or a RAPID answer's
    (server/rapid.py)."""

    async def next(self) -> Event | None:
        """The next event; None once the generation has ended or was aborted."""


class RequestStream:
    """One request's events, in order: text deltas, then ("done", result) or ("error", exc).
    Read on the event loop it was made on."""

    def __init__(self, request_id: str, stop: Iterable[str],
                 on_end: Callable[[GenerationResult], None] | None):
        self.id = request_id
        self.stop = tuple(stop)
        self.on_end = on_end
        self.started = now()  # its time to first token runs from here
        self.progress: RunProgress | None = None  # made at its first output (which has stats)
        self.aborted = False  # its reader has gone: no more events
        self.stopping = False  # a stop string ended it; its last output is still to come
        self.ended = False  # its last event is queued
        self._events: asyncio.Queue[Event | None] = asyncio.Queue()

    async def next(self) -> Event | None:
        """The next event; None once the stream has ended or was aborted."""
        if self.aborted or (self.ended and self._events.empty()):
            return None
        return await self._events.get()

    def put(self, kind: str, value: object) -> None:
        self.ended = kind != "delta"
        self._events.put_nowait((kind, value))

    def close(self) -> None:
        """Aborted: a reader waiting for an event gets None."""
        self.aborted = True
        self._events.put_nowait(None)


class OutputLoop:
    """The requests in flight on `scheduler`, each with the stream of its events."""

    def __init__(self, scheduler: BatchScheduler):
        self.scheduler = scheduler
        self._streams: dict[str, RequestStream] = {}  # touched on the event loop only

    def __len__(self) -> int:
        return len(self._streams)

    def add(self, request_id: str, request: Request, *,
            on_end: Callable[[GenerationResult], None] | None = None) -> RequestStream:
        """Add a request to the scheduler (as `BatchScheduler.add_request`) and return its
        stream. Call on the event loop. on_end: called there with the result of every
        generation that was prefilled, however it ended (a client that left included), before
        its "done" event."""
        if request_id in self._streams:
            raise ValueError(f"a request with the id {request_id!r} is in flight")
        stream = RequestStream(request_id, request.config.stop, on_end)
        loop = asyncio.get_running_loop()

        def on_output(output: RequestOutput) -> None:  # on the scheduler's worker
            try:
                loop.call_soon_threadsafe(self._process, output)
            except RuntimeError:  # the event loop is closed: nobody reads this request
                self.scheduler.abort(output.request_id)

        self._streams[request_id] = stream
        try:
            self.scheduler.add_request(request_id, request, on_output=on_output)
        except BaseException:
            del self._streams[request_id]
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """The reader of a request has gone (its client left): end it at the scheduler's next
        round, and give its reader None. Its result still reaches `on_end` (as "cancelled")."""
        stream = self._streams.get(request_id)
        if stream is None or stream.aborted:
            return
        stream.close()
        self.scheduler.abort(request_id)

    def _process(self, output: RequestOutput) -> None:
        """On the event loop: one output of the worker's, into its request's events."""
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        if stream.progress is None and output.stats is not None:
            stream.progress = RunProgress(output.stats, self.scheduler.engine.tokenizer,
                                          stream.stop, started=stream.started)
        progress = stream.progress
        if progress is not None and output.token_ids:
            progress.arrived()
            # Past a stop string, or for a reader that has gone, the ids are not turned into
            # text: they only await the request's end.
            for token in output.token_ids:
                if stream.aborted or progress.stopped:
                    break
                delta = progress.push(token)
                if delta:
                    stream.put("delta", delta)
            if progress.stopped and not stream.stopping:
                stream.stopping = True
                self.scheduler.abort(stream.id)  # its last output says when its row is free
        if output.finished:
            self._finish(stream, output)

    def _finish(self, stream: RequestStream, output: RequestOutput) -> None:
        del self._streams[stream.id]
        progress = stream.progress
        if output.error is not None and (progress is None or progress.first_at is None):
            # withdrawn before its prefill, or failed in it: no generation to count
            if not stream.aborted:
                stream.put("error", output.error)
            return
        if progress.stopped:
            reason = "stop"
        elif stream.aborted:  # its client left, even if the answer ended in the same round
            reason = "cancelled"
        elif output.error is not None:
            reason = "length"  # what a run that fails part-way is counted as (core/run.py)
        else:
            reason = output.finish_reason
        result = progress.finish(reason)
        if stream.on_end is not None:
            stream.on_end(result)
        if stream.aborted:
            return
        if output.error is not None:
            stream.put("error", output.error)
            return
        tail = progress.flush()
        if tail:
            stream.put("delta", tail)
        stream.put("done", result)
