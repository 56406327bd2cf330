"""One engine call at a time, in the order requests came, on one thread.

The model uses every core for one generation; two at once would each run at half speed and
share one KV cache pool. So each request hands its work to the `Worker` as a `Job`: the job waits
in a first-in, first-out queue, runs on the worker's thread (the decode loop keeps its torch state
on one thread), and posts its events (text deltas, then the result, or an error) to the event
loop of the request that waits for them.

A request whose client has gone cancels its job: a job cancelled while it waits never runs, and
a running job sees the cancellation at its next text delta, closes the engine's stream (which
releases its KV cache) and frees the worker for the next job.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Callable

# How often a request that waits for its job checks that its client is still connected.
POLL_S = 0.2

Event = tuple[str, object]  # ("delta", str) | ("done", result) | ("error", exception)


class Job:
    """A piece of work for the worker and the events it posts back to one event loop."""

    def __init__(self, work: Callable[["Job"], None], loop: asyncio.AbstractEventLoop):
        self._work = work
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def post(self, kind: str, value: object = None) -> None:
        """Hand an event to the waiting request (called on the worker thread)."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            self.cancel()

    def run(self) -> None:
        if self.cancelled.is_set():
            return
        try:
            self._work(self)
        except BaseException as exc:  # answered by the waiting request; the worker keeps serving
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


class Worker:
    """Runs jobs one at a time, first in first out, on its own thread."""

    def __init__(self, name: str = "turborag-server"):
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._count_lock = threading.Lock()
        self.waiting = 0  # jobs submitted and not started yet
        self.busy = False  # a job is running
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[Job], None]) -> Job:
        """Queue `work` (called on the worker thread with its Job); call from the event loop."""
        job = Job(work, asyncio.get_running_loop())
        with self._count_lock:
            self.waiting += 1
        self._jobs.put(job)
        return job

    def close(self) -> None:
        """Stop the thread once the jobs submitted so far have run."""
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._count_lock:
                self.waiting -= 1
                self.busy = not job.cancelled.is_set()
            try:
                job.run()
            finally:
                with self._count_lock:
                    self.busy = False
