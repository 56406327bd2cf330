"""A request's work on a thread of its own, its events handed to the request's event loop.

The engine's work runs on the batch scheduler's thread (core/batching.py). What waits for it is
blocking code: a `GenerationStream` blocks until its next tokens arrive, a `Future` until its
call has run. Each request runs that waiting as a `Job` on a thread of its own, which posts the
job's events (text deltas, then the result, or an error) to the event loop of the request, so
that the event loop never blocks. A job's thread runs no torch: it waits, and turns tokens into
text.

A request whose client has gone cancels its job; the job passes its `cancelled` event to the
scheduler, which then never prefills a request still waiting and drops one in the batch at its
next round.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable

# How often a request that waits for its job checks that its client is still connected.
POLL_S = 0.2

Event = tuple[str, object]  # ("delta", str) | ("done", result) | ("error", exception)


class Job:
    """`work(job)` on a new thread, and the events it posts back to the caller's event loop.
    Create it on the event loop."""

    def __init__(self, work: Callable[["Job"], None], name: str = "turborag-job"):
        self._work = work
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def cancel(self) -> None:
        self.cancelled.set()

    def post(self, kind: str, value: object = None) -> None:
        """Hand an event to the waiting request (called on the job's thread)."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            self.cancel()

    def _run(self) -> None:
        try:
            self._work(self)
        except BaseException as exc:  # answered by the waiting request
            self.post("error", exc)

    async def next(self, request=None) -> Event | None:
        """The next event. With `request` (a Starlette request), None once its client has
        disconnected; the job is then cancelled."""
        while True:
            if request is not None and await request.is_disconnected():
                self.cancel()
                return None
            try:
                return await asyncio.wait_for(self._events.get(),
                                              POLL_S if request is not None else None)
            except asyncio.TimeoutError:
                continue
